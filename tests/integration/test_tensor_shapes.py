"""Scalar and odd-shaped tensors against the real tritonserver, over HTTP and gRPC.

A rank-0 tensor is ``[1]`` on the wire (config ``dims: [1]`` with ``reshape: { shape: [ ] }``) and ``[]`` for
the model; tensor names with ``/``, ``.`` and ``:`` (what ONNX exporters write) work end to end.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from controlplane.render import embedded_target, render_model
from controlplane.spec import DeploymentSpec, resolve
from controlplane.store.transactions import write_model

pytestmark = pytest.mark.integration

SR, X, Y, N = "audio/sample_rate:0", "input.x", "out/y:0", "meta.n"


def scalar_onnx(path: Path) -> Path:
    from harness.corpus_models import scalar_onnx as build

    return build(path, sr=SR, x=X, y=Y, n=N)


SCALAR_PY = """
import numpy as np


class Model:
    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        sr, x = inputs["audio/sample_rate:0"], inputs["input.x"]
        if x.ndim == 2:  # batching: sr is [batch] (Triton's reshape of the wire's [batch, 1])
            assert sr.shape == (x.shape[0],), f"the model got sr of shape {sr.shape}"
            return {"out/y:0": x * sr[:, None].astype(np.float32), "meta.n": sr.astype(np.int64)}
        assert sr.shape == (), f"the model got sr of shape {sr.shape}"
        return {"out/y:0": x * np.float32(sr), "meta.n": np.array(sr, np.int64)}
"""


def scalar_custom(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "snooze_model.py").write_text(textwrap.dedent(SCALAR_PY))
    (path / "snooze_model.json").write_text(
        json.dumps(
            {
                "inputs": [
                    {"name": SR, "datatype": "INT64", "dims": []},
                    {"name": X, "datatype": "FP32", "dims": [-1]},
                ],
                "outputs": [
                    {"name": Y, "datatype": "FP32", "dims": [-1]},
                    {"name": N, "datatype": "INT64", "dims": []},
                ],
            }
        )
    )
    return path


def infer(
    triton, model_id: str, protocol: str, sr: int, x: np.ndarray, batched: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    lib = httpclient if protocol == "http" else grpcclient
    url = triton.http_url.removeprefix("http://") if protocol == "http" else triton.grpc_url
    client = lib.InferenceServerClient(url)
    try:
        a = lib.InferInput(SR, [1, 1] if batched else [1], "INT64")
        a.set_data_from_numpy(np.array([[sr]] if batched else [sr], np.int64))
        b = lib.InferInput(X, list(x.shape), "FP32")
        b.set_data_from_numpy(x)
        result = client.infer(model_id, [a, b])
        return result.as_numpy(Y), result.as_numpy(N)
    finally:
        client.close()


@pytest.mark.parametrize(("kind", "batch"), [("onnx", 0), ("custom", 0), ("custom", 8)])
def test_a_scalar_input_is_sent_as_one_element_and_the_model_receives_a_scalar(
    embedded_triton, model_repo, tmp_path, kind, batch
):
    """Fails without the fix: the runner refused [1] ("has shape [1] but the model expects []")."""
    pkg = scalar_onnx(tmp_path / kind) if kind == "onnx" else scalar_custom(tmp_path / kind)
    model_id = f"scalar-{kind}-{batch}"
    spec = resolve(DeploymentSpec(id=model_id, path=pkg, max_batch_size=batch))
    assert [t.dims for t in spec.package.inputs] == [[], [-1]]
    rendered = render_model(spec, embedded_target())
    if batch:  # [batch, 1] on the wire, [batch] for the model
        assert rendered.config_text.count("reshape {") == 2
    else:  # Triton refuses an empty reshape without batching: the runtime converts [1] <-> []
        assert "dims: 1\n" in rendered.config_text and "reshape" not in rendered.config_text
    write_model(rendered, model_repo)
    client = httpclient.InferenceServerClient(embedded_triton.http_url.removeprefix("http://"))
    try:
        client.load_model(model_id)
        x = np.array([[0.5, -1.0, 2.0]] if batch else [0.5, -1.0, 2.0], np.float32)
        for protocol in ("http", "grpc"):
            y, n = infer(embedded_triton, model_id, protocol, 16000, x, batched=bool(batch))
            np.testing.assert_array_equal(y, x * np.float32(16000), err_msg=protocol)
            assert n.shape == ((1, 1) if batch else (1,)) and int(n.reshape(-1)[0]) == 16000, protocol
    finally:
        client.unload_model(model_id)
        client.close()
