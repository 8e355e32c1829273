"""A Triton whose processes the control plane cannot see (a remote one): nothing pretends to be measured,
and a request still never runs twice.

Simulated with Triton in a process of its own and SNOOZE_OBSERVE_TRITON_PROCESSES=false: the control
plane then treats it as remote (on this machine it could see it).
"""

from __future__ import annotations

import asyncio
import json
import queue
import textwrap

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from harness.probes import until_async
from harness.reliability import infer_once, report

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def serve(serve_factory, package, tmp_path_factory):
    serve = serve_factory("remote", topology="two_process", observe_triton_processes="false")
    serve.start()
    serve.calls = tmp_path_factory.mktemp("remote_calls") / "calls"
    serve.publish("declared", package, memory_mb=64)
    serve.publish("undeclared", package)
    serve.publish("poison", package, params={"crash": "poison", "calls": str(serve.calls)})
    serve.publish("tokens", _streaming_package(tmp_path_factory.mktemp("remote_tokens") / "tokens"), max_batch_size=0)
    return serve


def _streaming_package(folder):
    """A decoupled package: predict yields x * i for i = 1..3, one response each."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "snooze_model.py").write_text(
        textwrap.dedent("""
        class Model:
            def load(self, model_dir, device):
                pass

            def predict(self, inputs):
                for i in (1, 2, 3):
                    yield {"y": inputs["x"] * i}
    """)
    )
    tensor = {"datatype": "FP32", "dims": [2]}
    (folder / "snooze_model.json").write_text(json.dumps({"inputs": [{"name": "x", **tensor}],
                                                          "outputs": [{"name": "y", **tensor}]}))  # fmt: skip
    return folder


async def test_memory_is_declared_or_unknown_and_serve_says_why(serve):
    x = np.ones((1, 2), np.float32)
    for model in ("declared", "undeclared"):
        assert not isinstance(await infer_once(serve, model, "grpc", x), str)
    declared = await asyncio.to_thread(serve.status, "declared")
    undeclared = await asyncio.to_thread(serve.status, "undeclared")
    assert declared["memory_source"] == "declared" and declared["memory_bytes"] == 64 * 1024 * 1024
    assert undeclared["memory_source"] is None and undeclared["memory_bytes"] is None
    assert declared["processes"] is None  # cannot be seen: not a number
    assert "not visible from here" in serve.log.read_text(errors="replace")
    listing = await asyncio.to_thread(serve.snoozectl, "status")
    assert "~64.0 MiB (declared)" in listing.stdout and "unknown" in listing.stdout, listing.stdout


@pytest.mark.parametrize("protocol", ["grpc", "http"])
async def test_a_poison_request_runs_once_even_unseen(serve, protocol):
    x_ok, x_poison = np.array([[1.0, 1.0]], np.float32), np.array([[-1.0, 1.0]], np.float32)
    assert not isinstance(await infer_once(serve, "poison", protocol, x_ok), str)
    before = serve.calls.read_text().split().count("-1") if serve.calls.exists() else 0
    error = await infer_once(serve, "poison", protocol, x_poison)
    assert isinstance(error, str), "the poison request succeeded"
    assert "died while this request was in flight (it may have run)" in error and "not retried" in error, error
    await asyncio.sleep(1.0)
    assert serve.calls.read_text().split().count("-1") == before + 1  # ran once, never again
    # The failed request made the control plane reload the model: it serves again.
    await until_async(lambda: (s := serve.status("poison"))["state"] == "ready" and s["load_count"] >= 2, "the reload")
    answer = await infer_once(serve, "poison", protocol, x_ok)
    assert not isinstance(answer, str), answer
    report(f"poison request, Triton unseen ({protocol})", client_error=error[:100])


def test_a_stream_wakes_a_sleeping_model_on_a_separate_triton(serve):
    """The wake filter holds a gRPC stream's first message while the activator wakes the model in Triton's own
    process, then the stream goes straight to it: every response arrives, in order, and the model loaded once."""
    assert serve.status("tokens")["state"] == "unloaded"
    answers: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(serve.grpc_url) as client:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        inp = grpcclient.InferInput("x", [2], "FP32")
        inp.set_data_from_numpy(np.array([1.0, 2.0], np.float32))
        client.async_stream_infer("tokens", [inp], enable_empty_final_response=True)
        got = []
        while True:
            answer = answers.get(timeout=60)
            assert not isinstance(answer, Exception), answer
            if answer.get_response().parameters["triton_final_response"].bool_param:
                break
            got.append(answer.as_numpy("y").tolist())
        client.stop_stream()
    assert got == [[1.0, 2.0], [2.0, 4.0], [3.0, 6.0]]
    status = serve.status("tokens")
    assert status["state"] == "ready" and status["load_count"] == 1, status
