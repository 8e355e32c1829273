"""`snoozectl check` shows what predict really returned when the runtime had to narrow it (issue 21 item 5)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from controlplane.cli import app

FLOAT64_MODEL = """
import numpy as np


class Model:
    def load(self, model_dir, device):
        self.w = np.ones((4, 3))  # float64, a common slip

    def predict(self, inputs):
        return {"y": inputs["x"] @ self.w}
"""


def _package(root: Path, code: str) -> Path:
    pkg = root / "f64"
    pkg.mkdir()
    (pkg / "snooze_model.py").write_text(code)
    (pkg / "snooze_model.json").write_text(json.dumps({
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [3]}],
    }))  # fmt: skip
    return pkg


def test_check_says_predict_returned_float64_for_a_declared_fp32(tmp_path: Path) -> None:
    pkg = _package(tmp_path, FLOAT64_MODEL)
    result = CliRunner().invoke(app, ["check", str(pkg), "--input", "x:2x4"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "y: shape (2, 3) float32" in result.stdout  # served as declared
    assert "note: predict returned float64, served as FP32 by a narrowing cast" in result.stdout

    result = CliRunner().invoke(app, ["check", str(pkg), "--input", "x:2x4", "--json"])
    y = json.loads(result.stdout)["outputs"]["y"]
    assert (y["dtype"], y["returned_dtype"]) == ("float32", "float64") and "narrowing" in y["note"]


def test_check_is_quiet_when_predict_returns_the_declared_dtype(tmp_path: Path) -> None:
    pkg = _package(tmp_path, FLOAT64_MODEL.replace("np.ones((4, 3))", "np.ones((4, 3), np.float32)"))
    result = CliRunner().invoke(app, ["check", str(pkg), "--input", "x:2x4", "--json"])
    y = json.loads(result.stdout)["outputs"]["y"]
    assert y["returned_dtype"] == "float32" and "note" not in y


def test_check_shows_the_values_of_a_bytes_output() -> None:
    """The human output printed BYTES values in brackets as Rich markup, which swallowed them."""
    examples = Path(__file__).resolve().parents[2] / "examples" / "models"
    result = CliRunner().invoke(app, ["check", str(examples / "text-features")])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if line.strip().startswith("greeting:"))
    assert line.endswith("]") and "[b'hello, " in line, line
