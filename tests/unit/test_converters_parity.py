"""Parity checks between a numpy reference and an ONNX model built with onnx.helper (no torch needed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from converters.errors import NotBatchableError
from converters.onnx_inspect import TensorSpec
from converters.parity import Tolerance, check_parity, parity_batch_sizes, random_inputs

W = np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2)


def _model(path: Path, batch: str | int = "batch") -> Path:
    """y = x @ W (float32); idx = argmax(y) (int64); ids passthrough + 1 (int64 input)."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["y"]),
            helper.make_node("ArgMax", ["y"], ["idx"], axis=1, keepdims=0),
            helper.make_node("Add", ["ids", "one"], ["ids_plus"]),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, [batch, "n"]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 2]),
            helper.make_tensor_value_info("idx", TensorProto.INT64, [batch]),
            helper.make_tensor_value_info("ids_plus", TensorProto.INT64, [batch, "n"]),
        ],
        initializer=[numpy_helper.from_array(W, "W"), numpy_helper.from_array(np.array(1, np.int64), "one")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _reference(noise: float = 0.0, idx_offset: int = 0):
    def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        y = inputs["x"].astype(np.float64) @ W.astype(np.float64)
        y = (y + noise).astype(np.float32)
        return {"y": y, "idx": np.argmax(y, axis=1) + idx_offset, "ids_plus": inputs["ids"] + 1}

    return run


def test_passes_and_saves_report(tmp_path: Path) -> None:
    path = _model(tmp_path / "model.onnx")
    example = {"x": np.zeros((2, 4), np.float32), "ids": np.array([[5, 7, 9]] * 2, np.int64)}
    user = [{"x": np.ones((2, 4), np.float32), "ids": np.zeros((2, 3), np.int64)}]
    report = check_parity(
        _reference(),
        path,
        max_batch_size=8,
        example_inputs=example,
        user_inputs=user,
        reference_name="numpy",
        report_path=tmp_path / "parity.json",
    )
    assert report.passed, report.summary()
    cases = sorted({(c.case, c.batch_size) for c in report.comparisons})
    assert cases == [("random, batch 1", 1), ("random, batch 3", 3), ("random, batch 8", 8), ("user input 0", 2)]
    shapes = {c.output: c.shape for c in report.comparisons if c.case == "random, batch 3"}
    assert shapes == {"y": [3, 2], "idx": [3], "ids_plus": [3, 3]}  # variable axis sized like the example
    saved = json.loads((tmp_path / "parity.json").read_text())
    assert saved["passed"] is True and saved["reference"] == "numpy" and len(saved["comparisons"]) == 12
    assert max(report.worst()["y"].max_abs, 0) < 1e-5
    assert "parity passed on 12 comparisons" in report.summary()


def test_integer_inputs_stay_in_example_range() -> None:
    specs = [
        TensorSpec("ids", "int64", [-1, -1]),
        TensorSpec("x", "float16", [-1, 2]),
        TensorSpec("flag", "bool", [-1]),
        TensorSpec("text", "object", [-1, 1]),
    ]
    like = {"ids": np.array([[100, 120, 101, 110, 111]])}
    arrays = random_inputs(specs, 5, np.random.default_rng(1), like)
    assert arrays["ids"].shape == (5, 5) and arrays["ids"].min() >= 100 and arrays["ids"].max() <= 120
    assert arrays["x"].dtype == np.float16 and arrays["x"].shape == (5, 2)
    assert arrays["flag"].dtype == bool
    assert arrays["text"].dtype == object and isinstance(arrays["text"][0, 0], bytes)
    again = random_inputs(specs, 5, np.random.default_rng(1), like)
    assert all(np.array_equal(arrays[k], again[k]) for k in ("ids", "x", "flag"))


def test_float_error_beyond_tolerance_fails(tmp_path: Path) -> None:
    path = _model(tmp_path / "model.onnx")
    report = check_parity(_reference(noise=1e-2), path, max_batch_size=4)
    assert not report.passed
    failed = {c.output for c in report.failures}
    assert "y" in failed and "ids_plus" not in failed
    worst = report.worst()["y"]
    assert worst.max_abs == pytest.approx(1e-2, rel=1e-3)
    assert "element(s) outside tolerance" in (worst.detail or "")
    assert "parity failed" in report.summary() and "'y'" in report.summary()


def test_tolerance_is_configurable(tmp_path: Path) -> None:
    path = _model(tmp_path / "model.onnx")
    loose = {"float32": Tolerance(atol=0.05, rtol=0.0)}
    report = check_parity(_reference(noise=1e-2), path, max_batch_size=4, tolerances=loose)
    y = [c for c in report.comparisons if c.output == "y"]
    assert all(c.passed and c.atol == 0.05 for c in y)


def test_integers_must_match_exactly(tmp_path: Path) -> None:
    path = _model(tmp_path / "model.onnx")
    report = check_parity(_reference(idx_offset=1), path, max_batch_size=3)
    assert {c.output for c in report.failures} == {"idx"}
    assert all(c.atol == 0 and c.max_abs == 1.0 for c in report.failures)


def test_shape_dtype_and_missing_outputs(tmp_path: Path) -> None:
    path = _model(tmp_path / "model.onnx")

    def wrong(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        good = _reference()(inputs)
        return {"y": good["y"].astype(np.float64), "idx": good["idx"][:1]}

    report = check_parity(wrong, path, max_batch_size=3, batch_sizes=[3])
    details = {c.output: c.detail for c in report.comparisons}
    assert details["y"] == "dtype float32 from ONNX, float64 from the reference"
    assert details["idx"] == "shape [3] from ONNX, [1] from the reference"
    assert "returned no output 'ids_plus'" in details["ids_plus"]
    saved = json.loads(report.to_json())  # infinite errors become null, the JSON stays strict
    assert saved["passed"] is False and saved["comparisons"][0]["max_abs"] is None


def test_exceptions_become_failures(tmp_path: Path) -> None:
    path = _model(tmp_path / "model.onnx")

    def boom(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise RuntimeError("cuda out of memory")

    report = check_parity(boom, path, max_batch_size=2)
    assert not report.passed
    assert all("the reference raised RuntimeError: cuda out of memory" == c.detail for c in report.comparisons)


def test_nan_on_both_sides_is_equal(tmp_path: Path) -> None:
    path = _model(tmp_path / "model.onnx")
    x = np.full((2, 4), np.nan, np.float32)
    user = [{"x": x, "ids": np.zeros((2, 1), np.int64)}]
    report = check_parity(_reference(), path, max_batch_size=2, user_inputs=user, batch_sizes=[1])
    assert report.passed, report.summary()


def test_static_model_with_max_batch_size_refused(tmp_path: Path) -> None:
    path = _model(tmp_path / "static.onnx", batch=2)
    with pytest.raises(NotBatchableError):
        check_parity(_reference(), path, max_batch_size=4)
    report = check_parity(_reference(), path, max_batch_size=0)  # no batch axis: shapes as declared
    assert report.passed and {c.case for c in report.comparisons} == {"random"}


def test_batch_sizes() -> None:
    assert parity_batch_sizes(8) == [1, 3, 8]
    assert parity_batch_sizes(3) == [1, 3]
    assert parity_batch_sizes(2) == [1, 2]
    assert parity_batch_sizes(1) == [1]
    assert parity_batch_sizes(0) == [0]


def test_rich_table(tmp_path: Path) -> None:
    from rich.console import Console

    path = _model(tmp_path / "model.onnx")
    report = check_parity(_reference(idx_offset=1), path, max_batch_size=3)
    console = Console(record=True, width=200)
    console.print(report.table())
    text = console.export_text()
    assert "random, batch 3" in text and "FAIL" in text and "ok" in text and "atol 0.0001 rtol 0.001" in text
