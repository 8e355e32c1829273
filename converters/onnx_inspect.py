"""Describe an ONNX model's I/O signature without reading its weights.

`inspect_onnx(path)` loads the graph with `load_external_data=False`, so a model with gigabytes of
external weights is inspected in milliseconds; the external-data files it references are checked
for existence and size instead of being read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import TensorProto

from converters.errors import NotBatchableError, OnnxInspectionError

# ONNX element type -> numpy dtype name (strings are numpy `object`, as Triton's BYTES).
_ONNX_TO_NUMPY: dict[int, str] = {
    TensorProto.FLOAT: "float32",
    TensorProto.FLOAT16: "float16",
    TensorProto.DOUBLE: "float64",
    TensorProto.BFLOAT16: "bfloat16",
    TensorProto.INT8: "int8",
    TensorProto.INT16: "int16",
    TensorProto.INT32: "int32",
    TensorProto.INT64: "int64",
    TensorProto.UINT8: "uint8",
    TensorProto.UINT16: "uint16",
    TensorProto.UINT32: "uint32",
    TensorProto.UINT64: "uint64",
    TensorProto.BOOL: "bool",
    TensorProto.STRING: "object",
}

_BATCH_FIX = (
    "re-export with a dynamic batch axis (legacy exporter: torch.onnx.export(..., dynamic_axes="
    "{name: {0: 'batch'}} for every input and output); dynamo exporter: dynamic_shapes={name: "
    "{0: torch.export.Dim('batch')}}), or publish the model with max_batch_size 0 (no batching)"
)


@dataclass(frozen=True)
class TensorSpec:
    """One input or output. `dims` is the full shape, batch axis included; -1 marks a dynamic axis
    (symbolic `dim_param` or no value)."""

    name: str
    dtype: str
    dims: list[int]

    @property
    def batch_dynamic(self) -> bool:
        return len(self.dims) > 0 and self.dims[0] == -1

    @property
    def dims_without_batch(self) -> list[int]:
        """The shape as a batching Triton config writes it (first axis dropped)."""
        return self.dims[1:]


@dataclass(frozen=True)
class OnnxSignature:
    path: Path
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    opset: int
    """Opset of the default (`ai.onnx`) domain."""
    ir_version: int
    file_size: int
    """Size in bytes of the .onnx file itself."""
    external_data: list[str] = field(default_factory=list)
    """External-data files the model references, relative to its folder, in first-use order."""
    external_data_size: int = 0
    """Total size in bytes of those files."""

    @property
    def batch_dynamic(self) -> bool:
        """True when the first axis is dynamic on every input and every output."""
        return all(t.batch_dynamic for t in (*self.inputs, *self.outputs))

    @property
    def total_size(self) -> int:
        return self.file_size + self.external_data_size

    def require_batchable(self) -> None:
        """Raise NotBatchableError naming each tensor whose first axis is not dynamic."""
        problems = [
            f"{kind} '{t.name}' has dims {t.dims} ({_describe_first_axis(t)})"
            for kind, tensors in (("input", self.inputs), ("output", self.outputs))
            for t in tensors
            if not t.batch_dynamic
        ]
        if problems:
            raise NotBatchableError(
                f"{self.path}: cannot serve with max_batch_size > 0 because the first (batch) axis must "
                f"be dynamic on every input and output: {'; '.join(problems)}. Fix: {_BATCH_FIX}."
            )


def _describe_first_axis(tensor: TensorSpec) -> str:
    if not tensor.dims:
        return "a scalar has no batch axis"
    return f"first axis is fixed at {tensor.dims[0]}"


def inspect_onnx(path: str | os.PathLike[str]) -> OnnxSignature:
    """Read an ONNX model's signature. Raises OnnxInspectionError naming the file on any problem."""
    path = Path(path)
    if not path.exists():
        raise OnnxInspectionError(f"{path}: ONNX file not found")
    if not path.is_file():
        raise OnnxInspectionError(f"{path}: not a file (expected an .onnx model file)")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf DecodeError, OSError, ...: the library's types vary by version
        raise OnnxInspectionError(
            f"{path}: cannot be read as an ONNX model ({type(exc).__name__}: {exc}); "
            "check that the file is a complete ONNX protobuf (not truncated, not a TorchScript file)"
        ) from exc
    if not model.graph.output:
        raise OnnxInspectionError(f"{path}: the graph has no outputs; it is empty or not an ONNX model")

    external, external_size = _check_external_data(model, path)
    if _any_unknown_rank(model):
        model = _infer_shapes(model, path)

    initializer_names = {init.name for init in model.graph.initializer}
    inputs = [_tensor_spec(v, path) for v in model.graph.input if v.name not in initializer_names]
    outputs = [_tensor_spec(v, path) for v in model.graph.output]
    return OnnxSignature(
        path=path,
        inputs=inputs,
        outputs=outputs,
        opset=_default_opset(model, path),
        ir_version=model.ir_version,
        file_size=path.stat().st_size,
        external_data=external,
        external_data_size=external_size,
    )


def _default_opset(model: onnx.ModelProto, path: Path) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    raise OnnxInspectionError(f"{path}: no opset_import for the default ONNX domain")


def _tensor_spec(value: onnx.ValueInfoProto, path: Path) -> TensorSpec:
    kind = value.type.WhichOneof("value")
    if kind != "tensor_type":
        raise OnnxInspectionError(
            f"{path}: tensor '{value.name}' has type '{kind}'; only plain tensors can be served "
            "(sequences, maps and optionals are not)"
        )
    tensor_type = value.type.tensor_type
    dtype = _ONNX_TO_NUMPY.get(tensor_type.elem_type)
    if dtype is None:
        type_name = TensorProto.DataType.Name(tensor_type.elem_type)
        raise OnnxInspectionError(
            f"{path}: tensor '{value.name}' has element type {type_name}, which has no serving "
            f"equivalent; supported: {sorted(set(_ONNX_TO_NUMPY.values()))}"
        )
    if not tensor_type.HasField("shape"):
        raise OnnxInspectionError(
            f"{path}: tensor '{value.name}' has no shape (unknown rank) even after shape inference; "
            "re-export the model with static ranks on its inputs and outputs"
        )
    # 0 (how some exporters write an unknown size), '?', a symbol or an expression ('batch*2'): variable.
    dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in tensor_type.shape.dim]
    return TensorSpec(name=value.name, dtype=dtype, dims=dims)


def _any_unknown_rank(model: onnx.ModelProto) -> bool:
    return any(
        v.type.WhichOneof("value") == "tensor_type" and not v.type.tensor_type.HasField("shape")
        for v in model.graph.output
    )


def _infer_shapes(model: onnx.ModelProto, path: Path) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception as exc:  # InferenceError and friends
        raise OnnxInspectionError(f"{path}: some outputs have no shape and shape inference failed ({exc})") from exc


def _all_tensors(graph: onnx.GraphProto) -> Iterator[TensorProto]:
    """Every TensorProto that may hold weights: initializers and node attributes, subgraphs included."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _all_tensors(attr.g)
            for sub in attr.graphs:
                yield from _all_tensors(sub)


def _check_external_data(model: onnx.ModelProto, path: Path) -> tuple[list[str], int]:
    """List the external-data files, check they exist inside the model's folder and are long enough."""
    base = path.parent.resolve()
    needed: dict[str, int] = {}  # location -> bytes needed (max offset + length)
    for tensor in _all_tensors(model.graph):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location")
        if not location:
            raise OnnxInspectionError(f"{path}: tensor '{tensor.name}' is marked as external-data but names no file")
        end = int(info.get("offset", 0)) + int(info.get("length", 0))
        needed[location] = max(needed.get(location, 0), end)

    total = 0
    for location, end in needed.items():
        target = (base / location).resolve()
        if Path(location).is_absolute() or not target.is_relative_to(base):
            raise OnnxInspectionError(
                f"{path}: external-data location '{location}' points outside the model's folder; "
                "external data must sit next to the .onnx file"
            )
        if not target.is_file():
            raise OnnxInspectionError(
                f"{path}: external-data file '{location}' is missing (expected at {target}); copy it "
                "next to the .onnx file or re-save the model with its weights inlined"
            )
        size = target.stat().st_size
        if size < end:
            raise OnnxInspectionError(
                f"{path}: external-data file '{location}' is {size} bytes but the model reads up to "
                f"byte {end}; the file is truncated or belongs to another export"
            )
        total += size
    return list(needed), total
