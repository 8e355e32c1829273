"""controlplane.native: what publish serves (native ONNX or the custom package) and why; the worker protocol.

The torch-marked tests run real exports in the child worker; the rest need no torch."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from controlplane.conversion_worker import ConversionFailed, run_worker
from controlplane.errors import InvalidPackageError
from controlplane.native import (
    NativeDecision,
    _worst_parity,
    find_export_hook,
    native_package,
    prefer_native,
    tolerances_from,
)
from controlplane.spec import PackageKind, load_package

HAS_TORCH = importlib.util.find_spec("torch") is not None

SIGNATURE = {
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [3]}],
    "outputs": [{"name": "y", "datatype": "FP32", "dims": [3]}],
}

MLP_PACKAGE = """
import numpy as np


def build():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).eval()


class Model:
    def load(self, model_dir, device):
        self.module = build()

    def predict(self, inputs):
        import torch

        with torch.no_grad():
            return {"y": self.module(torch.from_numpy(inputs["x"])).numpy()}

    def export_module(self):
        return self.module, {"x": np.zeros((2, 3), np.float32)}
"""

BRANCH_PACKAGE = """
import numpy as np


def build():
    import torch

    class Branch(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x * 3

    return Branch()


class Model:
    def load(self, model_dir, device):
        self.module = build()

    def predict(self, inputs):
        import torch

        return {"y": self.module(torch.from_numpy(inputs["x"])).numpy()}

    def export_module(self):
        return self.module, {"x": np.ones((2, 3), np.float32)}
"""

NO_HOOK = """
class Model:
    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        return {"y": inputs["x"]}
"""


def make_package(root: Path, name: str, code: str, **manifest: object) -> Path:
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "snooze_model.py").write_text(textwrap.dedent(code))
    (pkg / "snooze_model.json").write_text(json.dumps({**SIGNATURE, **manifest}))
    return pkg


def make_onnx_package(root: Path) -> Path:
    pkg = root / "onnx-pkg"
    pkg.mkdir()
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(pkg / "model.onnx"))
    return pkg


# ---------------------------------------------------------------------------------------------
# No torch needed


def test_find_export_hook_without_importing(tmp_path: Path) -> None:
    method = make_package(tmp_path, "method", MLP_PACKAGE)
    assert find_export_hook(method) == "Model.export_module()"
    module_level = make_package(tmp_path, "module", NO_HOOK + "\n\ndef export_module():\n    raise SystemExit(1)\n")
    assert find_export_hook(module_level) == "export_module()"
    assert find_export_hook(make_package(tmp_path, "none", NO_HOOK)) is None
    other_class = make_package(tmp_path, "other", MLP_PACKAGE)
    assert find_export_hook(other_class, class_name="Net") is None


def test_native_packages_are_published_as_they_are(tmp_path: Path) -> None:
    pkg = make_onnx_package(tmp_path)
    decision = prefer_native(pkg, max_batch_size=8, out_dir=tmp_path / "out")
    assert decision.native and not decision.converted and decision.publish_path == pkg.resolve()
    assert "already a native package (onnx)" in decision.reason
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("code", "manifest", "batch", "stage", "words"),
    [
        (NO_HOOK, {}, 8, "hook", "has no export hook"),
        (MLP_PACKAGE, {"tensor_format": "raw"}, 8, "package", "tensor_format 'raw'"),
        (MLP_PACKAGE, {}, 0, "package", "max_batch_size 0"),
        ("def broken(:\n", {}, 8, "hook", "cannot be parsed"),
    ],
)
def test_fallbacks_that_need_no_worker(tmp_path, code, manifest, batch, stage, words) -> None:
    pkg = make_package(tmp_path, "pkg", code, **manifest)
    decision = prefer_native(pkg, max_batch_size=batch, out_dir=tmp_path / "out")
    assert not decision.native and decision.publish_path == pkg.resolve() and decision.stage == stage
    assert decision.reason.startswith("serving the custom package (python backend): ") and words in decision.reason
    assert not (tmp_path / "out").exists()


def test_torch_missing_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("controlplane.native.torch_available", lambda: False)
    decision = prefer_native(make_package(tmp_path, "pkg", MLP_PACKAGE), max_batch_size=8, out_dir=tmp_path / "o")
    assert not decision.native and decision.stage == "torch" and "torch is not installed" in decision.reason
    assert decision.hint == "pip install 'snoozeml[torch]'"


def test_out_dir_must_be_new_and_outside_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("controlplane.native.torch_available", lambda: True)
    pkg = make_package(tmp_path, "pkg", MLP_PACKAGE)
    with pytest.raises(InvalidPackageError, match="inside the package"):
        prefer_native(pkg, max_batch_size=8, out_dir=pkg / "onnx")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(InvalidPackageError, match="exists and is not empty"):
        prefer_native(pkg, max_batch_size=8, out_dir=busy)
    assert (busy / "keep.txt").read_text() == "mine"


def test_invalid_package_is_an_error(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "snooze_model.py").write_text(NO_HOOK)  # no manifest: custom models must declare their signature
    with pytest.raises(InvalidPackageError, match="needs a manifest snooze_model.json declaring its 'inputs'"):
        prefer_native(pkg, max_batch_size=8, out_dir=tmp_path / "out")


def test_tolerances_from_options() -> None:
    assert tolerances_from(None, None) == {}
    tol = tolerances_from(1e-2, None)
    assert tol["float32"] == (1e-2, 1e-3) and tol["float64"] == (1e-2, 1e-5)
    assert set(tol) == {"float64", "float32", "float16", "bfloat16"}


def test_no_convert_and_publish_params(tmp_path: Path) -> None:
    pkg = make_package(tmp_path, "pkg", MLP_PACKAGE)
    with native_package(pkg, enabled=False, max_batch_size=8) as decision:
        assert not decision.native and decision.publish_path == pkg.resolve()
        assert "--no-convert" in decision.reason and decision.publish_params({"a": 1}) == {"a": 1}
    converted = NativeDecision(tmp_path, True, "exported", None, 1.0, converted=True)
    assert converted.publish_params({"scale": 2}) == {}
    assert json.loads(json.dumps(converted.to_dict()))["publish_path"] == str(tmp_path)


def test_worst_parity_names_output_error_and_tolerance() -> None:
    report = {
        "comparisons": [
            {
                "case": "random, batch 1",
                "output": "y",
                "passed": True,
                "max_abs": 0.0,
                "max_rel": 0.0,
                "atol": 1e-4,
                "rtol": 1e-3,
                "detail": None,
            },
            {
                "case": "user input 0",
                "output": "y",
                "passed": False,
                "max_abs": 2.0,
                "max_rel": 0.5,
                "atol": 1e-4,
                "rtol": 1e-3,
                "detail": "6 of 6 element(s) outside tolerance",
            },
        ]
    }
    text = _worst_parity(report)
    assert "output 'y' on user input 0" in text and "max abs error 2" in text
    assert "atol 0.0001 + rtol 0.001" in text and "1 of 2 comparisons failed" in text


def test_worker_rejects_a_bad_request(tmp_path: Path) -> None:
    (tmp_path / "req.json").write_text(json.dumps({"op": "nope"}))
    proc = subprocess.run(
        [sys.executable, "-m", "converters.worker", str(tmp_path / "req.json"), str(tmp_path / "res.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "bad request" in proc.stderr and not (tmp_path / "res.json").exists()


def test_worker_reports_a_failed_trt_build_without_a_file(tmp_path: Path) -> None:
    onnx_file = make_onnx_package(tmp_path) / "model.onnx"
    plan = tmp_path / "model.plan"
    stages: list[str] = []
    result = run_worker(
        {"op": "onnx_to_trt", "onnx_path": str(onnx_file), "plan_path": str(plan), "max_batch_size": 8},
        progress=stages.append,
    )
    if result["ok"]:  # pragma: no cover - a GPU machine with tensorrt
        assert plan.is_file()
        return
    assert result["error_type"] == "TensorRTUnavailableError" and "Instead:" in result["message"]
    assert not plan.exists()


# ---------------------------------------------------------------------------------------------
# Real exports, in the child worker


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_export_builds_an_onnx_package_without_torch_in_the_parent(tmp_path: Path) -> None:
    pkg = make_package(tmp_path, "mlp", MLP_PACKAGE, env={"OMP_NUM_THREADS": "1"}, metadata={"task": "demo"})
    out = tmp_path / "out"
    script = textwrap.dedent(
        f"""
        import json, sys
        from controlplane.native import prefer_native
        stages = []
        d = prefer_native({str(pkg)!r}, max_batch_size=4, out_dir={str(out)!r}, progress=stages.append)
        print(json.dumps({{"decision": d.to_dict(), "stages": stages, "torch": "torch" in sys.modules}}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout.strip().splitlines()[-1])
    decision = body["decision"]
    assert body["torch"] is False  # the export ran in the worker
    assert decision["native"] and decision["converted"] and decision["publish_path"] == str(out.resolve())
    assert decision["exporter"] == "dynamo" and decision["export_secs"] > 0 and decision["report"]["passed"]
    assert "parity passed on 3 comparisons" in decision["reason"]
    assert any(s.startswith("exporting to ONNX") for s in body["stages"])
    assert "checking parity with Model.predict" in body["stages"]

    converted = load_package(out)
    assert converted.kind is PackageKind.ONNX and converted.model_file == "model.onnx"
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "parity.json", "provenance", "snooze_model.json"]
    assert (out / "provenance" / "snooze_model.py").read_text() == (pkg / "snooze_model.py").read_text()
    manifest = json.loads((out / "snooze_model.json").read_text())
    assert "inputs" not in manifest and "outputs" not in manifest  # the ONNX file says it all
    assert manifest["metadata"]["task"] == "demo"
    assert manifest["metadata"]["converted_from"]["provenance"] == "provenance/"
    assert manifest["params_schema"]["intra_op_num_threads"]["default"] == 1
    assert json.loads((out / "parity.json").read_text())["passed"] is True
    assert [(t.name, t.datatype, t.dims) for t in converted.inputs] == [("x", "FP32", [3])]


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_parity_failure_falls_back_with_the_worst_error(tmp_path: Path) -> None:
    pkg = make_package(tmp_path, "branch", BRANCH_PACKAGE)
    negative = tmp_path / "neg.npy"
    np.save(negative, -np.ones((2, 3), np.float32))
    out = tmp_path / "out"
    decision = prefer_native(pkg, max_batch_size=4, out_dir=out, user_inputs=[{"x": negative}])
    assert not decision.native and decision.stage == "parity" and decision.publish_path == pkg.resolve()
    assert "parity failed: output 'y' on " in decision.reason and "max abs error " in decision.reason
    assert "> tolerance atol 0.0001 + rtol 0.001" in decision.reason and "comparisons failed" in decision.reason
    user_case = [c for c in decision.report["comparisons"] if c["case"] == "user input 0"]
    assert user_case and not user_case[0]["passed"]  # the traced graph took the x.sum() > 0 branch
    assert decision.report is not None and decision.report["passed"] is False
    assert decision.artifacts == out / "rejected"
    assert sorted(p.name for p in decision.artifacts.iterdir()) == ["model.onnx", "parity.json"]
    assert not (out / "model.onnx").exists()  # no publishable ONNX package at the top


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_worker_timeout_kills_the_child(tmp_path: Path) -> None:
    slow = MLP_PACKAGE.replace("self.module = build()", "import time; time.sleep(120)")
    pkg = make_package(tmp_path, "slow", slow)
    with pytest.raises(ConversionFailed, match="did not finish within 3 s"):
        prefer_native(pkg, max_batch_size=4, out_dir=tmp_path / "out", timeout=3)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
