"""Loads that go wrong while other models serve: out of memory at load, and a load() that hangs.

Out of memory: the lifecycle evicts the least recently used idle model and retries once, then the
client gets a clear 503 / UNAVAILABLE naming the cause. A hang: the load is abandoned after the
model's load_timeout_secs, its stub killed, the model marked failed with that reason, and a later
request tries again. Traffic on another model loses nothing meanwhile. Both hold with Triton as the
control plane's child and with Triton in a process of its own (the deployed topology), and for models
whose code runs in preforked workers (a hanging load's worker is killed with its stub).
"""

from __future__ import annotations

import asyncio

import pytest

from harness.probes import until_async
from harness.reliability import Traffic, infer_error, report, summary
from harness.serve import alive_pids, write_package

pytestmark = pytest.mark.integration

LOAD_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def serve(serve_factory, package, tmp_path_factory, topology, worker):
    # A budget that fits the three small models this module loads at once, and not much more.
    serve = serve_factory("loadfaults", topology=topology, memory_budget_mb="600")
    serve.start()
    hanging = write_package(tmp_path_factory.mktemp("hang") / "pkg", load_timeout_secs=LOAD_TIMEOUT)
    serve.publish("steady", package)
    serve.publish("victim", package, worker=worker)
    serve.publish("hog", package, params={"load_error": "memory"}, worker=worker)
    serve.publish("hang", hanging, params={"load_sleep": 600.0}, worker=worker)
    warm_hang = write_package(tmp_path_factory.mktemp("warmhang") / "pkg", load_timeout_secs=LOAD_TIMEOUT, warmup=True)
    serve.publish("warmhang", warm_hang, params={"predict_sleep": 600.0}, worker=worker)
    serve.hanging, serve.worker = hanging, worker
    yield serve
    serve.stop()  # when its topology and worker are done: not idling beside the next ones


async def test_out_of_memory_at_load_evicts_retries_once_then_fails_clearly(serve):
    # victim is to be the one idle model: any other this module's tests left loaded (the fixed 'hang') sleeps first
    def others_asleep() -> None:
        with serve.api() as api:
            for model in ("hang", "warmhang", "hog"):
                if serve.status(model)["state"] == "ready":
                    api.unload(model)

    await asyncio.to_thread(others_asleep)
    traffic = Traffic(serve, {"steady": 2.0, "victim": 2.0}, grpc_clients=2)
    traffic.start()
    await until_async(lambda: {r.model for r in traffic.results if r.ok} == {"steady", "victim"}, "both models served")
    await traffic.stop()
    traffic = Traffic(serve, {"steady": 2.0}, grpc_clients=2, http_clients=1).start()  # victim now idle
    try:
        await asyncio.sleep(1.0)
        grpc_error, grpc_secs = await infer_error(serve, "hog", "grpc")
        victim = await asyncio.to_thread(serve.status, "victim")
        http_error, _ = await infer_error(serve, "hog", "http")
        await asyncio.sleep(1.0)
    finally:
        results = await traffic.stop()
    hog = await asyncio.to_thread(serve.status, "hog")
    steady = summary(results)
    report(
        f"MemoryError at load ({serve.topology}, {serve.worker})",
        client_error=grpc_error[:140],
        answer_secs=round(grpc_secs, 2),
        victim=f"{victim['state']} ({victim['reason']})",
        neighbour_failed=f"{steady['failed']}/{steady['total']}",
    )
    assert grpc_error.startswith("StatusCode.UNAVAILABLE"), grpc_error
    assert "out of memory even after unloading victim" in grpc_error, grpc_error
    assert http_error.startswith("503") and "out of memory" in http_error
    assert victim["state"] == "unloaded" and victim["reason"] == "oom"
    assert hog["state"] == "failed" and "out of memory" in hog["reason"]
    assert await asyncio.to_thread(serve.metric, "snooze_evictions_total", model="victim", reason="oom") == 1
    assert steady["failed"] == 0, steady
    # The evicted model wakes again on its next request.
    traffic = Traffic(serve, {"victim": 2.0}, grpc_clients=1).start()
    await until_async(lambda: any(r.ok for r in traffic.results), "the victim to serve again")
    assert summary(await traffic.stop())["failed"] == 0


async def test_load_hanging_past_its_timeout_is_abandoned(serve, package):
    traffic = Traffic(serve, {"steady": 2.0}, grpc_clients=2, http_clients=1).start()
    try:
        await until_async(lambda: any(r.ok for r in traffic.results), "steady traffic")
        answers = []
        for _ in (1, 2):  # every request retries the load of a failed model; no stub piles up
            error, secs = await infer_error(serve, "hang", "grpc")
            status = await asyncio.to_thread(serve.status, "hang")
            stubs_left = await until_async(
                lambda: serve.stub_pids("hang") == [] and not alive_pids(serve.noted_workers("hang")),
                "the hanging stub (and its worker) to be killed",
                timeout=10,
            )
            answers.append(round(secs, 2))
            assert error.startswith("StatusCode.UNAVAILABLE"), error
            assert f"load exceeded load_timeout_secs={LOAD_TIMEOUT:g}: it hung in its load (for " in error, error
            if serve.worker == "preforked":  # the user's load() runs in the worker: named, with its pid
                assert "in its preforked worker pid" in error, error
            assert status["state"] == "failed" and f"load_timeout_secs={LOAD_TIMEOUT:g}" in status["reason"], status
            assert LOAD_TIMEOUT <= secs <= LOAD_TIMEOUT + 10, secs
        if serve.worker == "preforked":
            assert serve.noted_workers("hang"), "no worker was forked for the hanging load"
        # Fixed and republished: served.
        await asyncio.to_thread(serve.publish, "hang", serve.hanging, worker=serve.worker)
        fixed = Traffic(serve, {"hang": 2.0}, grpc_clients=1).start()
        await until_async(lambda: any(r.ok for r in fixed.results), "the fixed model to serve")
        assert summary(await fixed.stop())["failed"] == 0
    finally:
        results = await traffic.stop()
    steady = summary(results)
    report(
        f"load() hangs past load_timeout_secs ({serve.topology}, {serve.worker})",
        client_error=error[:120],
        answer_secs=answers,
        stub_killed_within_secs=round(stubs_left, 2),
        neighbour_failed=f"{steady['failed']}/{steady['total']}",
    )
    assert steady["failed"] == 0, steady


async def test_a_warm_up_hanging_past_the_load_timeout_is_abandoned_and_named(serve):
    error, secs = await infer_error(serve, "warmhang", "grpc")
    status = await asyncio.to_thread(serve.status, "warmhang")
    gone = await until_async(
        lambda: serve.stub_pids("warmhang") == [] and not alive_pids(serve.noted_workers("warmhang")),
        "the stub hung in its warm-up (and its worker) to be killed",
        timeout=10,
    )
    report(
        f"warm-up hangs past load_timeout_secs ({serve.topology}, {serve.worker})",
        client_error=error[:160],
        answer_secs=round(secs, 2),
        processes_gone_within_secs=round(gone, 2),
    )
    assert error.startswith("StatusCode.UNAVAILABLE"), error
    assert f"load exceeded load_timeout_secs={LOAD_TIMEOUT:g}: it hung in its warm-up (for " in error, error
    assert status["state"] == "failed" and "warm-up" in status["reason"], status
    assert LOAD_TIMEOUT <= secs <= LOAD_TIMEOUT + 10, secs
