"""ONNX -> TensorRT engine (`model.plan`) with the `tensorrt` Python package.

Needs an NVIDIA GPU and `tensorrt` (the `gpu` extra). Without them `build_tensorrt_plan` fails fast
with TensorRTUnavailableError before touching the output path. The alternative that needs no engine
build is `TensorRTMode.ORT_ACCELERATOR`: keep `model.onnx` and let onnxruntime use its TensorRT
execution provider (the renderer writes that config).
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from converters.errors import TensorRTBuildError, TensorRTUnavailableError
from converters.onnx_inspect import OnnxSignature, inspect_onnx

DEFAULT_WORKSPACE_BYTES = 4 << 30
ALTERNATIVE = (
    "serve the ONNX model instead (platform onnxruntime_onnx with the TensorRT execution accelerator, "
    "TensorRTMode.ORT_ACCELERATOR), or build the plan on a machine with an NVIDIA GPU and "
    "`pip install snoozeml[gpu]`"
)


class TensorRTMode(StrEnum):
    """How a model reaches TensorRT."""

    PLAN = "plan"
    """Build a `model.plan` engine here (platform tensorrt_plan); tied to this GPU model and TRT version."""
    ORT_ACCELERATOR = "ort_accelerator"
    """Keep `model.onnx`; onnxruntime builds TensorRT engines at load time (no build step here)."""


@dataclass(frozen=True)
class BatchProfile:
    """Shapes of one optimisation profile per input: (min, opt, max), batch axis included."""

    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


@dataclass(frozen=True)
class PlanResult:
    plan_path: Path
    build_secs: float
    fp16: bool
    profile: BatchProfile
    tensorrt_version: str


def tensorrt_unavailable_reason() -> str | None:
    """Why a TensorRT plan cannot be built here (None when it can): no GPU / driver, no `tensorrt`."""
    missing = []
    gpu = _gpu_problem()
    if gpu:
        missing.append(gpu)
    try:
        import tensorrt  # noqa: F401
    except ImportError as exc:
        missing.append(f"the `tensorrt` Python package is not importable ({exc})")
    return "; ".join(missing) or None


def _gpu_problem() -> str | None:
    """Ask the CUDA driver directly (no torch, no pycuda) whether a GPU is visible."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver (libcuda.so.1 not found)"
    status = cuda.cuInit(0)
    if status != 0:
        return f"the CUDA driver failed to initialise (cuInit error {status}; no GPU visible?)"
    count = ctypes.c_int(0)
    status = cuda.cuDeviceGetCount(ctypes.byref(count))
    if status != 0 or count.value == 0:
        return "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)"
    return None


def batch_profile(signature: OnnxSignature, max_batch_size: int) -> BatchProfile:
    """min 1 / opt max(1, max//2) / max `max_batch_size` on the batch axis; other axes must be fixed.

    `max_batch_size` 0 means the model does not batch: every axis must be fixed and min = opt = max.
    """
    if max_batch_size > 0:
        signature.require_batchable()
    shapes = {}
    for spec in signature.inputs:
        if spec.dtype == "object":
            raise TensorRTBuildError(
                f"{signature.path}: input '{spec.name}' is a string tensor, which TensorRT cannot take; {ALTERNATIVE}"
            )
        rest = spec.dims_without_batch if max_batch_size > 0 else spec.dims
        if -1 in rest:
            raise TensorRTBuildError(
                f"{signature.path}: input '{spec.name}' has dims {spec.dims} with a dynamic axis besides the "
                "batch axis; this builder only makes a batch-axis profile. Re-export with fixed non-batch "
                f"axes, or {ALTERNATIVE}"
            )
        if max_batch_size > 0:
            lo, opt, hi = 1, max(1, max_batch_size // 2), max_batch_size
            shapes[spec.name] = ((lo, *rest), (opt, *rest), (hi, *rest))
        else:
            shapes[spec.name] = (tuple(rest),) * 3
    return BatchProfile(shapes=shapes)


def build_tensorrt_plan(
    onnx_path: str | os.PathLike[str],
    plan_path: str | os.PathLike[str],
    *,
    max_batch_size: int,
    fp16: bool = False,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    progress: Callable[[str], None] | None = None,
) -> PlanResult:
    """Build a serialized TensorRT engine from `onnx_path` into `plan_path`.

    The engine is written to a temporary file in the same folder and renamed only on success: a failed
    build leaves no file at `plan_path` (and an existing plan there untouched).
    """
    notify = progress or (lambda _stage: None)
    onnx_path, plan_path = Path(onnx_path), Path(plan_path)
    reason = tensorrt_unavailable_reason()
    if reason:
        raise TensorRTUnavailableError(f"cannot build {plan_path} from {onnx_path}: {reason}. Instead: {ALTERNATIVE}")
    import tensorrt as trt

    profile_shapes = batch_profile(inspect_onnx(onnx_path), max_batch_size)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH"):  # required before TensorRT 10
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    notify("parsing the ONNX model (TensorRT)")
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TensorRTBuildError(f"{onnx_path}: TensorRT cannot parse the model: {errors}. Or: {ALTERNATIVE}")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    if max_batch_size > 0:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in profile_shapes.shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)

    notify(f"building the TensorRT engine ({'fp16' if fp16 else 'fp32'}, max batch {max_batch_size})")
    started = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise TensorRTBuildError(f"{onnx_path}: TensorRT failed to build an engine (see the TensorRT log above)")
    build_secs = time.perf_counter() - started

    plan_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=plan_path.parent, prefix=f".{plan_path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(memoryview(serialized))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, plan_path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return PlanResult(
        plan_path=plan_path,
        build_secs=build_secs,
        fp16=fp16,
        profile=profile_shapes,
        tensorrt_version=trt.__version__,
    )
