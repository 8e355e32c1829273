"""Streams through the gateway: generate and generate_stream, gRPC streams holding what they name, decoupled
models over gRPC and SSE, cancellation and crashes mid-stream.

The stack (real Envoy + real tritonserver + the activator, see tests/harness/gateway.py) is shared by the
module's tests (tests/integration/gateway/conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from controlplane.spec import DeploymentSpec, resolve
from harness.gateway import (
    GRPC_KEY,
    KEY,
    WORKERS,
    Stack,
    _generate,
    _publish_repeater,
    _stream_error,
    _x,
)
from harness.probes import grpc_infer, http_infer, until

pytestmark = pytest.mark.integration


def test_generate_and_generate_stream_wake_a_sleeping_model(stack: Stack):
    name = stack.publish("gw_generate")
    r = _generate(stack, name, "generate", {"x": [1.0, 2.0]})
    assert r.status_code == 200, r.text
    assert r.json()["y"] == [3.0, 6.0] and stack.load_count(name) == 1
    stack.loop.run(stack.lifecycle.unload(name))
    r = _generate(stack, name, "generate_stream", {"x": [2.0, 4.0]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = [json.loads(line.removeprefix("data: ")) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["y"] for e in events] == [[6.0, 12.0]] and stack.load_count(name) == 2
    until(lambda: stack.activator.holds.held(name) == 0, "the stream's hold released at its end")
    r = _generate(stack, "gw_nope", "generate_stream", {"x": [2.0]})  # Triton's own answer, unchanged
    assert r.status_code == 404 and r.json()["error"] == "Request for unknown model: 'gw_nope' is not found"


def test_a_stream_wakes_a_sleeping_model_and_holds_it_while_open(stack: Stack):
    name = stack.publish("gw_stream")
    results: list[Any] = []
    with stack.grpc() as g:
        g.start_stream(callback=lambda result, error: results.append(error or result), headers=GRPC_KEY)
        for rows in (1, 2, 3):
            inp = grpcclient.InferInput("x", [rows, 4], "FP32")
            inp.set_data_from_numpy(_x(rows))
            g.async_stream_infer(name, [inp], request_id=str(rows))
        until(lambda: len(results) == 3, "three answers on the stream")
        assert all(not isinstance(r, InferenceServerException) for r in results), results
        for r in results:
            rows = int(r.get_response().id)
            np.testing.assert_allclose(r.as_numpy("y"), _x(rows) * 3)
        assert stack.load_count(name) == 1 and stack.activator.holds.held(name) == 1
        # While the stream is open the model is in use: an unload by the sweeper would not pick it.
        assert stack.lifecycle.states.record(name).in_use >= 1
        g.stop_stream()
    until(lambda: stack.activator.holds.held(name) == 0, "the hold's release at the stream's end")
    assert stack.lifecycle.states.record(name).in_use == 0


def test_a_stream_holds_every_model_it_names(stack: Stack):
    """One ModelStreamInfer stream, messages for a READY model then a sleeping one: the second is woken before
    its first message goes on, and each is held while the stream is open."""
    first, second = stack.publish("gw_stream_first"), stack.publish("gw_stream_second")
    stack.loop.run(stack.lifecycle.ensure_ready(first))
    until(lambda: stack.activator.ready_flags.ready(first), "the first model's ready flag")
    results: list[Any] = []
    with stack.grpc() as g:
        g.start_stream(callback=lambda result, error: results.append(error or result), headers=GRPC_KEY)
        for rows, name in enumerate((first, second, first, second), start=1):
            inp = grpcclient.InferInput("x", [rows, 4], "FP32")
            inp.set_data_from_numpy(_x(rows))
            g.async_stream_infer(name, [inp], request_id=f"{name}-{rows}")
        until(lambda: len(results) == 4, "four answers on the stream")
        assert all(not isinstance(r, InferenceServerException) for r in results), results
        for r in results:
            rows = int(r.get_response().id.rpartition("-")[2])
            np.testing.assert_allclose(r.as_numpy("y"), _x(rows) * 3)
        assert stack.load_count(first) == 1 and stack.load_count(second) == 1
        until(lambda: stack.activator.holds.held(first) == 1 and stack.activator.holds.held(second) == 1,
              "a hold of each model the stream names")  # fmt: skip
        g.stop_stream()
    until(lambda: stack.activator.holds.held(first) + stack.activator.holds.held(second) == 0,
          "both holds released at the stream's end")  # fmt: skip


def test_a_stream_wakes_a_sleeping_model_it_names_after_an_earlier_wake(stack: Stack):
    """A stream's first message woke its model; a later message names another sleeping model (each sent after
    the answer to the one before): that model is woken before its message moves on too (the next wake filter of
    the chain takes over where the one that waited ended), where it used to get Triton's "unknown model"."""
    names = [stack.publish(f"gw_stream_later{i}") for i in (1, 2, 3)]
    results: list[Any] = []
    with stack.grpc() as g:
        g.start_stream(callback=lambda result, error: results.append(error or result), headers=GRPC_KEY)
        for rows, name in enumerate([*names, names[0]], start=1):
            inp = grpcclient.InferInput("x", [rows, 4], "FP32")
            inp.set_data_from_numpy(_x(rows))
            g.async_stream_infer(name, [inp], request_id=f"{name}-{rows}")
            until(lambda rows=rows: len(results) == rows, f"answer {rows} on the stream")
        assert all(not isinstance(r, InferenceServerException) for r in results), results
        for r in results:
            rows = int(r.get_response().id.rpartition("-")[2])
            np.testing.assert_allclose(r.as_numpy("y"), _x(rows) * 3)
        assert [stack.load_count(name) for name in names] == [1, 1, 1]
        until(lambda: [stack.activator.holds.held(name) for name in names] == [1, 1, 1],
              "a hold of each model the stream names")  # fmt: skip
        g.stop_stream()
    until(lambda: sum(stack.activator.holds.held(name) for name in names) == 0, "every hold released at the end")


@contextlib.contextmanager
def _control_plane_blocked(stack: Stack) -> Iterator[None]:
    """The activator's event loop (the control plane's) stuck in a blocking call while the block runs."""
    blocked, release = threading.Event(), threading.Event()
    stack.loop.loop.call_soon_threadsafe(lambda: (blocked.set(), release.wait(60)))
    assert blocked.wait(10), "the control plane's loop never ran the blocking call"
    try:
        yield
    finally:
        release.set()


@pytest.mark.parametrize("protocol", ["grpc", "sse"])
def test_a_warm_stream_does_not_wait_for_the_activator(stack: Stack, protocol: str):
    """A READY model's stream goes on to Triton at once (its ready flag), even with the control plane stuck:
    its hold reaches the activator after, and keeps the model in use while the stream is open."""
    name = stack.publish(f"gw_warm_{protocol}")
    stack.loop.run(stack.lifecycle.ensure_ready(name))
    until(lambda: stack.activator.ready_flags.ready(name), "the model's ready flag")
    warm_holds = stack.activator.holds.warm_holds
    answers: list[Any] = []
    got = threading.Event()
    with stack.grpc() as g:
        with _control_plane_blocked(stack):
            if protocol == "grpc":
                g.start_stream(callback=lambda result, error: (answers.append(error or result), got.set()),
                               headers=GRPC_KEY)  # fmt: skip
                inp = grpcclient.InferInput("x", [1, 4], "FP32")
                inp.set_data_from_numpy(_x(1))
                g.async_stream_infer(name, [inp])
            else:
                answers.append(_generate(stack, name, "generate_stream", {"x": [2.0, 4.0]}))
                got.set()
            answered = got.wait(30)
        assert answered, "the warm stream waited for the stuck control plane"
        if protocol == "grpc":
            np.testing.assert_allclose(answers[0].as_numpy("y"), _x(1) * 3)
            until(lambda: stack.activator.holds.held(name) == 1, "the stream's hold, sent without waiting")
            assert stack.lifecycle.states.record(name).in_use >= 1
            g.stop_stream()
        else:
            assert answers[0].status_code == 200 and '"y":[6.0,12.0]' in answers[0].text.replace(" ", ""), answers
    until(lambda: stack.activator.holds.warm_holds == warm_holds + 1, "the warm hold at the activator")
    until(lambda: stack.activator.holds.held(name) == 0, "the hold's release at the stream's end")
    assert stack.load_count(name) == 1
    stack.loop.run(stack.lifecycle.unload(name))
    assert not stack.activator.ready_flags.ready(name)  # asleep: the next stream waits for its wake-up


def _stream(g: grpcclient.InferenceServerClient, name: str, x: list[float]) -> list[Any]:
    """One request on a gRPC stream; every answer (result or error) until the stream's final answer."""
    answers: list[Any] = []
    done = threading.Event()

    def callback(result: Any, error: Any) -> None:
        if error is not None:
            answers.append(error)
            done.set()
        elif result.get_response().parameters["triton_final_response"].bool_param:
            done.set()
        else:
            answers.append(result)

    g.start_stream(callback=callback, headers=GRPC_KEY)
    inp = grpcclient.InferInput("x", [len(x)], "FP32")
    inp.set_data_from_numpy(np.array(x, dtype=np.float32))
    g.async_stream_infer(name, [inp], enable_empty_final_response=True)
    assert done.wait(60), f"no final answer on the stream; got {answers}"
    g.stop_stream()
    return answers


@pytest.mark.parametrize("worker", WORKERS)
def test_decoupled_model_streams_each_yield_over_grpc_and_sse(stack: Stack, repeater: Path, worker: str):
    name = _publish_repeater(stack, repeater, f"gw_repeat_{worker}", worker=worker)
    assert "decoupled: true" in stack.store.get(name).config_text
    with stack.grpc() as g:
        answers = _stream(g, name, [4.0, 0.0])  # asleep: the stream wakes it
    assert [a.as_numpy("y").tolist() for a in answers] == [[4.0 * i, 0.0] for i in (1, 2, 3, 4)]
    assert stack.load_count(name) == 1
    notes = [json.loads(p.read_text()) for p in stack.triton.journal_dir.glob("*.worker")]
    assert any(n.get("model") == name for n in notes) == (worker == "preforked")  # a worker ran it, not the stub
    stack.loop.run(stack.lifecycle.unload(name))
    r = _generate(stack, name, "generate_stream", {"x": [3.0, 0.0]})
    events = [json.loads(line.removeprefix("data: ")) for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and [e["y"] for e in events] == [[3.0, 0.0], [6.0, 0.0], [9.0, 0.0]], r.text
    assert stack.load_count(name) == 2


@pytest.mark.parametrize("worker", WORKERS)
def test_decoupled_error_mid_stream_keeps_what_was_sent(stack: Stack, repeater: Path, worker: str):
    name = _publish_repeater(stack, repeater, f"gw_repeat_fail_{worker}", worker=worker)
    with stack.grpc() as g:
        answers = _stream(g, name, [5.0, -1.0])
    assert [a.as_numpy("y").tolist() for a in answers[:2]] == [[5.0, -1.0], [10.0, -2.0]]
    assert isinstance(answers[2], InferenceServerException) and len(answers) == 3
    assert "the repeater failed after two" in answers[2].message()
    assert answers[2].message().startswith(f"[snooze:model_error] model '{name}'")


@pytest.mark.parametrize("worker", WORKERS)
def test_a_cancelled_stream_stops_the_generator(stack: Stack, repeater: Path, tmp_path: Path, worker: str):
    log = tmp_path / "repeater.log"
    name = _publish_repeater(stack, repeater, f"gw_repeat_cancel_{worker}", log, worker=worker)
    got = threading.Event()
    with stack.grpc() as g:
        g.start_stream(callback=lambda result, error: got.set(), headers=GRPC_KEY)
        inp = grpcclient.InferInput("x", [2], "FP32")
        inp.set_data_from_numpy(np.array([10_000.0, 0.05], dtype=np.float32))
        g.async_stream_infer(name, [inp])
        assert got.wait(60)
        g.stop_stream(cancel_requests=True)
    lines = until(lambda: (t := log.read_text().splitlines()) and t[-1] == "closed" and t, "the generator's close")
    assert len(lines) - 1 < 10_000  # it stopped: far from all the responses it was asked for
    until(lambda: stack.activator.holds.held(name) == 0, "the cancelled stream's hold released")


def _journaled_ids(stack: Stack, model: str | None = None) -> set[str]:
    """Every request id the model processes' journals hold now (controlplane/triton/journal.py layout): the last
    batch each process received; with ``model``, only its processes'."""
    pids = None if model is None else {str(pid) for pid in stack.triton.stub_pids(model)}
    ids: set[str] = set()
    for path in stack.triton.journal_dir.glob("*.journal"):
        if pids is not None and path.name.split("-", 1)[0] not in pids:
            continue
        try:
            raw = path.read_bytes()
        except FileNotFoundError:  # its process ended meanwhile (a clean end removes its journal): nothing journaled
            continue
        size = int.from_bytes(raw[:4], "little")
        ids.update(i for i in raw[4 : 4 + size].decode().split("\n") if i)
    return ids


def test_an_open_stream_keeps_its_model_awake_and_is_journaled(stack: Stack, repeater: Path):
    """Open work is in use: across its idle timeout a stream's model is not unloaded; once the stream
    ends the model sleeps on its normal timeout. A streamed request is in the journal like any other."""
    name = "gw_stream_idle"
    stack.store.publish(resolve(DeploymentSpec(id=name, path=stack.package, max_batch_size=8, idle_timeout_secs=1)))
    results: list[Any] = []
    with stack.grpc() as g:
        g.start_stream(callback=lambda result, error: results.append(error or result), headers=GRPC_KEY)
        inp = grpcclient.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(_x(1))
        g.async_stream_infer(name, [inp])
        until(lambda: results, "the stream's answer")
        time.sleep(1.5)  # past idle_timeout_secs with the stream open
        stack.loop.run(stack.lifecycle.sweep())
        assert stack.triton_ready(name) and stack.lifecycle.status(name).state == "ready"
        g.stop_stream()
    until(lambda: stack.activator.holds.held(name) == 0, "the hold's release")
    until(lambda: stack.loop.run(stack.lifecycle.sweep()) or not stack.triton_ready(name), "the idle unload", 30)

    repeat = _publish_repeater(stack, repeater, "gw_repeat_journal")
    before = _journaled_ids(stack)
    with stack.grpc() as g:
        assert len(_stream(g, repeat, [2.0, 0.0])) == 2
    assert _journaled_ids(stack) - before  # the stream's request carried the gateway's id into the journal


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_unary_request_is_journaled_by_envoys_request_id(stack: Stack, protocol: str):
    """The journal's id is Envoy's x-request-id, forwarded by Triton: a UUID for a request that has none, the
    client's own where it sends one (the gateway adds no header of its own)."""
    name = f"gw_journal_id_{protocol}"
    stack.store.publish(resolve(DeploymentSpec(id=name, path=stack.package, max_batch_size=8)))
    infer = grpc_infer if protocol == "grpc" else http_infer
    key = GRPC_KEY if protocol == "grpc" else KEY
    with stack.grpc() if protocol == "grpc" else stack.http() as client:
        assert infer(client, name, _x(1), headers=key).shape == (1, 4)  # woken by the retry, then warm
        infer(client, name, _x(1), headers=key)
        [generated] = _journaled_ids(stack, name)
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", generated), generated
        infer(client, name, _x(1), headers={**key, "x-request-id": f"client-{protocol}-7"})
        assert _journaled_ids(stack, name) == {f"client-{protocol}-7"}


TEXT_GENERATOR = Path(__file__).resolve().parents[3] / "examples" / "models" / "text-generator"


def test_the_text_generator_example_streams_tokens_asleep_at_the_start(stack: Stack):
    """The README's two snippets: tritonclient's stream and curl's generate_stream, each waking it."""
    name = "gw_text_generator"
    stack.store.publish(resolve(DeploymentSpec(id=name, path=TEXT_GENERATOR)))
    tokens: list[str] = []
    done = threading.Event()

    def on_token(result: Any, error: Any) -> None:
        assert error is None, error
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.set()
        else:
            tokens.append(result.as_numpy("token").reshape(-1)[0].decode())

    with stack.grpc() as g:
        prompt = grpcclient.InferInput("prompt", [1, 1], "BYTES")
        prompt.set_data_from_numpy(np.array([[b"the model"]], dtype=object))
        max_tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
        max_tokens.set_data_from_numpy(np.array([[12]], dtype=np.int32))
        g.start_stream(callback=on_token, headers=GRPC_KEY)
        g.async_stream_infer(name, [prompt, max_tokens], enable_empty_final_response=True)
        assert done.wait(60)
        g.stop_stream()
    assert len(tokens) == 12 and all(t.startswith(" ") and t.strip() for t in tokens)
    stack.loop.run(stack.lifecycle.unload(name))
    r = _generate(stack, name, "generate_stream", {"prompt": "the model", "max_tokens": 12})
    events = [json.loads(line.removeprefix("data: ")) for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and [e["token"] for e in events] == tokens, r.text  # same seed, same text


def test_a_crash_mid_stream_ends_it_with_an_error_and_runs_nothing_again(stack: Stack, repeater: Path, tmp_path: Path):
    log = tmp_path / "crash.log"
    name = _publish_repeater(stack, repeater, "gw_repeat_crash", log)
    answers: list[Any] = []
    with stack.grpc() as g:
        g.start_stream(callback=lambda result, error: answers.append(error or result), headers=GRPC_KEY)
        inp = grpcclient.InferInput("x", [2], "FP32")
        inp.set_data_from_numpy(np.array([10_000.0, 0.05], dtype=np.float32))
        g.async_stream_infer(name, [inp])
        until(lambda: answers, "the first token")
        for pid in stack.triton.stub_pids(name):
            os.kill(pid, signal.SIGKILL)
        until(lambda: isinstance(answers[-1], InferenceServerException), "the stream's error after the crash")
        g.stop_stream()
    assert all(not isinstance(a, InferenceServerException) for a in answers[:-1])
    starts = log.read_text().count("yield 1\n")
    # The model recovers (the process watch) and serves again; the crashed request never ran again.
    until(lambda: stack.recoveries(name) >= 1, "the recovery")
    with stack.grpc() as g:
        assert len(_stream(g, name, [2.0, 0.0])) == 2
    assert log.read_text().count("yield 1\n") == starts + 1


def test_bad_input_to_the_stream_and_generate_entry_points_gets_tritons_error(stack: Stack):
    """A stream whose first message names no model, a generate body that is not a JSON object: Triton's
    own error, nothing woken, and the gateway keeps serving."""
    name = stack.publish("gw_bad_input")
    with stack.grpc() as g:
        assert _stream_error(g, "").startswith("Request for unknown model")
    r = httpx.post(f"{stack.gateway.http_url}/v2/models/{name}/generate", content=b"[1, 2]", headers=KEY)
    direct = httpx.post(f"{stack.triton.http_url}/v2/models/{name}/generate", content=b"[1, 2]")
    assert (r.status_code, r.json()) == (direct.status_code, direct.json())  # Triton's answer, unchanged
    r = httpx.post(f"{stack.gateway.http_url}/v2/models/{name}/generate_stream", content=b"not json", headers=KEY)
    direct = httpx.post(f"{stack.triton.http_url}/v2/models/{name}/generate_stream", content=b"not json")
    assert (r.status_code, r.json()) == (direct.status_code, direct.json())
    with stack.grpc() as g:
        np.testing.assert_allclose(grpc_infer(g, name, _x(), headers=GRPC_KEY), _x() * 3)


def test_a_client_leaving_a_generate_stream_releases_its_hold(stack: Stack, repeater: Path):
    name = _publish_repeater(stack, repeater, "gw_repeat_sse_leave")
    url = f"{stack.gateway.http_url}/v2/models/{name}/generate_stream"
    # 60 tokens (3 s): over HTTP the stream's generator may run on after the client left.
    with httpx.Client(timeout=60) as client, client.stream("POST", url, json={"x": [60.0, 0.05]}, headers=KEY) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
        assert stack.activator.holds.held(name) == 1  # the open stream holds its model
    until(lambda: stack.activator.holds.held(name) == 0, "the hold's release once the client left")
    assert stack.lifecycle.states.record(name).in_use == 0
