"""Model conversion: ONNX inspection, torch -> ONNX export, parity checks, ONNX -> TensorRT.

This package knows nothing about Triton or HTTP; torch and tensorrt are imported lazily, and onnx only
when a name that needs it is used (``converters.samples`` stays numpy-only for the control plane).
"""

from __future__ import annotations

import importlib
from typing import Any

from converters.errors import (
    ConversionError,
    ExportError,
    NotBatchableError,
    OnnxInspectionError,
    ParityError,
    TensorRTBuildError,
    TensorRTUnavailableError,
)

_LAZY = {
    "OnnxSignature": "converters.onnx_inspect",
    "TensorSpec": "converters.onnx_inspect",
    "inspect_onnx": "converters.onnx_inspect",
    "PackageSignature": "converters.signature",
    "TensorDecl": "converters.signature",
}

__all__ = [
    "ConversionError",
    "ExportError",
    "NotBatchableError",
    "OnnxInspectionError",
    "OnnxSignature",
    "PackageSignature",
    "ParityError",
    "TensorRTBuildError",
    "TensorRTUnavailableError",
    "TensorDecl",
    "TensorSpec",
    "inspect_onnx",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'converters' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
