"""Errors raised by the converters. Every message names the file or tensor concerned and the fix."""

from __future__ import annotations


class ConversionError(Exception):
    """Root of every converters error: catch this to fall back to serving the custom package."""


class OnnxInspectionError(ConversionError):
    """An ONNX file cannot be read or described (missing, corrupt, missing external data, odd types)."""


class NotBatchableError(ConversionError):
    """The model lacks a dynamic first (batch) axis on some input or output."""


class ExportError(ConversionError):
    """torch -> ONNX export failed, or its result does not match the package signature."""


class ParityError(ConversionError):
    """The exported model's answers differ from the original's beyond tolerance."""

    def __init__(self, message: str, report: object) -> None:
        super().__init__(message)
        self.report = report


class TensorRTUnavailableError(ConversionError):
    """No GPU or no `tensorrt` package: a TensorRT engine cannot be built on this machine."""


class TensorRTBuildError(ConversionError):
    """TensorRT could not parse the ONNX model or build the engine."""
