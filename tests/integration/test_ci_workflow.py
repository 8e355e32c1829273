"""examples/ci/validate-model-repository.yml, run: its `snoozectl` command lines, as written (relative
paths, from the checkout's root), over a `models/` folder holding the examples; the gate passes and
its JUnit report says so. tests/unit/test_deploy_ci.py checks the workflow's shape and flags."""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / "examples" / "ci" / "validate-model-repository.yml"
EXAMPLES = ROOT / "examples" / "models"
HAS_TORCH = importlib.util.find_spec("torch") is not None


def snoozectl_lines() -> list[str]:
    """The workflow's run lines that call snoozectl, continuation lines joined."""
    steps = yaml.safe_load(WORKFLOW.read_text())["jobs"]["validate"]["steps"]
    lines = []
    for step in steps:
        for line in step.get("run", "").replace("\\\n", " ").splitlines():
            if line.strip().startswith("snoozectl "):
                lines.append(line.strip())
    return lines


def test_the_workflow_command_lines_pass_on_the_examples(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"  # the user's repository: models/ at its root, as the workflow assumes
    shutil.copytree(EXAMPLES, checkout / "models", ignore=shutil.ignore_patterns("__pycache__"))
    if not HAS_TORCH:  # the workflow says to install a model's own requirements; torch is optional here
        shutil.rmtree(checkout / "models" / "torch-mlp")
    onnx_file = checkout / "models" / "onnx-mlp" / "model.onnx"
    if not onnx_file.exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "make_onnx_example.py"), str(onnx_file)], check=True)
    # `snoozectl` on PATH, as after the workflow's pip install
    env = {k: v for k, v in os.environ.items() if not k.startswith("SNOOZE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    lines = snoozectl_lines()
    assert [shlex.split(line)[1] for line in lines] == ["render", "validate"]
    for line in lines:
        proc = subprocess.run(shlex.split(line), cwd=checkout, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (line, proc.stdout[-4000:], proc.stderr[-4000:])
    report = ET.parse(checkout / "reports" / "validate.xml").getroot()
    assert report.get("failures") == "0" and report.get("errors", "0") == "0", ET.tostring(report, "unicode")[:4000]
    names = {case.get("classname") or "" for case in report.iter("testcase")}
    expected = {p.name for p in (checkout / "models").iterdir() if p.is_dir()}
    assert expected <= {n.split(".")[-1] for n in names} | names, names
    loads = [c for c in report.iter("testcase") if c.get("name") == "load"]
    assert len(loads) == len(expected) and all(c.find("skipped") is None for c in loads)
