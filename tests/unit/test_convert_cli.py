"""`snoozectl convert torch | onnx-to-trt` through Typer's CliRunner."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.tensorrt_package import tensorrt_unavailable_reason

HAS_TORCH = importlib.util.find_spec("torch") is not None
runner = CliRunner()

MLP_PACKAGE = """
import numpy as np


class Model:
    def load(self, model_dir, device):
        import torch

        torch.manual_seed(0)
        self.torch = torch
        self.module = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2)).eval()

    def predict(self, inputs):
        with self.torch.no_grad():
            return {"y": self.module(self.torch.from_numpy(inputs["x"])).numpy()}

    def export_module(self):
        return self.module, {"x": np.zeros((2, 4), np.float32)}
"""


def _package(root: Path, code: str = MLP_PACKAGE) -> Path:
    pkg = root / "mlp"
    pkg.mkdir()
    (pkg / "snooze_model.py").write_text(textwrap.dedent(code))
    (pkg / "snooze_model.json").write_text(
        json.dumps(
            {
                "inputs": [{"name": "x", "datatype": "FP32", "dims": [4]}],
                "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
            }
        )
    )
    return pkg


def _onnx_file(root: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    path = root / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


def test_convert_group_is_registered() -> None:
    result = runner.invoke(app, ["convert", "--help"])
    assert result.exit_code == 0 and "torch" in result.output and "onnx-to-trt" in result.output


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_convert_torch_writes_model_and_parity_report(tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    user = tmp_path / "x.npy"
    np.save(user, np.random.default_rng(3).standard_normal((5, 4)).astype(np.float32))
    out = tmp_path / "onnx"
    result = runner.invoke(
        app,
        [
            "convert",
            "torch",
            str(pkg),
            "--out",
            str(out),
            "--max-batch-size",
            "4",
            "--atol",
            "1e-5",
            "--input",
            f"x={user}",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "parity passed on 4 comparisons" in result.output and "user input 0" in result.output
    assert (out / "model.onnx").is_file() and (out / "provenance" / "snooze_model.py").is_file()
    report = json.loads((out / "parity.json").read_text())
    assert report["passed"] and {c["case"] for c in report["comparisons"]} >= {"random, batch 4", "user input 0"}
    assert all(c["atol"] == 1e-5 for c in report["comparisons"])

    again = runner.invoke(app, ["convert", "torch", str(pkg), "--out", str(out), "--json"])
    assert again.exit_code == 1
    body = json.loads(again.stdout)
    assert body["ok"] is False and "not empty" in body["error"] and body["hint"]


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_convert_torch_json_names_the_failing_exporters(tmp_path: Path) -> None:
    code = MLP_PACKAGE.replace(
        "return self.module, {",
        "import torch\n        class Eig(torch.nn.Module):\n            def forward(self, x):\n"
        "                return torch.linalg.eigvals(x.reshape(-1, 2, 2)).real\n"
        "        return Eig(), {",
    )
    pkg = _package(tmp_path, code)
    out = tmp_path / "onnx"
    result = runner.invoke(app, ["convert", "torch", str(pkg), "--out", str(out), "--json"])
    assert result.exit_code == 1
    body = json.loads(result.stdout)
    assert body["ok"] is False and body["code"] == "conversion_failed" and body["stage"] == "export"
    assert "dynamo:" in body["error"] and "torchscript:" in body["error"] and "linalg" in body["error"]
    assert not out.exists()  # nothing to show, nothing left behind


def test_convert_torch_rejects_a_package_without_hook(tmp_path: Path) -> None:
    pkg = _package(tmp_path, MLP_PACKAGE.replace("def export_module", "def other"))
    result = runner.invoke(app, ["convert", "torch", str(pkg), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1
    assert "has no export hook" in result.output and "fix:" in result.output and "export_module" in result.output


def test_convert_torch_bad_input_option(tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    result = runner.invoke(app, ["convert", "torch", str(pkg), "--out", str(tmp_path / "o"), "--input", "x:4x3"])
    assert result.exit_code == 1 and "expected NAME=FILE.npy" in result.output


@pytest.mark.skipif(tensorrt_unavailable_reason() is None, reason="this machine can build TensorRT plans")
def test_onnx_to_trt_fails_fast_without_gpu_and_leaves_no_file(tmp_path: Path) -> None:
    model = _onnx_file(tmp_path)
    out = tmp_path / "trt"
    result = runner.invoke(app, ["convert", "onnx-to-trt", str(model), "--out", str(out), "--fp16"])
    assert result.exit_code == 1
    assert "cannot build a TensorRT plan" in result.output and str(model) in result.output
    assert "onnx_tensorrt = true" in result.output and "snoozeml[gpu]" in result.output  # markup not eaten
    assert not out.exists()

    as_json = runner.invoke(app, ["convert", "onnx-to-trt", str(model), "--out", str(out), "--json"])
    assert as_json.exit_code == 1
    body = json.loads(as_json.stdout)
    assert body["ok"] is False and body["code"] == "conversion_failed" and "onnx_tensorrt" in body["hint"]
    assert not out.exists()


def test_onnx_to_trt_names_a_missing_file(tmp_path: Path) -> None:
    result = runner.invoke(app, ["convert", "onnx-to-trt", str(tmp_path / "nope.onnx"), "--out", str(tmp_path / "t")])
    assert result.exit_code == 1 and "nope.onnx: ONNX file not found" in result.output
    assert not (tmp_path / "t").exists()


@pytest.mark.gpu
@pytest.mark.skipif(tensorrt_unavailable_reason() is not None, reason="needs an NVIDIA GPU and tensorrt")
def test_onnx_to_trt_builds_a_plan_package(tmp_path: Path) -> None:  # pragma: no cover - GPU machines
    model = _onnx_file(tmp_path)
    out = tmp_path / "trt"
    result = runner.invoke(app, ["convert", "onnx-to-trt", str(model), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert (out / "model.plan").is_file()
    manifest = json.loads((out / "snooze_model.json").read_text())
    assert manifest["inputs"] == [{"name": "x", "datatype": "FP32", "dims": [3]}]


# ---------------------------------------------------------------------------------------------
# publish --prefer-native (default) / --no-convert, against a recording stand-in for the control API


class _RecordingClient:
    calls: list[dict] = []

    def __init__(self, base_url: str, api_key: str | None = None, **_: object) -> None:
        pass

    def __enter__(self) -> _RecordingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def live(self) -> None:
        pass

    def publish_archive(self, path, model_id, *, progress=None, **deployment):
        path = Path(path)
        files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
        self.calls.append({"path": path, "id": model_id, "deployment": deployment, "files": files})
        kind = "onnx" if "model.onnx" in files else "custom"
        return {"id": model_id, "kind": kind, "backend": "python"}


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    monkeypatch.setattr("controlplane.api.client.ControlPlaneClient", _RecordingClient)
    _RecordingClient.calls = []
    return _RecordingClient.calls


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_publish_prefers_the_onnx_export(tmp_path: Path, recording: list[dict]) -> None:
    pkg = _package(tmp_path)
    result = runner.invoke(app, ["publish", str(pkg), "--max-batch-size", "4", "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["kind"] == "onnx" and body["conversion"]["converted"] is True
    assert "parity passed" in body["conversion"]["reason"]
    (call,) = recording
    assert call["id"] == "mlp"  # the id comes from the original folder, not the temporary one
    assert "model.onnx" in call["files"] and "provenance/snooze_model.py" in call["files"]
    assert call["deployment"] == {"max_batch_size": 4}
    assert not call["path"].exists()  # the converted package lived only for the publish


def test_publish_no_convert_and_no_hook_send_the_custom_package(tmp_path: Path, recording: list[dict]) -> None:
    pkg = _package(tmp_path)
    result = runner.invoke(app, ["publish", str(pkg), "--no-convert", "--json"])
    assert result.exit_code == 0, result.output
    assert "conversion" not in json.loads(result.stdout) and recording[-1]["path"] == pkg

    no_hook = tmp_path / "nohook"
    no_hook.mkdir()
    for name in ("snooze_model.py", "snooze_model.json"):
        text = (pkg / name).read_text()
        (no_hook / name).write_text(text.replace("def export_module", "def other"))
    result = runner.invoke(app, ["publish", str(no_hook), "--id", "plain"])
    assert result.exit_code == 0, result.output
    # A plain custom model is the ordinary case: one line, no warning-like note about export hooks.
    assert result.output.strip() == "published plain (custom, python backend)"
    assert recording[-1]["path"] == no_hook.resolve() and recording[-1]["id"] == "plain"
    result = runner.invoke(app, ["publish", str(no_hook), "--id", "plain", "--json"])
    assert json.loads(result.stdout)["conversion"]["reason"].endswith("has no export hook")  # said to scripts


def test_publish_says_an_unreachable_api_first_and_a_missing_path_plainly(tmp_path: Path) -> None:
    from controlplane.triton.launcher import free_port

    pkg = _package(tmp_path)
    no_hook = tmp_path / "nohook"
    no_hook.mkdir()
    for name in ("snooze_model.py", "snooze_model.json"):
        (no_hook / name).write_text((pkg / name).read_text().replace("def export_module", "def x"))
    result = runner.invoke(app, ["publish", str(no_hook), "--url", f"http://127.0.0.1:{free_port()}"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: cannot reach the control API"), result.stderr
    assert "export hook" not in result.output

    result = runner.invoke(app, ["publish", str(tmp_path / "nowhere"), "--url", f"http://127.0.0.1:{free_port()}"])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: {tmp_path / 'nowhere'}: no such file or folder"), result.stderr


def test_publish_sends_the_keep_alive_policy(tmp_path: Path, recording: list[dict]) -> None:
    pkg = _package(tmp_path)
    result = runner.invoke(app, ["publish", str(pkg), "--no-convert", "--keep-alive", "adaptive", "--json"])
    assert result.exit_code == 0, result.output
    assert recording[-1]["deployment"] == {"keep_alive": "adaptive"}
