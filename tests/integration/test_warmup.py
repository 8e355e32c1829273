"""Warm-up inside the load (Triton's model_warmup, rendered from the signature): against the real tritonserver.

The load runs one inference per instance before the model is ready, with inputs built from the declared
signature (zeros, variable dims 1, BYTES a short string), from the package's samples, or from the shapes
the model's traffic taught; generated inputs that fail are skipped (said once, the model loads), shipped
samples that fail fail the load with the model's own error; ``"warmup": false`` leaves predict alone
until the first request.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from controlplane.render import embedded_target, render_model
from controlplane.spec import DeploymentSpec, resolve
from controlplane.store.transactions import write_model

pytestmark = pytest.mark.integration

MODEL_PY = """
import json

import numpy as np


class Model:
    def __init__(self, calls="", fail=""):
        self.calls, self.fail = calls, fail

    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        x, text = inputs["x"], inputs["text"]
        with open(self.calls, "a") as f:
            f.write(json.dumps({"x": x.tolist(), "text": [t.decode() for t in text.reshape(-1)]}) + "\\n")
        if self.fail and not x.any():  # refuses zeros (what a generated warm-up sends), answers real inputs
            raise RuntimeError(self.fail)
        return {"y": (x * 2).astype(np.float32)}
"""


def publish(
    repo: Path,
    tmp: Path,
    name: str,
    *,
    warmup: bool | dict = True,
    worker: str = "in-stub",
    instances: int = 1,
    fail: str = "",
) -> Path:
    pkg = tmp / name
    pkg.mkdir()
    (pkg / "snooze_model.py").write_text(textwrap.dedent(MODEL_PY))
    calls = tmp / f"{name}.calls"
    manifest = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "dims": [-1, 2]},
            {"name": "text", "datatype": "BYTES", "dims": [1]},
        ],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [-1, 2]}],
        "params_schema": {"calls": {"type": "str"}, "fail": {"type": "str", "default": ""}},
        "params": {"calls": str(calls), "fail": fail},
        "warmup": warmup,
    }
    if isinstance(warmup, dict):
        np.save(pkg / "x.npy", np.zeros((3, 2), np.float32))
        np.save(pkg / "text.npy", np.array([b"shipped"]))
    (pkg / "snooze_model.json").write_text(json.dumps(manifest))
    spec = resolve(DeploymentSpec(id=name, path=pkg, worker=worker, instances=instances))
    write_model(render_model(spec, embedded_target()), repo)
    return calls


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("worker", ["in-stub", "preforked"])
def test_the_load_runs_one_inference_per_instance_from_the_signature(embedded_triton, model_repo, tmp_path, worker):
    name = f"warm-{worker}"
    calls = publish(model_repo, tmp_path, name, worker=worker, instances=2)
    client = httpclient.InferenceServerClient(embedded_triton.http_url.removeprefix("http://"))
    try:
        client.load_model(name)
        # Before any request, once per instance: the runtime's run; Triton's run of the same sample is answered
        # with its result, not a second predict.
        assert lines(calls) == [{"x": [[[0.0, 0.0]]], "text": ["snooze"]}] * 2
        x = httpclient.InferInput("x", [1, 1, 2], "FP32")
        x.set_data_from_numpy(np.ones((1, 1, 2), np.float32))
        text = httpclient.InferInput("text", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[b"hi"]], dtype=object))
        np.testing.assert_array_equal(client.infer(name, [x, text]).as_numpy("y"), [[[2.0, 2.0]]])
        assert len(lines(calls)) == 3
    finally:
        client.unload_model(name)
        client.close()


def notes(journal: Path, name: str) -> list[dict]:
    """The model's processes' warm-up notes, newest first (an unloaded process's may linger until it exits, and
    goes when it does: one that goes between the listing and its read is skipped, whichever model it was)."""
    found: list[tuple[int, dict]] = []
    for path in journal.glob("*.warmup"):
        try:
            found.append((path.stat().st_mtime_ns, json.loads(path.read_text())))
        except FileNotFoundError:
            continue
    return [n for _, n in sorted(found, key=lambda f: f[0], reverse=True) if n.get("model") == name]


def infer_ones(client: httpclient.InferenceServerClient, name: str, rows: int = 1) -> np.ndarray:
    x = httpclient.InferInput("x", [1, rows, 2], "FP32")
    x.set_data_from_numpy(np.ones((1, rows, 2), np.float32))
    text = httpclient.InferInput("text", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"hi"]], dtype=object))
    return client.infer(name, [x, text]).as_numpy("y")


@pytest.mark.parametrize("worker", ["in-stub", "preforked"])
def test_a_generated_warmup_that_fails_is_skipped_and_the_model_loads(embedded_triton, model_repo, tmp_path, worker):
    """Fails without the fix: the load failed with the model's error ("in the load's warm-up inference")."""
    name = f"warm-refuses-{worker}"
    calls = publish(model_repo, tmp_path, name, fail="zeros are not a feature vector", worker=worker)
    client = httpclient.InferenceServerClient(embedded_triton.http_url.removeprefix("http://"))
    try:
        client.load_model(name)
        assert client.is_model_ready(name)
        # predict ran once (the runtime's run); Triton's run was answered with outputs, never the failure.
        assert len(lines(calls)) == 1 and embedded_triton.is_running()
        [note] = notes(embedded_triton.journal_dir, name)
        assert note["source"] == "signature"
        assert note["skipped"].startswith("skipped (signature input x [1,1,2], text [1,1] failed: ")
        assert "zeros are not a feature vector" in note["skipped"]
        assert note["skipped"].endswith('ship samples or set "warmup": false)')
        np.testing.assert_array_equal(infer_ones(client, name), [[[2.0, 2.0]]])
        # The first real request's shapes (never its data), for the control plane to learn.
        assert notes(embedded_triton.journal_dir, name)[0]["learned"] == {
            "x": {"shape": [1, 2], "datatype": "FP32"},
            "text": {"shape": [1], "datatype": "BYTES"},
        }
    finally:
        client.unload_model(name)
        client.close()


def test_a_shipped_sample_that_fails_fails_the_load_with_the_models_error(embedded_triton, model_repo, tmp_path):
    calls = publish(
        model_repo, tmp_path, "warm-fails", fail="the feature store is down", warmup={"x": "x.npy", "text": "text.npy"}
    )
    client = httpclient.InferenceServerClient(embedded_triton.http_url.removeprefix("http://"))
    try:
        with pytest.raises(InferenceServerException, match="the feature store is down") as failed:
            client.load_model("warm-fails")
        assert "in the load's warm-up inference 'snooze_warmup_samples'" in failed.value.message()
        # The runtime ran the sample in initialize and failed there: Triton never ran a failing sample (its own
        # path for one crashed tritonserver about one load in five), and the server is still up.
        assert not client.is_model_ready("warm-fails") and len(lines(calls)) == 1
        assert embedded_triton.is_running() and client.is_server_live()
    finally:
        client.close()


def test_learned_shapes_replace_the_generated_inputs(embedded_triton, model_repo, tmp_path):
    from controlplane.warmup_samples import keep_learned, learned_shapes

    calls = publish(model_repo, tmp_path, "warm-learns")
    client = httpclient.InferenceServerClient(embedded_triton.http_url.removeprefix("http://"))
    try:
        client.load_model("warm-learns")
        infer_ones(client, "warm-learns", rows=4)
        [note] = notes(embedded_triton.journal_dir, "warm-learns")
        assert note["source"] == "signature" and note["learned"]["x"] == {"shape": [4, 2], "datatype": "FP32"}
        assert keep_learned(model_repo / "warm-learns", note["learned"])  # what the control plane does before a load
        assert learned_shapes(model_repo / "warm-learns") == note["learned"]
        client.unload_model("warm-learns")
        client.load_model("warm-learns")
        # The next load's warm-up ran zeros of the learned shapes (BYTES: empty strings), not the signature's.
        assert lines(calls)[-1] == {"x": [[[0.0, 0.0]] * 4], "text": [""]}
        assert notes(embedded_triton.journal_dir, "warm-learns")[0]["source"] == "learned"
    finally:
        client.unload_model("warm-learns")
        client.close()


def test_warmup_false_leaves_predict_to_the_first_request(embedded_triton, model_repo, tmp_path):
    calls = publish(model_repo, tmp_path, "warm-off", warmup=False)
    client = httpclient.InferenceServerClient(embedded_triton.http_url.removeprefix("http://"))
    try:
        client.load_model("warm-off")
        assert client.is_model_ready("warm-off") and lines(calls) == []
    finally:
        client.unload_model("warm-off")
        client.close()
