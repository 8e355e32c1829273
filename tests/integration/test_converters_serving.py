"""Prefer native, end to end: a torch package exported to ONNX (in the worker) is rendered for the
embedded target, served by the real tritonserver and answers like torch over HTTP and gRPC; a package
whose export fails falls back to the custom package, which is served instead."""

from __future__ import annotations

import importlib.util
import json
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from controlplane.native import NativeDecision, prefer_native
from controlplane.render import embedded_target, render_model
from controlplane.spec import DeploymentSpec, PackageKind, resolve
from controlplane.store.transactions import write_model
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.launcher import EmbeddedTriton
from controlplane.validation import OK, validate_repository
from python_backend.spec import SPEC_FILE

HAS_TORCH = importlib.util.find_spec("torch") is not None
pytestmark = [
    pytest.mark.integration,
    pytest.mark.torch,
    pytest.mark.skipif(not HAS_TORCH, reason="torch not installed (pip install torch==2.13.0)"),
]

SIGNATURE = {
    "inputs": [{"name": "features", "datatype": "FP32", "dims": [6]}],
    "outputs": [{"name": "scores", "datatype": "FP32", "dims": [3]}],
    "env": {"OMP_NUM_THREADS": "1"},
}

MLP = """
import numpy as np


def build():
    import torch

    torch.manual_seed(7)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3), torch.nn.Softmax(dim=-1)
    ).eval()


class Model:
    def load(self, model_dir, device):
        import torch

        self.torch = torch
        self.module = build()

    def predict(self, inputs):
        with self.torch.no_grad():
            return {"scores": self.module(self.torch.from_numpy(inputs["features"])).numpy()}

    def export_module(self):
        return self.module, {"features": np.zeros((2, 6), np.float32)}
"""

# torch.linalg.eigvals has no ONNX translation in either exporter: the export must fail, the custom
# package is served. Inputs are 6 numbers read as the diagonal of a 3x3 matrix plus 3 off-diagonal zeros.
EIGVALS = """
import numpy as np


class Model:
    def load(self, model_dir, device):
        import torch

        self.torch = torch

        class Eig(torch.nn.Module):
            def forward(self, features):
                diag = torch.diag_embed(features[:, :3])
                values = torch.linalg.eigvals(diag).real
                return torch.sort(values, dim=-1).values

        self.module = Eig()

    def predict(self, inputs):
        return {"scores": self.module(self.torch.from_numpy(inputs["features"])).numpy()}

    def export_module(self):
        return self.module, {"features": np.ones((2, 6), np.float32)}
"""


def _package(root: Path, name: str, code: str) -> Path:
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "snooze_model.py").write_text(textwrap.dedent(code))
    (pkg / "snooze_model.json").write_text(json.dumps(SIGNATURE))
    return pkg


def _module_of(pkg: Path):
    spec = importlib.util.spec_from_file_location(f"pkg_{uuid.uuid4().hex}", pkg / "snooze_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, NativeDecision]:
    root = tmp_path_factory.mktemp("native")
    pkg = _package(root, "mlp", MLP)
    stages: list[str] = []
    decision = prefer_native(pkg, max_batch_size=8, out_dir=root / "mlp-onnx", progress=stages.append)
    assert decision.native and decision.converted, decision.reason
    assert "checking parity with Model.predict" in stages
    # the report names the file beside it, not the temporary folder it was checked in
    parity = json.loads((decision.publish_path / "parity.json").read_text())
    assert parity["artifact"] == "model.onnx" and decision.report["artifact"] == "model.onnx", parity["artifact"]
    return pkg, decision


async def _serve(triton: EmbeddedTriton, admin: TritonAdminClient, package: Path, prefix: str) -> str:
    model_id = f"{prefix}-{uuid.uuid4().hex[:8]}"
    spec = resolve(DeploymentSpec(id=model_id, path=package, max_batch_size=8))
    rendered = render_model(spec, embedded_target())
    folder = write_model(rendered, triton.model_repository)
    assert (folder / "1" / SPEC_FILE).is_file()
    await admin.load(model_id)
    return model_id


def _infer_both(triton: EmbeddedTriton, model_id: str, x: np.ndarray) -> dict[str, np.ndarray]:
    answers = {}
    for name, lib, client in (
        ("http", httpclient, httpclient.InferenceServerClient(triton.http_url.removeprefix("http://"))),
        ("grpc", grpcclient, grpcclient.InferenceServerClient(triton.grpc_url)),
    ):
        tensor = lib.InferInput("features", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer(model_id, [tensor], outputs=[lib.InferRequestedOutput("scores")])
        answers[name] = result.as_numpy("scores")
        client.close()
    return answers


async def test_exported_onnx_package_is_served_and_matches_torch(
    exported: tuple[Path, NativeDecision], embedded_triton: EmbeddedTriton, triton_admin: TritonAdminClient
) -> None:
    import torch

    pkg, decision = exported
    spec = resolve(DeploymentSpec(id="probe", path=decision.publish_path, max_batch_size=8))
    assert spec.package.kind is PackageKind.ONNX  # provenance/snooze_model.py does not make it custom
    assert (decision.publish_path / "provenance" / "snooze_model.py").is_file()

    model_id = await _serve(embedded_triton, triton_admin, decision.publish_path, "native-mlp")
    try:
        runtime = json.loads((embedded_triton.model_repository / model_id / "1" / SPEC_FILE).read_text())
        assert runtime["kind"] == "onnx" and runtime["onnx_file"] == "model.onnx"
        assert runtime["params"] == {"intra_op_num_threads": 1}
        x = np.random.default_rng(11).standard_normal((5, 6)).astype(np.float32)
        with torch.no_grad():
            expected = _module_of(pkg).build()(torch.from_numpy(x)).numpy()
        for protocol, got in _infer_both(embedded_triton, model_id, x).items():
            assert got.shape == (5, 3), protocol
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg=protocol)
    finally:
        await triton_admin.unload(model_id)


def test_the_converted_package_validates_clean_static_and_loaded(
    exported: tuple[Path, NativeDecision], embedded_triton: EmbeddedTriton
) -> None:
    """The converter's own output (params from OMP_NUM_THREADS, served without its manifest) passes
    `snoozectl validate`: it used to fail on 'params given but the package declares no params_schema'."""
    _, decision = exported
    model_id = f"validate-converted-{uuid.uuid4().hex[:8]}"
    spec = resolve(DeploymentSpec(id=model_id, path=decision.publish_path, max_batch_size=8))
    write_model(render_model(spec, embedded_target()), embedded_triton.model_repository)
    for load in (False, True):
        report = validate_repository(embedded_triton.model_repository, load=load, models=[model_id],
                                     triton_url=embedded_triton.http_url)  # fmt: skip
        assert report.ok, [r.message for r in report.failures]
        passed = {r.check for r in report.results if r.status == OK}
        assert "params" in passed and (not load or {"load", "warmup_infer", "unload"} <= passed), report.results


async def test_failed_export_falls_back_to_the_custom_package(
    tmp_path: Path, embedded_triton: EmbeddedTriton, triton_admin: TritonAdminClient
) -> None:
    pkg = _package(tmp_path, "eig", EIGVALS)
    decision = prefer_native(pkg, max_batch_size=8, out_dir=tmp_path / "eig-onnx")
    assert not decision.native and not decision.converted and decision.stage == "export"
    assert decision.publish_path == pkg.resolve()
    assert decision.reason.startswith("serving the custom package (python backend): export failed")
    assert "dynamo:" in decision.reason and "torchscript:" in decision.reason and "eig" in decision.reason
    assert not (tmp_path / "eig-onnx").exists()

    model_id = await _serve(embedded_triton, triton_admin, decision.publish_path, "fallback-eig")
    try:
        runtime = json.loads((embedded_triton.model_repository / model_id / "1" / SPEC_FILE).read_text())
        assert runtime["kind"] == "custom"
        x = np.array([[3, 1, 2, 0, 0, 0], [-1, 5, 4, 9, 9, 9]], dtype=np.float32)
        expected = np.sort(x[:, :3], axis=-1)
        for protocol, got in _infer_both(embedded_triton, model_id, x).items():
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=protocol)
    finally:
        await triton_admin.unload(model_id)
