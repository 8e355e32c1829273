"""Warm-up inside the load (Triton's model_warmup, rendered from the signature): against the real tritonserver.

The load runs one inference per instance before the model is ready, with inputs built from the declared
signature (zeros, variable dims 1, BYTES a short string); a warm-up that fails fails the load with the
model's own error; ``"warmup": false`` leaves predict alone until the first request.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from controlplane.render import embedded_target, render_model, write_model
from controlplane.spec import DeploymentSpec, resolve

pytestmark = pytest.mark.integration

MODEL_PY = '''
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
        if self.fail:
            raise RuntimeError(self.fail)
        return {"y": (x * 2).astype(np.float32)}
'''


def publish(repo: Path, tmp: Path, name: str, *, warmup: bool = True, worker: str = "in-stub", instances: int = 1,
            fail: str = "") -> Path:
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


def test_a_failing_warmup_fails_the_load_with_the_models_error(embedded_triton, model_repo, tmp_path):
    calls = publish(model_repo, tmp_path, "warm-fails", fail="the feature store is down")
    client = httpclient.InferenceServerClient(embedded_triton.http_url.removeprefix("http://"))
    try:
        with pytest.raises(InferenceServerException, match="the feature store is down") as failed:
            client.load_model("warm-fails")
        assert "in the load's warm-up inference 'snooze_warmup'" in failed.value.message()
        # The runtime ran the sample in initialize and failed there: Triton never ran a failing sample (its own
        # path for one crashed tritonserver about one load in five), and the server is still up.
        assert not client.is_model_ready("warm-fails") and len(lines(calls)) == 1
        assert embedded_triton.is_running() and client.is_server_live()
    finally:
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
