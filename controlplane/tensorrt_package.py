"""ONNX -> TensorRT for ``snoozectl convert onnx-to-trt``: a plan built in the conversion worker, and the
manifest a TensorRT package needs (its signature, read from the ONNX file)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.conversion_worker import DEFAULT_TIMEOUT_SECS, ConversionFailed, Progress, run_worker
from controlplane.dtypes import parse_dtype
from controlplane.spec import MANIFEST_FILE, PackageKind
from converters.files import PLAN_FILE


@dataclass(frozen=True)
class PlanPackage:
    path: Path
    plan_path: Path
    build_secs: float
    fp16: bool
    tensorrt_version: str


def tensorrt_unavailable_reason() -> str | None:
    """Why no TensorRT plan can be built here (no GPU/driver, no `tensorrt`); None when it can."""
    from converters.tensorrt_build import tensorrt_unavailable_reason as reason

    return reason()


def build_tensorrt_package(
    onnx_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    max_batch_size: int,
    fp16: bool = False,
    progress: Progress | None = None,
    timeout: float = DEFAULT_TIMEOUT_SECS,
) -> PlanPackage:
    """Build `<out_dir>/model.plan` from an ONNX file (in the worker) plus a manifest with the signature
    (TensorRT packages must declare it). Fails fast, before creating anything, without a GPU or
    TensorRT; a failed build leaves no file behind (and removes `out_dir` if it created it)."""
    from converters.errors import ConversionError
    from converters.onnx_inspect import inspect_onnx
    from converters.tensorrt_build import ALTERNATIVE

    onnx_path, out_dir = Path(onnx_path).resolve(), Path(out_dir).resolve()
    try:
        sig = inspect_onnx(onnx_path)
        if max_batch_size > 0:
            sig.require_batchable()
    except ConversionError as exc:
        raise ConversionFailed(str(exc)) from exc
    reason = tensorrt_unavailable_reason()
    if reason:
        raise ConversionFailed(
            f"cannot build a TensorRT plan from {onnx_path} on this machine: {reason}",
            hint="publish the ONNX model with deployment setting onnx_tensorrt = true: on the full target "
            "(official Triton image, GPU) it is served by onnxruntime with the TensorRT execution accelerator, "
            "no engine build needed. Or build the plan on a machine with an NVIDIA GPU after "
            "`pip install 'snoozeml[gpu]'`",
        )
    plan = out_dir / PLAN_FILE
    if plan.exists() or (out_dir / MANIFEST_FILE).exists():
        raise ConversionFailed(f"{out_dir} already holds {PLAN_FILE} or {MANIFEST_FILE}", hint="choose a new folder")
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        result = run_worker(
            {
                "op": "onnx_to_trt",
                "onnx_path": str(onnx_path),
                "plan_path": str(plan),
                "max_batch_size": max_batch_size,
                "fp16": fp16,
            },
            progress=progress,
            timeout=timeout,
        )
        if not result.get("ok"):
            raise ConversionFailed(result.get("message", "TensorRT build failed"), hint=ALTERNATIVE)
        batch = max_batch_size > 0

        def specs(tensors: Any) -> list[dict[str, Any]]:
            return [
                {
                    "name": t.name,
                    "datatype": parse_dtype(t.dtype).wire,
                    "dims": t.dims_without_batch if batch else t.dims,
                }
                for t in tensors
            ]

        manifest = {
            "inputs": specs(sig.inputs),
            "outputs": specs(sig.outputs),
            "metadata": {
                "converted_from": {
                    "kind": PackageKind.ONNX,
                    "file": str(onnx_path),
                    "fp16": fp16,
                    "max_batch_size": max_batch_size,
                    "tensorrt": result.get("tensorrt_version"),
                }
            },
        }
        (out_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    except BaseException:
        plan.unlink(missing_ok=True)
        (out_dir / MANIFEST_FILE).unlink(missing_ok=True)
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return PlanPackage(out_dir, plan, float(result["build_secs"]), fp16, str(result.get("tensorrt_version")))
