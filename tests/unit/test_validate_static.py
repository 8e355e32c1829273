"""Static checks of `snoozectl validate`: broken repositories built in tmp, each failure names the
model, the file and the fix."""

from __future__ import annotations

import json
import shutil
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from controlplane.render import FULL_TARGET, embedded_target
from controlplane.spec import DeploymentSpec, resolve_all
from controlplane.store import render_repository
from controlplane.validation import FAIL, OK, ValidationReport, validate_repository, warmup_inputs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "models"

LINEAR_MODEL = """
import numpy as np


class Model:
    def load(self, model_dir, device):
        self.w = np.ones((3, 2), dtype=np.float32)

    def predict(self, inputs):
        return {"y": inputs["x"] @ self.w}
"""
LINEAR_MANIFEST = {
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [3]}],
    "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
}


def write_package(root: Path, name: str, code: str = LINEAR_MODEL, manifest: dict | None = None) -> Path:
    pkg = root / "packages" / name
    pkg.mkdir(parents=True)
    (pkg / "snooze_model.py").write_text(textwrap.dedent(code))
    (pkg / "snooze_model.json").write_text(json.dumps(manifest or LINEAR_MANIFEST))
    return pkg


def write_onnx(path: Path, *, batch: str | int = "batch", external: bool = False) -> Path:
    """y = x @ W with x [batch, 4] -> y [batch, 2]; W optionally stored as external data."""
    path.parent.mkdir(parents=True, exist_ok=True)
    w = numpy_helper.from_array(np.ones((4, 2), dtype=np.float32), name="W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "W"], ["output"])],
        "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 4])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, 2])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    if external:
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=f"{path.name}.data",
            size_threshold=0,
        )
    else:
        onnx.save_model(model, str(path))
    return path


def render(tmp_path: Path, packages: dict[str, Path], target=None, **deployment) -> Path:
    repo = tmp_path / "repo"
    specs = resolve_all(DeploymentSpec(id=name, path=path, **deployment) for name, path in packages.items())
    render_repository(specs, repo, target or embedded_target())
    return repo


def failures(report: ValidationReport, check: str | None = None) -> list:
    return [r for r in report.results if r.status == FAIL and (check is None or r.check == check)]


def assert_names_model_file_fix(result, model: str, file_part: str) -> None:
    assert result.model == model
    assert f"model '{model}'" in result.message
    assert result.file and file_part in result.file and file_part in result.message
    assert result.fix and "Fix:" in result.message


@pytest.fixture
def linear_repo(tmp_path: Path) -> Path:
    return render(tmp_path, {"linear": write_package(tmp_path, "linear")})


# ---------------------------------------------------------------------------------------------


def test_rendered_examples_pass_on_both_targets(tmp_path: Path) -> None:
    onnx_pkg = tmp_path / "packages" / "onnx-mlp"
    write_onnx(onnx_pkg / "model.onnx")
    packages = {
        "numpy-linear": EXAMPLES / "numpy-linear",
        "text-features": EXAMPLES / "text-features",
        "onnx-mlp": onnx_pkg,
    }
    for name, target in (("embedded", embedded_target()), ("full", FULL_TARGET)):
        repo = render(tmp_path / name, packages, target)
        report = validate_repository(repo, target=target)
        assert report.ok, [r.message for r in report.failures]
        assert set(report.models) == set(packages)
        checks = {r.check for r in report.for_model("onnx-mlp") if r.status == OK}
        assert "onnx_signature" in checks
        assert {"package_import", "model_class", "params"} <= {r.check for r in report.for_model("numpy-linear")}


def test_the_warmup_folder_is_not_a_version_folder(tmp_path: Path) -> None:
    manifest = {
        "inputs": [{"name": "s", "datatype": "BYTES", "dims": [1]}],
        "outputs": [{"name": "y", "datatype": "BYTES", "dims": [1]}],
    }
    code = "class Model:\n    def load(self, d, dev): ...\n    def predict(self, x):\n        return {'y': x['s']}\n"
    repo = render(tmp_path, {"words": write_package(tmp_path, "words", code, manifest)})
    assert (repo / "words" / "warmup").is_dir()
    report = validate_repository(repo)
    assert report.ok, [r.message for r in report.failures]


def test_bad_pbtxt_fails_naming_model_file_and_fix(linear_repo: Path) -> None:
    (linear_repo / "linear" / "config.pbtxt").write_text('name: "linear"\nmax_batch_size: eight\n')
    report = validate_repository(linear_repo)
    assert not report.ok
    [bad] = failures(report, "config")
    assert_names_model_file_fix(bad, "linear", "linear/config.pbtxt")
    assert "ModelConfig" in bad.message


def test_missing_config_fails(linear_repo: Path) -> None:
    (linear_repo / "linear" / "config.pbtxt").unlink()
    [bad] = failures(validate_repository(linear_repo), "config")
    assert_names_model_file_fix(bad, "linear", "config.pbtxt")


def test_name_mismatch(linear_repo: Path) -> None:
    cfg = linear_repo / "linear" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('name: "linear"', 'name: "other"'))
    [bad] = failures(validate_repository(linear_repo), "name")
    assert_names_model_file_fix(bad, "linear", "linear/config.pbtxt")
    assert "'other'" in bad.message


def test_missing_version_file(linear_repo: Path) -> None:
    (linear_repo / "linear" / "1" / "model.py").unlink()
    [bad] = failures(validate_repository(linear_repo), "model_file")
    assert_names_model_file_fix(bad, "linear", "linear/1/model.py")


def test_non_numeric_and_missing_version_folders(linear_repo: Path) -> None:
    (linear_repo / "linear" / "1").rename(linear_repo / "linear" / "v1")
    report = validate_repository(linear_repo)
    messages = [r.message for r in failures(report, "versions")]
    assert any("'v1' is not a version number" in m for m in messages)
    assert any("no version folder" in m for m in messages)


def test_onnx_signature_mismatch_native(tmp_path: Path) -> None:
    pkg = tmp_path / "packages" / "mlp"
    write_onnx(pkg / "model.onnx")
    repo = render(tmp_path, {"mlp": pkg}, FULL_TARGET)
    cfg = repo / "mlp" / "config.pbtxt"
    text = cfg.read_text()
    cfg.write_text(text.replace("TYPE_FP32", "TYPE_INT64", 1).replace("dims: 2", "dims: 3"))
    [bad] = failures(validate_repository(repo, target="full"), "onnx_signature")
    assert_names_model_file_fix(bad, "mlp", "mlp/1/model.onnx")
    assert "input 'input' is float32 in the graph, TYPE_INT64 in the config" in bad.message
    assert "output 'output' has dims [2]" in bad.message


def test_onnx_signature_mismatch_python_backend_onnx(tmp_path: Path) -> None:
    """On the embedded target an ONNX model is a python-backend model: the graph in package/ is checked."""
    pkg = tmp_path / "packages" / "mlp"
    write_onnx(pkg / "model.onnx")
    repo = render(tmp_path, {"mlp": pkg})
    write_onnx(repo / "mlp" / "1" / "package" / "model.onnx", batch=1)  # swapped for a fixed-batch export
    [bad] = failures(validate_repository(repo), "onnx_batch_axis")
    assert_names_model_file_fix(bad, "mlp", "mlp/1/package/model.onnx")
    assert "dynamic" in bad.fix


def test_missing_external_data(tmp_path: Path) -> None:
    pkg = tmp_path / "packages" / "mlp"
    write_onnx(pkg / "model.onnx", external=True)
    repo = render(tmp_path, {"mlp": pkg}, FULL_TARGET)
    assert validate_repository(repo, target="full").ok
    (repo / "mlp" / "1" / "model.onnx.data").unlink()
    [bad] = failures(validate_repository(repo, target="full"), "onnx_external_data")
    assert_names_model_file_fix(bad, "mlp", "mlp/1/model.onnx")
    assert "model.onnx.data" in bad.message


def test_package_importing_framework_at_import_time(tmp_path: Path) -> None:
    """A stand-in `tensorrt` module inside the package: detection reads sys.modules, no framework needed."""
    pkg = write_package(tmp_path, "eager", "import tensorrt  # noqa\n" + LINEAR_MODEL)
    (pkg / "tensorrt").mkdir()
    (pkg / "tensorrt" / "__init__.py").write_text("")
    repo = render(tmp_path, {"eager": pkg})
    [bad] = failures(validate_repository(repo), "package_import")
    assert_names_model_file_fix(bad, "eager", "eager/1/package/snooze_model.py")
    assert "['tensorrt']" in bad.message and "load()" in bad.fix


def test_package_importing_torch_at_import_time(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    repo = render(tmp_path, {"eager": write_package(tmp_path, "eager", "import torch\n" + LINEAR_MODEL)})
    [bad] = failures(validate_repository(repo), "package_import")
    assert "['torch']" in bad.message


def test_class_without_predict(tmp_path: Path) -> None:
    code = "class Model:\n    def load(self, model_dir, device):\n        pass\n"
    repo = render(tmp_path, {"nopredict": write_package(tmp_path, "nopredict", code)})
    [bad] = failures(validate_repository(repo), "model_class")
    assert_names_model_file_fix(bad, "nopredict", "snooze_model.py")
    assert "['predict']" in bad.message


def test_missing_class_and_broken_import(tmp_path: Path) -> None:
    repo = render(
        tmp_path,
        {
            "noclass": write_package(tmp_path, "noclass", "class Other:\n    pass\n"),
            "broken": write_package(tmp_path, "broken", "import not_a_real_module_xyz\n"),
        },
    )
    report = validate_repository(repo)
    [noclass] = failures(report, "model_class")
    assert noclass.model == "noclass" and "no class 'Model'" in noclass.message
    [broken] = failures(report, "package_import")
    assert broken.model == "broken" and "not_a_real_module_xyz" in broken.message


def test_runtime_spec_inconsistent_with_config(linear_repo: Path) -> None:
    spec_file = linear_repo / "linear" / "1" / "snooze_runtime.json"
    spec = json.loads(spec_file.read_text())
    spec["max_batch_size"] = 4
    spec_file.write_text(json.dumps(spec))
    [bad] = failures(validate_repository(linear_repo), "runtime_spec")
    assert_names_model_file_fix(bad, "linear", "linear/1/snooze_runtime.json")
    assert "max_batch_size is 4" in bad.message


def test_missing_runtime_spec(linear_repo: Path) -> None:
    (linear_repo / "linear" / "1" / "snooze_runtime.json").unlink()
    [bad] = failures(validate_repository(linear_repo), "runtime_spec")
    assert_names_model_file_fix(bad, "linear", "snooze_runtime.json")


def test_undeclared_params_fail(linear_repo: Path) -> None:
    spec_file = linear_repo / "linear" / "1" / "snooze_runtime.json"
    spec = json.loads(spec_file.read_text())
    spec["params"] = {"scale": 2.0}
    spec_file.write_text(json.dumps(spec))
    [bad] = failures(validate_repository(linear_repo), "params")
    assert bad.model == "linear" and "params_schema" in bad.message and "Fix:" in bad.message
    # the spec's error names the model first too: the report says it once, and its fix once
    assert bad.message.count("model 'linear'") == 1 and bad.message.count("params_schema' with") == 1, bad.message


def test_a_converted_onnx_package_validates_clean(tmp_path: Path) -> None:
    """What the converter writes: an ONNX package whose params come from its params_schema's defaults
    (intra_op_num_threads, from OMP_NUM_THREADS); the manifest is not served with it."""
    pkg = tmp_path / "packages" / "converted"
    write_onnx(pkg / "model.onnx")
    schema = {"intra_op_num_threads": {"type": "int", "default": 1, "description": "from OMP_NUM_THREADS"}}
    (pkg / "snooze_model.json").write_text(json.dumps({"params_schema": schema}))
    repo = render(tmp_path, {"converted": pkg})
    assert not (repo / "converted" / "1" / "package" / "snooze_model.json").exists()
    report = validate_repository(repo)
    assert report.ok, [r.message for r in report.failures]
    spec_file = repo / "converted" / "1" / "snooze_runtime.json"
    spec = json.loads(spec_file.read_text())
    spec["params"] = {"intra_op_threads": 1}  # not a SessionOptions field: still caught, in a file that exists
    spec_file.write_text(json.dumps(spec))
    [bad] = failures(validate_repository(repo), "params")
    assert "intra_op_threads" in bad.message and (repo / bad.file).is_file(), bad.message


def test_hand_written_python_model_is_judged_as_publish_takes_it(tmp_path: Path) -> None:
    """A Triton python model (importing triton_python_backend_utils at module level) in a folder snoozeml did not
    write: rendered as publish renders it (the wrapper runs its file) and checked; a class without execute fails."""
    folder = tmp_path / "repo" / "tiny"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(
        'name: "tiny"\nbackend: "python"\nmax_batch_size: 8\n'
        'input [{ name: "x", data_type: TYPE_FP32, dims: [2] }]\n'
        'output [{ name: "y", data_type: TYPE_FP32, dims: [2] }]\n'
    )
    model = folder / "1" / "model.py"
    model.write_text("import triton_python_backend_utils as pb_utils\n\nclass TritonPythonModel:\n    pass\n")
    [bad] = failures(validate_repository(tmp_path / "repo"), "triton_model")
    assert "execute" in bad.message and bad.model == "tiny", bad.message
    model.write_text(
        "import triton_python_backend_utils as pb_utils\n\nclass TritonPythonModel:\n"
        "    def execute(self, requests):\n        return []\n"
    )
    report = validate_repository(tmp_path / "repo")
    assert report.ok, [r.message for r in report.failures]
    checks = {r.check: r for r in report.for_model("tiny")}
    assert checks["package"].status == OK and "triton-python" in checks["package"].message
    assert checks["triton_model"].status == OK and checks["entry_import"].status == OK


def test_tensorrt_plan_is_refused_on_embedded_and_flagged_gpu_only_on_full(tmp_path: Path) -> None:
    """A Triton plan folder: refused as publish refuses it (no model.plan; no tensorrt backend on the embedded
    target), checked on the full target."""
    folder = tmp_path / "repo" / "engine"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(
        'name: "engine"\nplatform: "tensorrt_plan"\nmax_batch_size: 8\n'
        'input [{ name: "x", data_type: TYPE_FP32, dims: [2] }]\n'
        'output [{ name: "y", data_type: TYPE_FP32, dims: [2] }]\n'
    )
    [missing] = failures(validate_repository(tmp_path / "repo", target="full"), "package")
    assert missing.model == "engine" and "1/model.plan" in missing.message and "Fix:" in missing.message
    (folder / "1" / "model.plan").write_bytes(b"\0plan")
    [refused] = failures(validate_repository(tmp_path / "repo"), "package")
    assert "tensorrt backend" in refused.message, refused.message
    report = validate_repository(tmp_path / "repo", target="full")
    assert report.ok, [r.message for r in report.failures]
    by_check = {r.check: r for r in report.results}
    assert "GPU-only" in by_check["gpu_only"].message


def test_empty_and_missing_repository(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    [empty] = failures(validate_repository(tmp_path / "empty"))
    assert "no model folders" in empty.message and "Fix:" in empty.message
    [missing] = failures(validate_repository(tmp_path / "nope"))
    assert "does not exist" in missing.message


def test_report_json_and_junit(linear_repo: Path, tmp_path: Path) -> None:
    (linear_repo / "linear" / "1" / "model.py").unlink()
    report = validate_repository(linear_repo)
    data = json.loads(report.to_json())
    assert data["ok"] is False and data["failures"] == len(report.failures) >= 1
    assert {"model", "check", "status", "ok", "message", "file", "fix", "load_secs"} <= set(data["results"][0])
    path = report.write_junit_xml(tmp_path / "out" / "junit.xml")
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites" and int(root.get("failures")) == len(report.failures)
    failed = [c for c in root.iter("testcase") if c.find("failure") is not None]
    assert any(
        c.get("name") == "model_file" and "linear/1/model.py" in c.find("failure").get("message") for c in failed
    )


def test_cli_exit_status_and_outputs(linear_repo: Path, tmp_path: Path) -> None:
    import typer

    from controlplane.cli.validate_command import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps `validate` a sub-command
    runner = CliRunner()
    ok = runner.invoke(app, ["validate", str(linear_repo), "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["ok"] is True
    shutil.rmtree(linear_repo / "linear" / "1" / "package")
    junit = tmp_path / "junit.xml"
    bad = runner.invoke(app, ["validate", str(linear_repo), "--junit-xml", str(junit)])
    assert bad.exit_code == 1
    assert "FAILED" in bad.output
    assert ET.parse(junit).getroot().get("failures") != "0"
    usage = runner.invoke(app, ["validate", str(linear_repo), "--triton-header", "novalue"])
    assert usage.exit_code == 2


def test_warmup_inputs_follow_the_config() -> None:
    from controlplane.render import parse_config

    config = parse_config(
        'name: "m"\nbackend: "python"\nmax_batch_size: 4\n'
        'input [{ name: "a", data_type: TYPE_FP16, dims: [-1, 3] },'
        '       { name: "s", data_type: TYPE_STRING, dims: [1] },'
        '       { name: "i", data_type: TYPE_INT64, dims: [2] },'
        '       { name: "b", data_type: TYPE_BOOL, dims: [1] }]\n'
        'output [{ name: "y", data_type: TYPE_FP32, dims: [1] }]\n',
        where="test",
    )
    arrays = warmup_inputs(config)
    assert arrays["a"].shape == (1, 1, 3) and arrays["a"].dtype == np.float16
    assert arrays["s"].dtype == object and isinstance(arrays["s"][0, 0], bytes)
    assert arrays["i"].dtype == np.int64 and arrays["i"].shape == (1, 2)
    assert arrays["b"].dtype == bool
    config.max_batch_size = 0
    assert warmup_inputs(config)["i"].shape == (2,)


def test_check_validate_and_parity_draw_the_same_samples_bf16_included(tmp_path: Path) -> None:
    """One generator (converters.samples): the same seed gives the same values to all three; BF16 goes to
    tritonclient as float32 holding bfloat16 values, to parity as ml_dtypes.bfloat16, and check refuses it
    because the python-backend runtime cannot hand it over."""
    import ml_dtypes

    from controlplane.check import build_inputs
    from controlplane.errors import InvalidPackageError
    from controlplane.render import parse_config
    from controlplane.spec import DeploymentSpec, resolve
    from converters.onnx_inspect import TensorSpec
    from converters.parity import random_inputs

    config = parse_config(
        'name: "m"\nbackend: "python"\nmax_batch_size: 4\n'
        'input [{ name: "x", data_type: TYPE_FP32, dims: [3] }, { name: "h", data_type: TYPE_BF16, dims: [2] }]\n'
        'output [{ name: "y", data_type: TYPE_FP32, dims: [1] }]\n',
        where="test",
    )
    validated = warmup_inputs(config, seed=0)
    parity = random_inputs(
        [TensorSpec("x", "float32", [-1, 3]), TensorSpec("h", "bfloat16", [-1, 2])], 1, np.random.default_rng(0)
    )
    assert parity["h"].dtype == ml_dtypes.bfloat16 and validated["h"].dtype == np.float32
    np.testing.assert_array_equal(validated["x"], parity["x"])
    np.testing.assert_array_equal(validated["h"], parity["h"].astype(np.float32))

    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "snooze_model.py").write_text("class Model:\n    pass\n")
    inputs = [{"name": "x", "datatype": "FP32", "dims": [3]}]
    manifest = {"inputs": inputs, "outputs": [{"name": "y", "datatype": "FP32", "dims": [1]}]}
    (pkg / "snooze_model.json").write_text(json.dumps(manifest))
    spec = resolve(DeploymentSpec(id="m", path=pkg, max_batch_size=4))
    np.testing.assert_array_equal(build_inputs(spec, [], seed=0)["x"], parity["x"])
    manifest["inputs"] = [*inputs, {"name": "h", "datatype": "BF16", "dims": [2]}]
    (pkg / "snooze_model.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidPackageError, match="input 'h': the python-backend runtime cannot pass BF16"):
        build_inputs(resolve(DeploymentSpec(id="m", path=pkg, max_batch_size=4)), [], seed=0)


def test_relative_and_absolute_repository_paths_give_the_same_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The documented CI gate runs `snoozectl validate .snooze/model_repository`: a relative path.
    repo = render(tmp_path, {"numpy-linear": EXAMPLES / "numpy-linear"})
    monkeypatch.chdir(tmp_path)
    relative = validate_repository(Path("repo"))
    absolute = validate_repository(repo)
    assert relative.ok, [r.message for r in relative.failures]
    assert [(r.model, r.check, r.status) for r in relative.results] == [
        (r.model, r.check, r.status) for r in absolute.results
    ]
    assert relative.repository == "repo"  # the report names the folder as the user gave it


def test_validate_load_takes_the_packages_samples_bytes_included_and_generates_the_rest(tmp_path: Path) -> None:
    from controlplane.render import parse_config
    from controlplane.validation.live import GENERATED, choose_inputs

    manifest = {"inputs": [{"name": "s", "datatype": "BYTES", "dims": [2]},
                           {"name": "t", "datatype": "BYTES", "dims": [1]},
                           {"name": "n", "datatype": "INT64", "dims": [1]}],
                "outputs": [{"name": "y", "datatype": "BYTES", "dims": [1]}],
                "warmup": {"s": "s.npy"}}  # fmt: skip
    code = "class Model:\n    def load(self, d, dev): ...\n    def predict(self, x):\n        return {'y': x['t']}\n"
    pkg = write_package(tmp_path, "words", code, manifest)
    np.save(pkg / "s.npy", np.array([b"hello", b"world"]))
    folder = render(tmp_path, {"words": pkg}) / "words"
    chosen = choose_inputs(folder, parse_config((folder / "config.pbtxt").read_text(), where="words"))
    assert chosen.sources == {"s": "warm-up sample", "t": GENERATED, "n": GENERATED}
    assert chosen.arrays["s"].tolist() == [[b"hello", b"world"]]  # one item, with the batch axis
    assert chosen.arrays["t"].shape == (1, 1) and chosen.generated == ["t", "n"]


def test_validate_load_takes_learned_shapes_after_samples_before_generated(tmp_path: Path) -> None:
    from controlplane.render import parse_config
    from controlplane.validation.live import GENERATED, choose_inputs
    from controlplane.warmup_samples import keep_learned

    manifest = {"inputs": [{"name": "image", "datatype": "FP32", "dims": [3, -1, -1]},
                           {"name": "tag", "datatype": "BYTES", "dims": [1]},
                           {"name": "n", "datatype": "INT64", "dims": [1]}],
                "outputs": [{"name": "y", "datatype": "FP32", "dims": [1]}]}  # fmt: skip
    code = "class Model:\n    def load(self, d, dev): ...\n    def predict(self, x):\n        return {'y': x['n']}\n"
    pkg = write_package(tmp_path, "det", code, manifest)
    folder = render(tmp_path, {"det": pkg}) / "det"
    config = parse_config((folder / "config.pbtxt").read_text(), where="det")
    assert choose_inputs(folder, config).generated == ["image", "tag", "n"]
    # what the model's traffic showed (a 96x64 image); an input learned under another datatype is not used
    assert keep_learned(folder, {"image": {"shape": [3, 64, 96], "datatype": "FP32"},
                                 "tag": {"shape": [1], "datatype": "BYTES"},
                                 "n": {"shape": [1], "datatype": "FP32"}})  # fmt: skip
    chosen = choose_inputs(folder, config)
    assert chosen.sources == {"image": "learned shape", "tag": "learned shape", "n": GENERATED}
    assert chosen.arrays["image"].shape == (1, 3, 64, 96) and not chosen.arrays["image"].any()
    assert chosen.arrays["tag"].tolist() == [[b""]]
