"""ONNX -> TensorRT: fail-fast without GPU/tensorrt, profile shapes; the real build only on a GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from converters import ConversionError, NotBatchableError, TensorRTUnavailableError, inspect_onnx
from converters.errors import TensorRTBuildError
from converters.tensorrt_build import (
    TensorRTMode,
    batch_profile,
    build_tensorrt_plan,
    tensorrt_unavailable_reason,
)

UNAVAILABLE = tensorrt_unavailable_reason()


def _model(path: Path, x_dims: list, dtype: int = TensorProto.FLOAT) -> Path:
    weight = numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")
    nodes = (
        [helper.make_node("MatMul", ["x", "W"], ["y"])]
        if dtype == TensorProto.FLOAT
        else [helper.make_node("Identity", ["x"], ["y"])]
    )
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", dtype, x_dims)],
        [helper.make_tensor_value_info("y", dtype, x_dims)],
        initializer=[weight] if dtype == TensorProto.FLOAT else [],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_profile_shapes(tmp_path: Path) -> None:
    sig = inspect_onnx(_model(tmp_path / "m.onnx", ["batch", 4]))
    assert batch_profile(sig, 16).shapes == {"x": ((1, 4), (8, 4), (16, 4))}
    assert batch_profile(sig, 1).shapes == {"x": ((1, 4), (1, 4), (1, 4))}


def test_profile_without_batching(tmp_path: Path) -> None:
    sig = inspect_onnx(_model(tmp_path / "m.onnx", [2, 4]))
    assert batch_profile(sig, 0).shapes == {"x": ((2, 4), (2, 4), (2, 4))}
    with pytest.raises(NotBatchableError):
        batch_profile(sig, 8)


def test_profile_refuses_other_dynamic_axes(tmp_path: Path) -> None:
    sig = inspect_onnx(_model(tmp_path / "m.onnx", ["batch", "seq"]))
    with pytest.raises(TensorRTBuildError, match="input 'x' has dims \\[-1, -1\\].*onnxruntime_onnx"):
        batch_profile(sig, 8)


def test_profile_refuses_strings(tmp_path: Path) -> None:
    sig = inspect_onnx(_model(tmp_path / "m.onnx", ["batch", 1], TensorProto.STRING))
    with pytest.raises(TensorRTBuildError, match="'x' is a string tensor"):
        batch_profile(sig, 8)


def test_modes() -> None:
    assert {m.value for m in TensorRTMode} == {"plan", "ort_accelerator"}


@pytest.mark.skipif(UNAVAILABLE is None, reason="TensorRT is available here: the fail-fast path is not taken")
def test_fails_fast_without_gpu_or_tensorrt(tmp_path: Path) -> None:
    onnx_path = _model(tmp_path / "model.onnx", ["batch", 4])
    plan = tmp_path / "out" / "model.plan"
    with pytest.raises(TensorRTUnavailableError) as info:
        build_tensorrt_plan(onnx_path, plan, max_batch_size=8)
    message = str(info.value)
    assert str(plan) in message and UNAVAILABLE in message
    assert "onnxruntime_onnx" in message and "TensorRT execution accelerator" in message
    assert isinstance(info.value, ConversionError)
    assert not plan.exists() and not plan.parent.exists()


@pytest.mark.gpu
@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no TensorRT build here: {UNAVAILABLE}")
@pytest.mark.parametrize("fp16", [False, True])
def test_build_plan_on_gpu(tmp_path: Path, fp16: bool) -> None:
    import tensorrt as trt

    onnx_path = _model(tmp_path / "model.onnx", ["batch", 4])
    plan = tmp_path / "model.plan"
    result = build_tensorrt_plan(onnx_path, plan, max_batch_size=8, fp16=fp16)
    assert result.plan_path == plan and plan.stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan.read_bytes())
    assert engine.get_tensor_profile_shape("x", 0) == [(1, 4), (4, 4), (8, 4)]


@pytest.mark.gpu
@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no TensorRT build here: {UNAVAILABLE}")
def test_failed_build_leaves_no_file(tmp_path: Path) -> None:
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"not onnx")
    plan = tmp_path / "model.plan"
    with pytest.raises(ConversionError):
        build_tensorrt_plan(bad, plan, max_batch_size=8)
    assert list(tmp_path.iterdir()) == [bad]
