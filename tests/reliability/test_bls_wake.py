"""BLS pipelines under `snoozectl serve`, in both topologies: a sleeping callee is woken inside its caller's request,
a callee that BLS keeps calling is in use (never idle-unloaded under that traffic), and after its idle unload the
next call wakes it again.

Callers must be published models, or serve unloads them (a model Triton holds that is not published leaves). Most
callers here are snoozeml packages whose code runs in their python-backend stub, call ``bls_wake.install`` from
``load`` (inside the stub's ``initialize``) and make their BLS call from ``predict`` (tests/harness/bls.py);
``test_a_published_triton_folder_caller_wakes_its_callee`` publishes a hand-written Triton folder instead, with no
install of its own: the folder's wrapper installs the wake.
The callees are ordinary snoozeml packages, published through the control API and asleep.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from harness.bls import write_caller, write_standin_caller
from harness.probes import until
from harness.serve import Serve

pytestmark = pytest.mark.integration

IDLE_SECS = 3.0
X = np.array([1.0, 2.0], dtype=np.float32)


def streaming_package(folder: Path) -> Path:
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
    manifest = {"inputs": [{"name": "x", **tensor}], "outputs": [{"name": "y", **tensor}]}
    (folder / "snooze_model.json").write_text(json.dumps(manifest))
    return folder


@pytest.fixture(scope="module")
def serve(serve_factory: Any, package: Path, topology: str, tmp_path_factory: pytest.TempPathFactory) -> Serve:
    serve = serve_factory("bls", topology=topology)
    serve.start()
    serve.publish("bls-scale", package, idle_timeout_secs=IDLE_SECS)  # y = x * 2
    tokens = streaming_package(tmp_path_factory.mktemp("bls_tokens") / "tokens")
    serve.publish("bls-tokens", tokens, max_batch_size=0, idle_timeout_secs=IDLE_SECS)
    for name, stream in (("bls-caller", False), ("bls-streamer", True)):
        folder = write_standin_caller(tmp_path_factory.mktemp(name) / name, stream=stream)
        serve.publish(name, folder, max_batch_size=0, params={"caller_id": name, "stream": stream})
    return serve


def inputs(client_mod: Any, target: str) -> list[Any]:
    x = client_mod.InferInput("x", [2], "FP32")
    x.set_data_from_numpy(X)
    name = client_mod.InferInput("target", [1], "BYTES")
    name.set_data_from_numpy(np.array([target.encode()], dtype=object))
    return [x, name]


def call(serve: Serve, target: str, caller: str = "bls-caller") -> np.ndarray:
    client = httpclient.InferenceServerClient(serve.http_url, network_timeout=60)
    try:
        return client.infer(caller, inputs(httpclient, target)).as_numpy("y")
    finally:
        client.close()


def stream(serve: Serve, target: str) -> list[np.ndarray]:
    results: list[Any] = []
    with grpcclient.InferenceServerClient(serve.grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.append(error or result))
        client.async_stream_infer("bls-streamer", inputs(grpcclient, target), enable_empty_final_response=True)

        def ended() -> bool:
            return any(
                isinstance(r, InferenceServerException)
                or r.get_response().parameters.get("triton_final_response").bool_param
                for r in results
            )

        until(ended, lambda: f"the stream's end (so far: {results})", timeout=60)
        client.stop_stream()
    assert not any(isinstance(r, InferenceServerException) for r in results), results
    return [r.as_numpy("y") for r in results if r.as_numpy("y") is not None]


def idle_unloaded(serve: Serve, model: str) -> None:
    until(
        lambda: serve.status(model)["state"] == "unloaded",
        lambda: f"the idle unload of {model} (status: {serve.status(model)})",
        timeout=IDLE_SECS + 30,
        interval=0.2,
    )
    assert serve.status(model)["reason"] == "idle", serve.status(model)


def test_a_bls_call_wakes_its_callee_which_stays_in_use_while_called(serve: Serve) -> None:
    assert serve.status("bls-scale")["state"] == "unloaded"
    np.testing.assert_allclose(call(serve, "bls-scale"), X * 2)
    assert serve.status("bls-scale")["state"] == "ready" and serve.status("bls-scale")["load_count"] == 1

    # Called only through BLS (the gateway never sees it) for more than twice its idle timeout: still loaded.
    ends = time.monotonic() + 2.5 * IDLE_SECS
    while time.monotonic() < ends:
        np.testing.assert_allclose(call(serve, "bls-scale"), X * 2)
        assert serve.status("bls-scale")["state"] == "ready"
        time.sleep(0.5)
    assert serve.status("bls-scale")["load_count"] == 1

    idle_unloaded(serve, "bls-scale")  # once the calls stop
    np.testing.assert_allclose(call(serve, "bls-scale"), X * 2)
    assert serve.status("bls-scale")["load_count"] == 2


def test_a_decoupled_bls_call_streams_its_woken_decoupled_callee(serve: Serve) -> None:
    for loads in (1, 2):
        assert serve.status("bls-tokens")["state"] == "unloaded"
        ys = stream(serve, "bls-tokens")
        assert len(ys) == 3
        for i, y in enumerate(ys, start=1):
            np.testing.assert_allclose(y, X * i)
        assert serve.status("bls-tokens")["load_count"] == loads
        idle_unloaded(serve, "bls-tokens")


def test_a_callee_that_is_not_published_is_named_at_once(serve: Serve) -> None:
    with pytest.raises(InferenceServerException) as caught:
        call(serve, "bls-nobody")
    assert "could not wake model 'bls-nobody' for 'bls-caller'" in caught.value.message()
    assert "is not published" in caught.value.message()


def test_a_published_triton_folder_caller_wakes_its_callee(serve: Serve, package: Path, tmp_path: Path) -> None:
    """A BLS caller as a Triton user has it (no snoozeml in its code), published: its wrapper installs the wake."""
    folder = write_caller(tmp_path, "bls-folder-caller", "sync", install=False)
    r = httpx.post(
        f"{serve.api_url}/v1/models:from-path", json={"id": "bls-folder-caller", "path": str(folder)}, timeout=120
    )
    assert r.status_code == 201, r.text
    serve.publish("bls-folder-scale", package, idle_timeout_secs=IDLE_SECS)
    for loads in (1, 2):
        assert serve.status("bls-folder-scale")["state"] == "unloaded"
        np.testing.assert_allclose(call(serve, "bls-folder-scale", caller="bls-folder-caller"), X * 2)
        assert serve.status("bls-folder-scale")["load_count"] == loads
        idle_unloaded(serve, "bls-folder-scale")
