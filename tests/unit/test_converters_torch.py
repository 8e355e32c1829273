"""torch -> ONNX export and parity on small models built here, and the package pipeline."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from converters import ConversionError, ExportError, ParityError, inspect_onnx  # noqa: E402
from converters.parity import check_parity  # noqa: E402
from converters.pipeline import convert_package_to_onnx  # noqa: E402
from converters.signature import PackageSignature, TensorDecl  # noqa: E402
from converters.torch_export import (  # noqa: E402
    Exporter,
    TorchRunner,
    export_module_to_onnx,
    export_torchscript_to_onnx,
)

pytestmark = pytest.mark.torch


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, image):
        h = torch.relu(self.conv2(torch.relu(self.conv1(image))))
        return torch.softmax(self.head(h.mean(dim=(2, 3))), dim=-1)


class TwoInputs(torch.nn.Module):
    """float32 features + int64 token ids; returns a float32 score and an int64 label (a dict output)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.proj = torch.nn.Linear(8 + 6, 3)

    def forward(self, features, token_ids):
        pooled = self.embed(token_ids).mean(dim=1)
        scores = self.proj(torch.cat([pooled, features], dim=1))
        return {"scores": scores, "label": scores.argmax(dim=1)}


class Unexportable(torch.nn.Module):
    """Complex eigenvalues: neither exporter has an ONNX translation."""

    def forward(self, x):
        return torch.linalg.eigvals(x).real


class DataDependentBranch(torch.nn.Module):
    """torch.export refuses the data-dependent branch; the TorchScript tracer freezes one side of it."""

    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x * 3


def _seeded(cls):
    torch.manual_seed(0)
    return cls().eval()


def test_mlp_export_and_parity(tmp_path: Path) -> None:
    module = _seeded(MLP)
    stages: list[str] = []
    result = export_module_to_onnx(
        module, {"x": np.zeros((1, 16), np.float32)}, tmp_path / "model.onnx", ["y"], progress=stages.append
    )
    assert result.exporter is Exporter.DYNAMO and result.dynamo_error is None
    assert result.export_secs > 0
    sig = result.signature
    assert [(t.name, t.dtype, t.dims) for t in sig.inputs] == [("x", "float32", [-1, 16])]
    assert [(t.name, t.dtype, t.dims) for t in sig.outputs] == [("y", "float32", [-1, 4])]
    assert sig.opset == 18 and sig.external_data == [] and sig.path == tmp_path / "model.onnx"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]  # weights inlined, staging removed
    assert stages[0].startswith("exporting to ONNX (dynamo exporter, opset 18)")
    report = check_parity(TorchRunner(module, ["x"], ["y"]), result.onnx_path, max_batch_size=16)
    assert report.passed, report.summary()
    assert [c.batch_size for c in report.comparisons] == [1, 3, 16]


def test_conv_net_opset_17(tmp_path: Path) -> None:
    module = _seeded(ConvNet)
    example = {"image": np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)}
    result = export_module_to_onnx(module, example, tmp_path / "conv.onnx", ["probs"], opset=17)
    assert result.signature.opset == 17
    assert result.signature.inputs[0].dims == [-1, 3, 16, 16]
    report = check_parity(TorchRunner(module, ["image"], ["probs"]), result.onnx_path, max_batch_size=8)
    assert report.passed, report.summary()


def test_two_inputs_of_different_dtypes(tmp_path: Path) -> None:
    module = _seeded(TwoInputs)
    # given in the other order than forward's: the exporter follows forward's parameter order
    example = {"token_ids": np.array([[1, 49, 3, 0]], np.int64), "features": np.ones((1, 6), np.float32)}
    declared = PackageSignature(
        inputs=[TensorDecl("features", "float32", [6]), TensorDecl("token_ids", "int64", [4])],
        outputs=[TensorDecl("label", "int64", []), TensorDecl("scores", "float32", [3])],
    )
    result = export_module_to_onnx(module, example, tmp_path / "model.onnx", ["label", "scores"], expected=declared)
    sig = result.signature
    assert [(t.name, t.dtype) for t in sig.inputs] == [("features", "float32"), ("token_ids", "int64")]
    assert [(t.name, t.dtype) for t in sig.outputs] == [("scores", "float32"), ("label", "int64")]
    runner = TorchRunner(module, ["features", "token_ids"], ["scores", "label"])
    report = check_parity(runner, result.onnx_path, max_batch_size=8, example_inputs=example)
    assert report.passed, report.summary()
    assert {c.output: c.atol for c in report.comparisons} == {"scores": 1e-4, "label": 0.0}


def test_declared_dtype_mismatch_is_refused(tmp_path: Path) -> None:
    declared = PackageSignature(inputs=[TensorDecl("x", "float32", [16])], outputs=[TensorDecl("y", "float16", [4])])
    with pytest.raises(ExportError) as info:
        export_module_to_onnx(
            _seeded(MLP),
            {"x": np.zeros((2, 16), np.float32)},
            tmp_path / "model.onnx",
            ["y"],
            expected=declared,
            exporters=[Exporter.TORCHSCRIPT],
        )
    assert "output 'y' is float32 in the export but declared float16 (cast it in forward)" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_wrong_output_count(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"returns 1 output\(s\) but the signature declares 2"):
        export_module_to_onnx(_seeded(MLP), {"x": np.zeros((2, 16), np.float32)}, tmp_path / "m.onnx", ["a", "b"])


def test_failing_export_names_each_exporter(tmp_path: Path) -> None:
    example = {"x": np.random.default_rng(0).standard_normal((2, 3, 3)).astype(np.float32)}
    with pytest.raises(ExportError) as info:
        export_module_to_onnx(Unexportable(), example, tmp_path / "model.onnx", ["y"])
    message = str(info.value)
    assert "every exporter failed" in message and "dynamo:" in message and "torchscript:" in message
    assert "linalg_eig" in message
    assert list(tmp_path.iterdir()) == []  # no partial file, staging removed


def test_dynamo_failure_falls_back_and_parity_catches_it(tmp_path: Path) -> None:
    module = DataDependentBranch()
    stages: list[str] = []
    result = export_module_to_onnx(module, {"x": np.ones((2, 3), np.float32)}, tmp_path / "m.onnx", ["y"],
                                   progress=stages.append)  # fmt: skip
    assert result.exporter is Exporter.TORCHSCRIPT
    assert result.dynamo_error and "data-dependent" in result.dynamo_error
    # each exporter announced the same way, and the switch said why
    exporting = [s for s in stages if s.startswith("exporting to ONNX")]
    assert [s.split(" exporter")[0].split("(")[1] for s in exporting] == ["dynamo", "torchscript"]
    [switch] = [s for s in stages if s.startswith("the dynamo exporter failed (")]
    assert switch.endswith("): trying the torchscript exporter")
    assert stages.index(switch) == stages.index(exporting[1]) - 1
    report = check_parity(
        TorchRunner(module, ["x"], ["y"]),
        result.onnx_path,
        max_batch_size=8,
        user_inputs=[{"x": -np.ones((2, 3), np.float32)}],
    )
    assert not report.passed  # the traced graph always takes the x.sum() > 0 branch


def test_large_weights_are_carried_as_external_data(tmp_path: Path) -> None:
    result = export_module_to_onnx(
        _seeded(MLP), {"x": np.zeros((2, 16), np.float32)}, tmp_path / "model.onnx", ["y"], inline_limit_bytes=1
    )
    assert result.signature.external_data == ["model.onnx.data"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    onnx.checker.check_model(str(tmp_path / "model.onnx"))
    # a later export under the limit removes the stale data file
    export_module_to_onnx(_seeded(MLP), {"x": np.zeros((2, 16), np.float32)}, tmp_path / "model.onnx", ["y"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    assert inspect_onnx(tmp_path / "model.onnx").external_data == []


def test_torchscript_file(tmp_path: Path) -> None:
    module = _seeded(MLP)
    scripted = torch.jit.trace(module, torch.zeros(2, 16))
    scripted.save(str(tmp_path / "model.pt"))
    result = export_torchscript_to_onnx(
        tmp_path / "model.pt", {"x": np.zeros((2, 16), np.float32)}, tmp_path / "out" / "model.onnx", ["y"]
    )
    report = check_parity(TorchRunner(module, ["x"], ["y"]), result.onnx_path, max_batch_size=4)
    assert report.passed, report.summary()


def test_torchscript_file_missing(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"nope\.pt: TorchScript file not found"):
        export_torchscript_to_onnx(tmp_path / "nope.pt", {"x": np.zeros((2, 16))}, tmp_path / "m.onnx", ["y"])


PACKAGE = """
import numpy as np


class Model:
    def __init__(self, scale=1.0):
        self.scale = scale

    def load(self, model_dir, device):
        import torch

        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).eval()
        self.torch = torch

    def predict(self, inputs):
        with self.torch.no_grad():
            y = self.net(self.torch.from_numpy(inputs["x"] * self.scale))
        return {"y": y.numpy()}

    def export_module(self):
        return self.net, {"x": np.zeros((1, 4), np.float32)}
"""


def _package(tmp_path: Path, source: str) -> Path:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "snooze_model.py").write_text(textwrap.dedent(source))
    return package


SIGNATURE = PackageSignature(inputs=[TensorDecl("x", "float32", [4])], outputs=[TensorDecl("y", "float32", [2])])


def test_pipeline_package_hook_on_class(tmp_path: Path) -> None:
    stages: list[str] = []
    result = convert_package_to_onnx(
        _package(tmp_path, PACKAGE), tmp_path / "out", SIGNATURE, max_batch_size=8, progress=stages.append
    )
    assert result.onnx_path == tmp_path / "out" / "model.onnx" and result.exporter is Exporter.DYNAMO
    assert result.parity_report.passed and result.parity_report.reference == "Model.predict"
    assert (tmp_path / "out" / "parity.json").is_file()
    assert stages[0] == "loading the package" and stages[-2] == "checking parity with Model.predict"
    assert stages[-1] == "done"


def test_pipeline_parity_failure_names_the_reason(tmp_path: Path) -> None:
    """predict scales its input (params), the exported module does not: parity must fail."""
    with pytest.raises(ParityError) as info:
        convert_package_to_onnx(
            _package(tmp_path, PACKAGE), tmp_path / "out", SIGNATURE, max_batch_size=4, params={"scale": 2.0}
        )
    assert "parity failed" in str(info.value) and "output 'y'" in str(info.value)
    assert not info.value.report.passed
    assert (tmp_path / "out" / "parity.json").is_file()


def test_pipeline_module_level_hook_without_model_class(tmp_path: Path) -> None:
    source = """
    import numpy as np
    import torch


    def export_module(model_dir):
        torch.manual_seed(0)
        return torch.nn.Linear(4, 2), {"x": np.zeros((3, 4), np.float32)}
    """
    result = convert_package_to_onnx(_package(tmp_path, source), tmp_path / "out", SIGNATURE, max_batch_size=2)
    assert result.parity_report.reference == "torch module" and result.parity_report.passed


def test_pipeline_export_failure(tmp_path: Path) -> None:
    source = """
    import numpy as np
    import torch


    class Eig(torch.nn.Module):
        def forward(self, x):
            return torch.linalg.eigvals(x.reshape(-1, 2, 2)).real


    def export_module():
        return Eig(), {"x": np.ones((2, 4), np.float32)}
    """
    with pytest.raises(ExportError, match="every exporter failed"):
        convert_package_to_onnx(_package(tmp_path, source), tmp_path / "out", SIGNATURE, max_batch_size=2)
    assert not (tmp_path / "out" / "model.onnx").exists()


def test_pipeline_package_without_hook(tmp_path: Path) -> None:
    source = """
    class Model:
        def load(self, model_dir, device):
            pass

        def predict(self, inputs):
            return inputs
    """
    with pytest.raises(ConversionError, match="no export hook; define Model.export_module"):
        convert_package_to_onnx(_package(tmp_path, source), tmp_path / "out", SIGNATURE, max_batch_size=2)
