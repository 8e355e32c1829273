"""Triton python models run as written keep the lifecycle's promises, with Triton as serve's child and in a process of
its own (the deployed topology): published through the API asleep, woken by a request (HTTP, gRPC, a gRPC stream),
unloaded when idle and woken again (an ensemble with its steps too); a request whose model process dies in the middle
of it runs once (the wrapper journals each batch before the model's execute runs it) and its client is told, and the
model is recovered; a load whose initialize hangs is cancelled by an unload within seconds, its process ended (the
wrapper notes the phase before the model's own initialize runs). The models are Triton folders written here
(tests/harness/triton_folders.py).
"""

from __future__ import annotations

import asyncio
import queue
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from harness.probes import grpc_infer, until, until_async
from harness.reliability import infer_once, report
from harness.serve import alive_pids
from harness.triton_folders import write_calc, write_counter, write_pipe, write_poison, write_stream, write_versioned

pytestmark = pytest.mark.integration

IDLE_SECS = 2.0
PROTOCOLS = ("grpc", "http")

HANGING_MODEL = """
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(600)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", r.inputs()[0].as_numpy())]) for r in requests]
"""


@pytest.fixture(scope="module")
def serve(serve_factory, tmp_path_factory, topology):
    root = tmp_path_factory.mktemp("triton_lifecycle")
    serve = serve_factory("tritonfolders", topology=topology)
    serve.start()
    serve.calls = root / "calls"
    published = {
        "calc": serve.publish("calc", write_calc(root / "calc"), idle_timeout_secs=IDLE_SECS),
        "stream": serve.publish("stream", write_stream(root / "stream"), idle_timeout_secs=IDLE_SECS),
    }
    for protocol in PROTOCOLS:
        folder = write_poison(root / f"poison-{protocol}", Path(f"{serve.calls}-{protocol}"))
        serve.publish(f"poison-{protocol}", folder)
    # An ensemble ("pipe": versioned's version 1, then counter) published after its steps, through the API.
    serve.publish("versioned", write_versioned(root / "versioned"), idle_timeout_secs=IDLE_SECS)
    serve.publish("counter", write_counter(root / "counter"), idle_timeout_secs=IDLE_SECS)
    serve.publish("pipe", write_pipe(root / "pipe"), idle_timeout_secs=IDLE_SECS)
    hanging = write_poison(root / "hung", root / "unused")
    (hanging / "1" / "model.py").write_text(HANGING_MODEL)
    serve.publish("hung", hanging)
    serve.published = published
    yield serve
    serve.stop()


def test_the_publish_answer_says_what_publishing_decided(serve) -> None:
    calc = serve.published["calc"]
    assert calc["kind"] == "triton-python" and calc["status"]["state"] == "unloaded"
    assert any("request_timeout_secs does not apply" in note for note in calc["notes"]), calc["notes"]
    assert calc["deployment"]["idle_timeout_secs"] == IDLE_SECS and calc["max_batch_size"] == 8


def _calc(url: str, module) -> list:
    a = np.array([[1, 2, 3, 4]], np.float32)
    label = np.array([[b"x"]], dtype=np.object_)
    client = module.InferenceServerClient(url)
    try:
        inputs = [module.InferInput("A", [1, 4], "FP32"), module.InferInput("B", [1, 4], "FP32")]
        inputs.append(module.InferInput("LABEL", [1, 1], "BYTES"))
        for tensor, value in zip(inputs, (a, a, label), strict=True):
            tensor.set_data_from_numpy(value)
        result = client.infer("calc", inputs)
        return [result.as_numpy("SUM").tolist(), result.as_numpy("TAGGED").tolist()]
    finally:
        client.close()


def _stream(url: str, n: int) -> list[int]:
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        tensor = grpcclient.InferInput("N", [1], "INT32")
        tensor.set_data_from_numpy(np.array([n], np.int32))
        client.async_stream_infer("stream", [tensor], enable_empty_final_response=True)
        got = []
        while True:
            answer = answers.get(timeout=60)
            assert not isinstance(answer, Exception), answer
            if answer.get_response().outputs:
                got.append(int(answer.as_numpy("OUT")[0]))
            if answer.get_response().parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()
        client.close()


def test_asleep_woken_by_http_grpc_and_a_stream_then_again_after_an_idle_unload(serve) -> None:
    expected = [[[2.0, 4.0, 6.0, 8.0]], [[b"calc:x"]]]
    for round_ in (1, 2):
        for model in ("calc", "stream"):
            until(lambda m=model: serve.status(m)["state"] == "unloaded", f"{model} asleep (round {round_})", 60)
        assert _calc(serve.http_url, httpclient) == expected
        assert _calc(serve.grpc_url, grpcclient) == expected
        assert _stream(serve.grpc_url, 3) == [0, 10, 20]
        assert serve.status("calc")["state"] == "ready" and serve.stub_pids("calc")
    assert serve.status("calc")["load_count"] >= 2 and serve.status("stream")["load_count"] >= 2


def test_a_sleeping_ensemble_wakes_its_steps_then_again_after_an_idle_unload(serve) -> None:
    x = np.array([[1.0, 2.0]], np.float32)
    for round_ in (1, 2):
        for model in ("pipe", "versioned", "counter"):
            until(lambda m=model: serve.status(m)["state"] == "unloaded", f"{model} asleep (round {round_})", 60)
        np.testing.assert_allclose(grpc_infer(serve.grpc_url, "pipe", x), (x + 1000) * 2)
        for model in ("pipe", "versioned", "counter"):
            status = serve.status(model)
            assert status["state"] == "ready", (round_, status)
            # each step loaded once per round (the ensemble itself holds nothing: Triton may bring it back with its
            # steps, and the lifecycle then adopts it rather than loading it), and once more per recovery: a stub
            # that died is loaded anew (seen once in CI: counter's stub, which keeps a python-backend custom metric,
            # killed by SIGSEGV while idle; not reproduced here; Triton has open reports of stub segfaults with custom
            # metrics, triton-inference-server/server#8662 and #8663)
            recovered = serve.metric_total("snooze_recoveries_total", model=model)
            assert model == "pipe" or status["load_count"] == round_ + recovered, (round_, recovered, status)
        assert serve.status("counter")["ensembles"] == ["pipe"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_request_whose_model_process_dies_runs_once_and_its_client_is_told(serve, protocol) -> None:
    model, calls = f"poison-{protocol}", Path(f"{serve.calls}-{protocol}")
    ok = await infer_once(serve, model, protocol, np.array([[1.0, 1.0]], np.float32))
    assert not isinstance(ok, str), ok
    [old] = await asyncio.to_thread(serve.stub_pids, model)
    error = await infer_once(serve, model, protocol, np.array([[-1.0, 1.0]], np.float32))
    assert isinstance(error, str), "the request that killed its model process succeeded"
    # Run once: the model saw the row once (a retry would have run it again in the recovered process).
    await asyncio.sleep(1.0)  # a second run, had there been one, would have written by now
    rows = calls.read_text().split()
    assert rows.count("-1") == 1, rows
    assert error.startswith("500" if protocol == "http" else "StatusCode.INTERNAL"), error
    for words in ("died while running this request", "exit code 1", "not retried"):
        assert words in error, error
    after = await infer_once(serve, model, protocol, np.array([[3.0, 1.0]], np.float32))
    assert not isinstance(after, str), after
    np.testing.assert_allclose(after, [[6.0, 2.0]])
    assert await asyncio.to_thread(serve.stub_pids, model) not in ([], [old])
    status = await asyncio.to_thread(serve.status, model)
    assert status["state"] == "ready" and "exit code 1" in (status["last_crash"] or ""), status
    report(f"Triton python model, poison request ({serve.topology}, {protocol})", executions=rows.count("-1"))


@pytest.mark.timeout(180)
async def test_an_unload_cancels_a_load_whose_initialize_hangs(serve) -> None:
    waiting = asyncio.create_task(infer_once(serve, "hung", "grpc", np.ones((1, 2), np.float32), timeout=120))
    await until_async(lambda: serve.stub_pids("hung"), "the hung model's stub", timeout=60)
    await asyncio.sleep(1.0)  # in the model's initialize now
    pids = await asyncio.to_thread(serve.stub_pids, "hung")
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as client:
        answer = await client.post(f"{serve.api_url}/v1/models/hung/unload")
    assert answer.status_code == 200, answer.text
    await until_async(lambda: alive_pids(pids) == [], "the hung load's process to be gone (bounded stop)", timeout=10)
    ended = time.monotonic() - started
    error = await asyncio.wait_for(waiting, 30)
    assert isinstance(error, str) and "load was cancelled (unloaded)" in error, error
    assert (await asyncio.to_thread(serve.status, "hung"))["state"] == "unloaded"
    report(f"Triton python model, unload of a hung initialize ({serve.topology})", ended_secs=round(ended, 2))
