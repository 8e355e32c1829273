"""Dozing end to end (``controlplane/lifecycle/dozing.py``, ``python_backend/doze.py``): `snoozectl serve` with a
real tritonserver, in both topologies. An idle preforked model dozes (its worker ends, its stub stays, Triton keeps
it ready), a request through the gateway wakes it without a Triton load, and the wake is counted from doze."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from harness.probes import until_async
from harness.reliability import infer_once

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "models"

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def serve(serve_factory, package, topology):
    serve = serve_factory(f"doze-{topology}", topology=topology, doze_after_secs="2")  # margin for a slow machine
    serve.start()
    serve.publish("dozer", package, worker="preforked", idle_timeout_secs=600)
    serve.publish("onnx-dozer", EXAMPLES / "onnx-mlp", worker="preforked", idle_timeout_secs=600)
    return serve


async def test_an_idle_preforked_model_dozes_and_a_request_wakes_it_without_a_load(serve):
    x = np.array([[1.0, 2.0]], np.float32)
    first = await infer_once(serve, "dozer", "grpc", x)
    assert not isinstance(first, str), first
    [(worker, stub)] = serve.workers("dozer")
    loads = (await asyncio.to_thread(serve.status, "dozer"))["load_count"]

    def level() -> str:
        return str(serve.status("dozer")["level"])

    await until_async(lambda: level() == "dozing", "the idle model to doze", timeout=30)
    assert serve.workers("dozer") == [] and serve.stub_pids("dozer") == [stub]  # the worker ended, the stub stays
    status = await asyncio.to_thread(serve.status, "dozer")
    assert status["state"] == "ready" and status["load_count"] == loads

    answers = await asyncio.gather(*(infer_once(serve, "dozer", "grpc", x) for _ in range(4)))
    assert all(not isinstance(a, str) and a.tolist() == first.tolist() for a in answers), answers
    # one wake served them all: one new worker, in the same stub (its note may land just after the answers)
    await until_async(lambda: serve.workers("dozer"), "the woken worker's note", timeout=10)
    [(woken, same_stub)] = serve.workers("dozer")
    assert same_stub == stub and woken != worker
    await until_async(lambda: level() == "awake", "the wake to be heard", timeout=30)
    assert (await asyncio.to_thread(serve.status, "dozer"))["load_count"] == loads  # no Triton load
    assert serve.metric("snooze_wakes_total", model="dozer", origin="doze") == 1
    listing = await asyncio.to_thread(serve.snoozectl, "status")
    assert "dozer" in listing.stdout


def onnx_infer(serve, x: np.ndarray) -> np.ndarray:
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(serve.grpc_url) as client:
        tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return client.infer("onnx-dozer", [tensor], client_timeout=60).as_numpy("output")


async def test_a_preforked_onnx_model_dozes_its_session_away_and_wakes_on_a_request(serve):
    x = np.ones((1, 4), np.float32)
    first = await asyncio.to_thread(onnx_infer, serve, x)
    [(worker, stub)] = serve.workers("onnx-dozer")
    await until_async(lambda: serve.status("onnx-dozer")["level"] == "dozing", "the ONNX model to doze", timeout=30)
    assert serve.workers("onnx-dozer") == [] and serve.stub_pids("onnx-dozer") == [stub]
    again = await asyncio.to_thread(onnx_infer, serve, x)
    np.testing.assert_allclose(again, first, rtol=1e-6)
    [(woken, same_stub)] = serve.workers("onnx-dozer")
    assert same_stub == stub and woken != worker
    await until_async(lambda: serve.metric("snooze_wakes_total", model="onnx-dozer", origin="doze") == 1, "its wake")


@pytest.fixture(scope="module")
def pressed(serve_factory, package, topology):
    """Three preforked models of ~175 MiB under a budget that holds two awake (tests/reliability/test_memory_budget.py's
    figures), dozing only under pressure (doze_after_secs far off)."""
    serve = serve_factory(f"doze-pressed-{topology}", topology=topology, memory_budget_mb="540", doze_after_secs="500",
                          eviction_policy="lru")  # fmt: skip
    serve.start()
    for name in "abc":
        serve.publish(f"big-{name}", package, params={"ballast_mb": 150}, worker="preforked", idle_timeout_secs=600)
    yield serve
    serve.stop()


def levels(serve) -> list[str]:
    return [str(serve.status(f"big-{n}")["level"]) for n in "abc"]


async def test_under_memory_pressure_the_least_recently_used_model_dozes_instead_of_unloading(pressed):
    x = np.ones((1, 2), np.float32)
    workers = {}
    for name in "abc":  # whatever ran before (each wake from doze asks room first, the last test)
        answer = await infer_once(pressed, f"big-{name}", "grpc", x)
        assert not isinstance(answer, str), answer
        if name == "a":  # a worker woken from doze writes its note as it starts: it may land after the answer
            await until_async(lambda: pressed.workers("big-a"), "big-a's worker", timeout=10)
            [(workers["a"], stub_a)] = pressed.workers("big-a")
    # a wake from doze on the warm path is heard at the next sweep: the levels settle within one
    await until_async(lambda: levels(pressed) == ["dozing", "awake", "awake"], "a to doze, b and c awake", timeout=10)
    statuses = {n: await asyncio.to_thread(pressed.status, f"big-{n}") for n in "abc"}
    assert pressed.workers("big-a") == [] and pressed.stub_pids("big-a") == [stub_a]  # its worker went, its stub stays
    assert statuses["a"]["memory_bytes"] < 60 * 2**20, statuses["a"]  # charged its stub
    assert pressed.metric("snooze_evictions_total", model="big-a", reason="memory") == 0
    runtime = await asyncio.to_thread(pressed.api().runtime)
    assert sum(s["memory_bytes"] for s in statuses.values()) + runtime["overhead_bytes"] <= 540 * 2**20, statuses


async def test_a_request_straight_to_a_dozing_model_under_pressure_makes_room_before_its_stub_forks(pressed):
    """The warm path: the gateway sends a request for a READY (dozing) model straight to Triton, and its stub wakes
    it there. The stub asks the control plane for room first (``python_backend/doze.py``, over ``wake.sock``), which
    dozes the least recently used idle model before the fork: the tree never holds three awake in a budget of two."""
    x = np.ones((1, 2), np.float32)
    for name in "abc":  # whatever ran before: two awake, the least recently used (a) dozing
        answer = await infer_once(pressed, f"big-{name}", "grpc", x)
        assert not isinstance(answer, str), answer
    await until_async(lambda: levels(pressed) == ["dozing", "awake", "awake"], "a to doze, b and c awake", timeout=10)

    def rooms() -> float:
        return pressed.metric("snooze_doze_wake_rooms_total", model="big-a", outcome="room")

    before = rooms()
    answer = await infer_once(pressed, "big-a", "grpc", x)
    assert not isinstance(answer, str), answer
    assert rooms() == before + 1  # asked, and room was made before it forked
    # b, the least recently used, dozed for it (a's own wake is heard at the next sweep)
    await until_async(lambda: levels(pressed) == ["awake", "dozing", "awake"], "b to doze, a and c awake", timeout=10)
    assert pressed.metric("snooze_doze_wake_rooms_total", model="big-a", outcome="over_budget") == 0
