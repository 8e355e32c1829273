"""ONNX signature inspection on models built with onnx.helper."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from converters import ConversionError, NotBatchableError, OnnxInspectionError, inspect_onnx


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _matmul_model(batch: str | int, opset: int = 17) -> onnx.ModelProto:
    """y = x @ W with W [4, 2]; the batch axis is symbolic (str) or fixed (int)."""
    weight = numpy_helper.from_array(np.arange(8, dtype=np.float32).reshape(4, 2), name="W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 2])],
        initializer=[weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_dynamic_batch(tmp_path: Path) -> None:
    sig = inspect_onnx(_save(_matmul_model("batch", opset=18), tmp_path / "model.onnx"))
    assert [(t.name, t.dtype, t.dims) for t in sig.inputs] == [("x", "float32", [-1, 4])]
    assert [(t.name, t.dtype, t.dims) for t in sig.outputs] == [("y", "float32", [-1, 2])]
    assert sig.inputs[0].dims_without_batch == [4]
    assert sig.opset == 18
    assert sig.batch_dynamic
    assert sig.file_size == (tmp_path / "model.onnx").stat().st_size
    assert sig.external_data == [] and sig.total_size == sig.file_size
    sig.require_batchable()


def test_initializers_listed_as_inputs_are_not_inputs(tmp_path: Path) -> None:
    model = _matmul_model("batch")
    model.graph.input.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, [4, 2]))
    model.ir_version = 3  # old IR: initializers are also graph inputs
    onnx.save(model, str(tmp_path / "old.onnx"))
    assert [t.name for t in inspect_onnx(tmp_path / "old.onnx").inputs] == ["x"]


def test_static_batch_cannot_batch(tmp_path: Path) -> None:
    sig = inspect_onnx(_save(_matmul_model(1), tmp_path / "static.onnx"))
    assert sig.inputs[0].dims == [1, 4]
    assert not sig.batch_dynamic
    with pytest.raises(NotBatchableError) as info:
        sig.require_batchable()
    message = str(info.value)
    assert "static.onnx" in message
    assert "input 'x' has dims [1, 4]" in message and "output 'y'" in message
    assert "dynamic_axes" in message and "dynamic_shapes" in message and "max_batch_size 0" in message
    assert isinstance(info.value, ConversionError)


def test_batch_dynamic_needs_every_output(tmp_path: Path) -> None:
    """Input batch dynamic, one output reduced over the batch: not batchable, and the message says which."""
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["y"]),
            helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3]),
            helper.make_tensor_value_info("total", TensorProto.FLOAT, []),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sig = inspect_onnx(_save(model, tmp_path / "m.onnx"))
    assert sig.inputs[0].batch_dynamic and not sig.batch_dynamic
    with pytest.raises(NotBatchableError, match=r"output 'total' has dims \[\] \(a scalar has no batch axis\)"):
        sig.require_batchable()


def test_string_input_and_int64_output(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Shape", ["text"], ["n"])],
        "strings",
        [helper.make_tensor_value_info("text", TensorProto.STRING, [None, 1])],
        [helper.make_tensor_value_info("n", TensorProto.INT64, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sig = inspect_onnx(_save(model, tmp_path / "s.onnx"))
    assert (sig.inputs[0].dtype, sig.inputs[0].dims) == ("object", [-1, 1])
    assert (sig.outputs[0].dtype, sig.outputs[0].dims) == ("int64", [2])


def test_outputs_without_shape_get_inferred(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["b", 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "m.onnx"))  # the checker itself rejects a shapeless output
    sig = inspect_onnx(tmp_path / "m.onnx")
    assert (sig.outputs[0].dtype, sig.outputs[0].dims) == ("float16", [-1, 5])


def _save_external(tmp_path: Path) -> Path:
    model = _matmul_model("batch")
    path = tmp_path / "ext.onnx"
    onnx.save(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="ext.onnx.data",
        size_threshold=0,
    )
    return path


def test_external_data_listed_not_read(tmp_path: Path) -> None:
    path = _save_external(tmp_path)
    sig = inspect_onnx(path)
    assert sig.external_data == ["ext.onnx.data"]
    assert sig.external_data_size == (tmp_path / "ext.onnx.data").stat().st_size == 32
    assert sig.total_size == sig.file_size + 32
    assert sig.batch_dynamic


def test_missing_external_data(tmp_path: Path) -> None:
    path = _save_external(tmp_path)
    (tmp_path / "ext.onnx.data").unlink()
    with pytest.raises(OnnxInspectionError, match=r"ext\.onnx: external-data file 'ext\.onnx\.data' is missing"):
        inspect_onnx(path)


def test_truncated_external_data(tmp_path: Path) -> None:
    path = _save_external(tmp_path)
    (tmp_path / "ext.onnx.data").write_bytes(b"\0" * 8)
    with pytest.raises(OnnxInspectionError, match="is 8 bytes but the model reads up to byte 32"):
        inspect_onnx(path)


def test_external_data_outside_folder(tmp_path: Path) -> None:
    path = _save_external(tmp_path)
    model = onnx.load(str(path), load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../elsewhere.data"
    onnx.save(model, str(path))
    with pytest.raises(OnnxInspectionError, match="points outside the model's folder"):
        inspect_onnx(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(OnnxInspectionError, match=r"nope\.onnx: ONNX file not found"):
        inspect_onnx(tmp_path / "nope.onnx")


def test_directory_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(OnnxInspectionError, match="not a file"):
        inspect_onnx(tmp_path)


@pytest.mark.parametrize("content", [b"this is not protobuf \xff\xfe", b""])
def test_garbage_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    with pytest.raises(OnnxInspectionError, match=r"bad\.onnx"):
        inspect_onnx(path)


def test_sequence_output_rejected(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("SequenceConstruct", ["x"], ["seq"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 2])],
        [helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, ["b", 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(OnnxInspectionError, match="tensor 'seq' has type 'sequence_type'"):
        inspect_onnx(_save(model, tmp_path / "seq.onnx"))
