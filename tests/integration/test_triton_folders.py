"""A Triton repository as Triton users have it, served by `snoozectl serve --models DIR`: every model asleep, called
through the gateway with tritonclient (HTTP and gRPC where Triton offers both), then again after an idle unload.

The repository (tests/harness/triton_folders.py): a hand-written python model with a BYTES input and a sibling
module, auto-complete models without (or with a partial) config.pbtxt, a decoupled model answering from its own
thread, a custom-metrics model, an ONNX model with its own config (batch size, instance count, dynamic batching), a
two-version model (version_policy all), an ensemble of two of them (one step naming a version), and a folder
that is no package, which every command refuses with the reason.
A models.toml gives every model a 2 s idle timeout (deployment settings apply to Triton folders as to packages).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from controlplane.triton.launcher import free_port
from harness.probes import grpc_infer, http_infer, until
from harness.serve import SNOOZECTL, Serve
from harness.triton_folders import MLP_CONFIG, MLP_WEIGHTS, write_repository

pytestmark = pytest.mark.integration

IDLE_SECS = 2
PIPE_IDLE_SECS = 30  # the ensemble's: longer than its steps', so that it is seen holding them
MODELS = ("calc", "auto_batch", "auto_nobatch", "stream", "counter", "poison", "versioned", "mlp", "pipe")
NOT_A_PACKAGE = "not a model package: no snooze_model.py, model.onnx or model.plan, and not a Triton model folder"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("triton_repo")
    models = write_repository(root / "models", root / "poison-calls")
    idle = {m: PIPE_IDLE_SECS if m == "pipe" else IDLE_SECS for m in MODELS}
    entries = "".join(f'[[models]]\nid = "{m}"\npath = "{m}"\nidle_timeout_secs = {idle[m]}\n\n' for m in MODELS)
    (models / "models.toml").write_text(entries)
    return models


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, repo: Path) -> Iterator[Serve]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SNOOZE_")}
    metrics_port = free_port()
    env.update(SNOOZE_SWEEP_INTERVAL_SECS="0.3", SNOOZE_TRITON_METRICS_PORT=str(metrics_port))
    serve = Serve(tmp_path_factory.mktemp("triton_folders") / "work", env, models=repo)
    serve.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"  # type: ignore[attr-defined]
    try:
        serve.start(timeout=120, ready=True)
        yield serve
    finally:
        serve.stop()


def asleep(stack: Serve, model: str) -> None:
    until(lambda: stack.status(model)["state"] == "unloaded", f"{model} to be asleep", timeout=60)


def two_rounds(stack: Serve, model: str) -> Iterator[int]:
    """Round 1 on the model as published (asleep), round 2 after its idle unload."""
    for round_ in (1, 2):
        asleep(stack, model)
        loads = stack.status(model)["load_count"]
        yield round_
        assert stack.status(model)["load_count"] == loads + 1  # the round woke it


# ------------------------------------------------------------------------------------------------


def test_serve_publishes_every_model_asleep_and_refuses_the_folder_that_is_no_package(stack: Serve) -> None:
    models = stack.models()
    assert set(models) == set(MODELS)
    # Published asleep (or asleep again, after another test, within the idle timeout).
    until(lambda: {m["status"]["state"] for m in stack.models().values()} == {"unloaded"}, "every model asleep")
    assert models["calc"]["kind"] == "triton-python" and models["mlp"]["kind"] == "triton-onnx"
    log = " ".join(stack.log.read_text(errors="replace").split())  # the console wraps long lines
    assert f"refused notes: {stack.models_dir}/notes: {NOT_A_PACKAGE}" in log, log[-3000:]
    status = stack.snoozectl("status")
    assert status.returncode == 0, status.stderr
    # What publishing decided is said per model: the fields it owns, and what does not hold for the kind.
    assert "mlp (triton-onnx):" in status.stdout and "backend: python (config.pbtxt says platform" in status.stdout
    assert "calc (triton-python):" in status.stdout and "request_timeout_secs does not apply" in status.stdout


def test_a_hand_written_python_model_answers_http_and_grpc_with_bytes(stack: Serve) -> None:
    a = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.float32)
    b = np.ones((2, 4), np.float32)
    label = np.array([[b"first"], [b"second"]], dtype=np.object_)
    for _ in two_rounds(stack, "calc"):
        for module in (httpclient, grpcclient):
            url = stack.http_url if module is httpclient else stack.grpc_url
            client = module.InferenceServerClient(url)
            try:
                inputs = [module.InferInput(n, list(v.shape), t) for n, v, t in (
                    ("A", a, "FP32"), ("B", b, "FP32"), ("LABEL", label, "BYTES"),
                )]  # fmt: skip
                for tensor, value in zip(inputs, (a, b, label), strict=True):
                    tensor.set_data_from_numpy(value)
                result = client.infer("calc", inputs)
            finally:
                client.close()
            np.testing.assert_allclose(result.as_numpy("SUM"), a + b)
            np.testing.assert_allclose(result.as_numpy("DIFF"), a - b)
            assert result.as_numpy("TAGGED").tolist() == [[b"calc:first"], [b"calc:second"]]


def test_auto_complete_models_answer_with_the_config_completed_at_publish(stack: Serve) -> None:
    x = np.array([[1, 2, 3]], np.float32)
    for model, batch, factor in (("auto_batch", 4, 2.0), ("auto_nobatch", 0, 3.0)):
        for _ in two_rounds(stack, model):
            with httpclient.InferenceServerClient(stack.http_url) as client:
                config = client.get_model_config(model)  # asleep: snoozeml answers with the published config
                assert config["max_batch_size"] == batch
                assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [("X", "TYPE_FP32", [3])]
                shaped = x if batch else x[0]
                tensor = httpclient.InferInput("X", list(shaped.shape), "FP32")
                tensor.set_data_from_numpy(shaped)
                np.testing.assert_allclose(client.infer(model, [tensor]).as_numpy("Y"), shaped * factor)


def _stream(url: str, model: str, n: int) -> list[tuple[int, int]]:
    """(IDX, OUT) of every response of one streamed request, up to its final response."""
    answers: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        tensor = grpcclient.InferInput("N", [1], "INT32")
        tensor.set_data_from_numpy(np.array([n], np.int32))
        client.async_stream_infer(model, [tensor], enable_empty_final_response=True)
        got = []
        while True:
            answer = answers.get(timeout=60)
            assert not isinstance(answer, InferenceServerException), answer
            response = answer.get_response()
            if response.outputs:
                got.append((int(answer.as_numpy("IDX")[0]), int(answer.as_numpy("OUT")[0])))
            if response.parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()
        client.close()


def test_a_decoupled_model_streams_from_its_own_thread_over_grpc(stack: Serve) -> None:
    for _ in two_rounds(stack, "stream"):
        assert _stream(stack.grpc_url, "stream", 5) == [(i, 10 * i) for i in range(5)]


def _rows_metric(stack: Serve) -> float | None:
    text = httpx.get(stack.metrics_url, timeout=10).text  # type: ignore[attr-defined]
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("snooze_test_rows") and sample.labels.get("model") == "counter":
                return sample.value
    return None


def _counted(stack: Serve, rows: float) -> None:
    until(lambda: _rows_metric(stack) == rows, f"the model's own counter at {rows:g} rows", timeout=30)


def test_a_models_custom_metric_reaches_tritons_metrics(stack: Serve) -> None:
    x = np.ones((3, 2), np.float32)
    for _ in two_rounds(stack, "counter"):
        # The family stays registered in Triton while the model sleeps: its counter goes on from where it was.
        before = _rows_metric(stack) or 0.0
        np.testing.assert_allclose(http_infer(stack.http_url, "counter", x), x * 2)
        _counted(stack, before + 3)


def test_an_onnx_folder_keeps_its_batch_size_instances_and_dynamic_batching(stack: Serve) -> None:
    detail = stack.api().get("mlp")
    published = detail["config"]
    for kept in ("max_batch_size: 16", "count: 2", "preferred_batch_size: 4", "preferred_batch_size: 8"):
        assert kept in published, published
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for _ in two_rounds(stack, "mlp"):
        with httpclient.InferenceServerClient(stack.http_url) as client:
            tensor = httpclient.InferInput("input", [3, 4], "FP32")
            tensor.set_data_from_numpy(x)
            np.testing.assert_allclose(client.infer("mlp", [tensor]).as_numpy("output"), x @ MLP_WEIGHTS)
            loaded = client.get_model_config("mlp")  # loaded: Triton's own answer
        assert loaded["max_batch_size"] == 16 and [g["count"] for g in loaded["instance_group"]] == [2]
        assert loaded["dynamic_batching"]["preferred_batch_size"] == [4, 8]
        assert len(stack.stub_pids("mlp")) == 2  # two instances, two model processes
    assert "onnxruntime_onnx" in MLP_CONFIG  # the folder was written for Triton's onnxruntime backend


def test_two_versions_are_served_as_their_version_policy_says(stack: Serve) -> None:
    # Round 2 asks for a version by number of a model that slept after a load: Triton's answer then is "version 1 is
    # not at ready state" (HTTP 503), not the 404 of a model it never loaded, and it must wake the model all the same.
    x = np.ones((1, 2), np.float32)
    for _ in two_rounds(stack, "versioned"):
        with httpclient.InferenceServerClient(stack.http_url) as client:
            assert client.get_model_metadata("versioned")["versions"] == ["1", "2"]
            for version, added in (("1", 1000), ("2", 2000), ("", 2000)):
                tensor = httpclient.InferInput("x", [1, 2], "FP32")
                tensor.set_data_from_numpy(x)
                np.testing.assert_allclose(
                    client.infer("versioned", [tensor], model_version=version).as_numpy("y"), x + added
                )
            with pytest.raises(InferenceServerException, match="unknown model"):
                client.infer("versioned", [tensor], model_version="3")
        with grpcclient.InferenceServerClient(stack.grpc_url) as client:
            tensor = grpcclient.InferInput("x", [1, 2], "FP32")
            tensor.set_data_from_numpy(x)
            got = client.infer("versioned", [tensor], model_version="1").as_numpy("y")
        np.testing.assert_allclose(got, x + 1000)
        np.testing.assert_allclose(grpc_infer(stack.grpc_url, "versioned", x), x + 2000)


@pytest.mark.parametrize(
    ("row", "http_status", "grpc_status", "said"),
    [
        (-2.0, 503, "StatusCode.UNAVAILABLE", "the feature store is busy"),
        (-3.0, 404, "StatusCode.NOT_FOUND", "no features for this user"),
    ],
)
def test_a_models_own_not_found_or_unavailable_runs_once(
    stack: Serve, repo: Path, row: float, http_status: int, grpc_status: str, said: str
) -> None:
    """Triton answers a model it does not serve with 404 or 503 and the gateway re-sends those to the activator,
    which wakes the model. A model's own error with the same status has run: it reaches the client, once."""
    calls = repo.parent / "poison-calls"
    x = np.array([[row, 1.0]], np.float32)
    for protocol, status in (("http", http_status), ("grpc", grpc_status)):
        stack.api().load("poison")  # awake: the request is not the one that wakes it
        before = calls.read_text().split() if calls.exists() else []
        with pytest.raises(InferenceServerException) as info:
            (http_infer if protocol == "http" else grpc_infer)(
                stack.http_url if protocol == "http" else stack.grpc_url, "poison", x
            )
        assert str(info.value.status()) == str(status) and info.value.message() == said, (protocol, info.value)
        assert calls.read_text().split()[len(before) :] == [f"{row:g}"], protocol  # run once, not re-sent


def test_status_watch_says_a_wake_as_it_happens(stack: Serve) -> None:
    """`snoozectl status --watch --json`: one line per refresh; a request that wakes a model shows as a change."""
    asleep(stack, "counter")
    env = {**os.environ, "SNOOZE_API_URL": stack.api_url, **({"SNOOZE_API_KEY": k} if (k := stack.admin_key) else {})}
    cmd = [SNOOZECTL, "status", "--watch", "--json", "--interval", "0.3"]
    watch = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in watch.stdout or []], daemon=True)
    reader.start()
    try:
        first = json.loads(lines.get(timeout=60))
        assert {m["id"] for m in first["models"]} == set(MODELS) and first["changes"] == []
        x = np.ones((1, 2), np.float32)
        np.testing.assert_allclose(http_infer(stack.http_url, "counter", x), x * 2)
        deadline = time.monotonic() + 30
        said: list[str] = []
        while not any(c.startswith("counter: ") and " -> ready (" in c for c in said):
            said += json.loads(lines.get(timeout=max(deadline - time.monotonic(), 0.1)))["changes"]
        # ready, straight from unloaded or through loading (a refresh may fall within the load)
        became = [c for c in said if c.startswith("counter: ") and " -> " in c]
        assert became[0].startswith("counter: unloaded -> ") and " -> ready (" in became[-1], said
        assert any(c.startswith("counter: loaded once") for c in said), said
    finally:
        # SIGTERM ends it as Ctrl-C does (SIGINT: a pytest-xdist worker's children inherit it ignored)
        watch.send_signal(signal.SIGTERM)
        code = watch.wait(timeout=30)
    assert code == 0, watch.stderr.read() if watch.stderr else ""


def _as_woken(status: dict[str, Any]) -> tuple[Any, ...]:
    """What changes when a model is loaded again, or a process of its dies."""
    return status["load_count"], status["last_crash"], status["processes"]


def test_an_ensemble_wakes_its_steps_and_holds_them_while_it_is_loaded(stack: Serve) -> None:
    x = np.array([[1.0, 2.0]], np.float32)
    assert stack.models()["pipe"]["kind"] == "triton-ensemble"
    for _ in two_rounds(stack, "pipe"):
        for step in ("versioned", "counter"):
            asleep(stack, step)
        files = sorted(stack.repository.rglob("*"))
        # the step "versioned" runs its version 1 (x + 1000, where the latest adds 2000), then counter doubles
        np.testing.assert_allclose(http_infer(stack.http_url, "pipe", x), (x + 1000) * 2)
        np.testing.assert_allclose(grpc_infer(stack.grpc_url, "pipe", x), (x + 1000) * 2)
        assert stack.status("pipe")["steps"] == ["versioned", "counter"]
        assert stack.stub_pids("pipe") == []  # an ensemble holds no process of its own
        woken = {step: _as_woken(stack.status(step)) for step in ("versioned", "counter")}
        # Twice the steps' own idle timeout later, the ensemble (idle timeout PIPE_IDLE_SECS) still holds them.
        time.sleep(2 * IDLE_SECS + 0.5)
        for step in ("versioned", "counter"):
            status = stack.status(step)
            assert status["state"] == "ready" and status["ensembles"] == ["pipe"], status
        # ... as they woke: the ensemble's load made Triton load no step anew (it did when a step's first load had
        # written a __pycache__ into its folder, a change of the step's files to Triton; the stubs it ended were
        # taken for crashes and the step recovered). Loads write nothing into the repository.
        assert {step: _as_woken(stack.status(step)) for step in woken} == woken
        assert sorted(stack.repository.rglob("*")) == files
        assert stack.status("pipe")["state"] == "ready"
        stack.api().unload("pipe")
        # Let go with it: the steps, idle for long now, leave.
        for step in ("versioned", "counter"):
            asleep(stack, step)


def test_every_command_refuses_the_folder_that_is_no_package_with_the_reason(stack: Serve, repo: Path) -> None:
    notes = repo / "notes"
    published = httpx.post(f"{stack.api_url}/v1/models:from-path", json={"id": "notes", "path": str(notes)}, timeout=60)
    assert published.status_code == 422 and NOT_A_PACKAGE in published.json()["error"], published.text
    env = {**os.environ, "COLUMNS": "300"}
    for args in (
        ["check", str(notes)],
        ["render", str(notes), "--out", str(repo.parent / "out")],
        ["validate", str(notes)],
    ):
        done = subprocess.run([SNOOZECTL, *args], capture_output=True, text=True, env=env, timeout=120)
        said = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == 1, (args, said)
        assert "not a model package" in said, (args, said)
    assert not (repo.parent / "out").exists()  # nothing written


def test_status_and_describe_say_what_publishing_decided(stack: Serve) -> None:
    detail = stack.api().get("auto_batch")
    assert any("auto_complete_config" in note for note in detail["notes"]), detail["notes"]
    assert json.loads(json.dumps(detail["versions"])) == ["1"]
    assert stack.api().get("versioned")["versions"] == ["1", "2"]
