"""`snoozectl validate --load` against a real tritonserver: the examples load, answer one warm-up
inference and unload; broken models fail with their reason; JSON and JUnit outputs parse."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from controlplane.render import embedded_target
from controlplane.spec import DeploymentSpec, discover, resolve_all
from controlplane.store import render_repository
from controlplane.triton.launcher import EmbeddedTriton
from controlplane.validation import FAIL, OK, SKIP, WARN, validate_repository

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "models"
HAS_TORCH = importlib.util.find_spec("torch") is not None

MANIFEST = {
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [2]}],
    "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
}
FAILS_LOAD = """
class Model:
    def load(self, model_dir, device):
        raise RuntimeError("weights.bin is missing")

    def predict(self, inputs):
        return {"y": inputs["x"]}
"""
REFUSES_NEGATIVES = """
class Model:
    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        if (inputs["x"] < 0).any():
            raise ValueError("x must be non-negative (it is a count)")
        return {"y": inputs["x"]}
"""
FAILS_PREDICT = """
class Model:
    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        raise ValueError("predict is broken")
"""


def _examples(tmp_path: Path) -> Path:
    """A copy of examples/models with the ONNX example built (it is generated, not committed)."""
    models = tmp_path / "models"
    shutil.copytree(EXAMPLES, models, ignore=shutil.ignore_patterns("__pycache__"))
    if not HAS_TORCH:
        shutil.rmtree(models / "torch-mlp")
    onnx_file = models / "onnx-mlp" / "model.onnx"
    if not onnx_file.exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "make_onnx_example.py"), str(onnx_file)], check=True)
    return models


def _package(root: Path, name: str, code: str) -> Path:
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "snooze_model.py").write_text(textwrap.dedent(code))
    (pkg / "snooze_model.json").write_text(json.dumps(MANIFEST))
    return pkg


@pytest.fixture(scope="module")
def example_report(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("validate_load")
    repo = tmp / "model_repository"
    specs = resolve_all(discover(_examples(tmp)))
    render_repository(specs, repo, embedded_target())
    report = validate_repository(repo, load=True, target="embedded")
    return repo, report, [s.id for s in specs]


def test_examples_load_warm_up_and_unload(example_report) -> None:
    _, report, ids = example_report
    assert report.ok, [r.message for r in report.failures]
    assert set(report.models) == set(ids)
    for model in ids:
        checks = {r.check: r for r in report.for_model(model)}
        assert checks["load"].status == OK and checks["load"].load_secs > 0
        # A streaming example answers on gRPC streams only: no HTTP inference is sent to it.
        expected = SKIP if model == "text-generator" else OK
        assert checks["warmup_infer"].status == expected, checks["warmup_infer"].message
        assert checks["unload"].status == OK
    assert set(report.load_secs) == set(ids)


def test_json_and_junit_outputs_parse(example_report, tmp_path: Path) -> None:
    _, report, ids = example_report
    data = json.loads(report.to_json())
    assert data["ok"] is True and data["load"] is True
    assert set(data["load_secs"]) == set(ids)
    root = ET.parse(report.write_junit_xml(tmp_path / "junit.xml")).getroot()
    assert root.get("failures") == "0"
    suites = {s.get("name") for s in root.iter("testsuite")}
    assert suites == {f"snoozeml.validate.{m}" for m in ids}
    load_cases = [c for c in root.iter("testcase") if c.get("name") == "load"]
    assert len(load_cases) == len(ids) and all(float(c.get("time")) > 0 for c in load_cases)


def test_cli_load_json(example_report, tmp_path: Path) -> None:
    """The command end to end, in its own process, against the same repository (one model)."""
    repo, _, _ = example_report
    code = (
        "import sys, typer\n"
        "from controlplane.cli.validate_command import register\n"
        "app = typer.Typer()\nregister(app)\napp.command('noop')(lambda: None)\napp()\n"
    )
    junit = tmp_path / "junit.xml"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "validate",
            str(repo),
            "--load",
            "--model",
            "numpy-linear",
            "--json",
            "--junit-xml",
            str(junit),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert data["models"] == ["numpy-linear"] and data["load_secs"]["numpy-linear"] > 0
    assert ET.parse(junit).getroot().get("failures") == "0"


def test_broken_models_fail_with_reasons_against_running_triton(
    embedded_triton: EmbeddedTriton, model_repo: Path, tmp_path: Path
) -> None:
    """--triton-url: use the session's running Triton; failures name the model and Triton's reason."""
    packages = {
        "validate-fails-load": _package(tmp_path, "fails-load", FAILS_LOAD),
        "validate-fails-predict": _package(tmp_path, "fails-predict", FAILS_PREDICT),
        "validate-linear": EXAMPLES / "numpy-linear",
    }
    specs = resolve_all(DeploymentSpec(id=name, path=path) for name, path in packages.items())
    render_repository(specs, model_repo, embedded_target())
    report = validate_repository(model_repo, load=True, triton_url=embedded_triton.http_url, models=list(packages))
    assert not report.ok
    by = {(r.model, r.check): r for r in report.results}
    load_fail = by[("validate-fails-load", "load")]
    assert load_fail.status == FAIL and "weights.bin is missing" in load_fail.message
    assert "model 'validate-fails-load'" in load_fail.message and "Fix:" in load_fail.message
    # The load's generated warm-up is best effort (a broken predict still loads, the warm-up skipped); the
    # validation's own inference then reports the model's error, a warning since its inputs were generated
    # (the package ships no sample that could tell a broken model from a refused input).
    assert by[("validate-fails-predict", "load")].status == OK
    predict_fail = by[("validate-fails-predict", "warmup_infer")]
    assert predict_fail.status == WARN and "predict is broken" in predict_fail.message
    assert "generated" in predict_fail.message
    assert by[("validate-linear", "warmup_infer")].status == OK
    assert by[("validate-linear", "load")].load_secs > 0


def test_load_sends_the_packages_samples_and_a_generated_input_that_fails_is_a_warning(
    embedded_triton: EmbeddedTriton, model_repo: Path, tmp_path: Path
) -> None:
    """A model that refuses negative numbers: with a warm-up sample it passes on it; without one the random
    input fails, which is a warning that says the input was generated and how to ship one (--strict: a fail)."""
    import numpy as np

    with_sample = _package(tmp_path, "with-sample", REFUSES_NEGATIVES)
    np.save(with_sample / "x.npy", np.array([3.0, 4.0], dtype=np.float32))
    manifest = json.loads((with_sample / "snooze_model.json").read_text())
    (with_sample / "snooze_model.json").write_text(json.dumps({**manifest, "warmup": {"x": "x.npy"}}))
    packages = {"validate-sample": with_sample,
                "validate-generated": _package(tmp_path, "generated", REFUSES_NEGATIVES)}  # fmt: skip
    specs = resolve_all(DeploymentSpec(id=name, path=path) for name, path in packages.items())
    render_repository(specs, model_repo, embedded_target())
    for strict in (False, True):
        report = validate_repository(model_repo, load=True, triton_url=embedded_triton.http_url,
                                     models=list(packages), strict=strict)  # fmt: skip
        by = {(r.model, r.check): r for r in report.results}
        sampled = by[("validate-sample", "warmup_infer")]
        assert sampled.status == OK and "warm-up sample: x" in sampled.message, sampled.message
        generated = by[("validate-generated", "warmup_infer")]
        assert generated.status == (FAIL if strict else WARN), generated.message
        assert "generated input(s) ['x']" in generated.message and "x must be non-negative" in generated.message
        assert "'warmup'" in generated.fix and "snooze_model.json" in generated.fix
        assert report.ok is not strict, [r.message for r in report.failures]


def test_a_model_the_target_cannot_run_fails_as_publish_refuses_it(
    embedded_triton: EmbeddedTriton, model_repo: Path
) -> None:
    """A TensorRT plan's Triton folder on the embedded target (no tensorrt backend, no GPU): validate's verdict is
    publish's (a refusal, with its fix), not a skipped load that would pass a folder publish then refuses."""
    folder = model_repo / "validate-engine"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.plan").write_bytes(b"\0")
    (folder / "config.pbtxt").write_text(
        'name: "validate-engine"\nplatform: "tensorrt_plan"\nmax_batch_size: 1\n'
        'input [{ name: "x", data_type: TYPE_FP32, dims: [2] }]\n'
        'output [{ name: "y", data_type: TYPE_FP32, dims: [2] }]\n'
    )
    report = validate_repository(model_repo, load=True, triton_url=embedded_triton.http_url, models=["validate-engine"])
    assert not report.ok
    package = next(r for r in report.results if r.check == "package")
    assert package.status == FAIL and "publish refuses it" in package.message and "tensorrt" in package.message
    assert "--target full" in package.fix
    assert not any(r.check == "load" and r.status == OK for r in report.results)  # nothing was loaded
