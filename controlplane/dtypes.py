"""One table for the three spellings of a tensor data type.

Users write KServe v2 wire names (``FP32``) or numpy names (``float32``); Triton's config wants
``TYPE_FP32``; the runtime and ONNX inspection speak numpy.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataType:
    wire: str  # KServe v2 name, as on the wire
    numpy: str  # numpy dtype name ("object" for BYTES)
    triton: str  # model_config.proto DataType enum name


_TABLE = (
    DataType("BOOL", "bool", "TYPE_BOOL"),
    DataType("UINT8", "uint8", "TYPE_UINT8"),
    DataType("UINT16", "uint16", "TYPE_UINT16"),
    DataType("UINT32", "uint32", "TYPE_UINT32"),
    DataType("UINT64", "uint64", "TYPE_UINT64"),
    DataType("INT8", "int8", "TYPE_INT8"),
    DataType("INT16", "int16", "TYPE_INT16"),
    DataType("INT32", "int32", "TYPE_INT32"),
    DataType("INT64", "int64", "TYPE_INT64"),
    DataType("FP16", "float16", "TYPE_FP16"),
    DataType("FP32", "float32", "TYPE_FP32"),
    DataType("FP64", "float64", "TYPE_FP64"),
    DataType("BF16", "bfloat16", "TYPE_BF16"),
    DataType("BYTES", "object", "TYPE_STRING"),
)

_BY_NAME: dict[str, DataType] = {}
for _dt in _TABLE:
    for _name in (_dt.wire, _dt.numpy, _dt.triton, _dt.triton.removeprefix("TYPE_")):
        _BY_NAME[_name.lower()] = _dt
for _alias, _wire in {
    "bytes": "BYTES",
    "str": "BYTES",
    "string": "BYTES",
    "bytes_": "BYTES",
    "object_": "BYTES",
    "half": "FP16",
    "float": "FP32",
    "double": "FP64",
    "long": "INT64",
    "int": "INT64",
}.items():
    _BY_NAME[_alias] = _BY_NAME[_wire.lower()]

WIRE_NAMES = tuple(dt.wire for dt in _TABLE)


def parse_dtype(name: str) -> DataType:
    """Resolve any accepted spelling; raise ValueError naming the accepted ones."""
    key = str(name).strip().lower()
    if key in _BY_NAME:
        return _BY_NAME[key]
    raise ValueError(
        f"unknown data type {name!r}: use a KServe v2 name ({', '.join(WIRE_NAMES)}) "
        "or a numpy name (float32, int64, object, ...)"
    )


def from_triton(enum_name: str) -> DataType:
    return parse_dtype(enum_name)
