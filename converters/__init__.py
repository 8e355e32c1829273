"""Model conversion: ONNX inspection, torch -> ONNX export, parity checks, ONNX -> TensorRT.

This package knows nothing about Triton or HTTP; torch and tensorrt are imported lazily.
"""

from converters.errors import (
    ConversionError,
    ExportError,
    NotBatchableError,
    OnnxInspectionError,
    ParityError,
    TensorRTBuildError,
    TensorRTUnavailableError,
)
from converters.onnx_inspect import OnnxSignature, TensorSpec, inspect_onnx
from converters.signature import PackageSignature, TensorDecl

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
