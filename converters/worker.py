"""Run one conversion in this (child) process: `python -m converters.worker REQUEST.json RESULT.json`.

Callers that must not run user code or import torch (the control plane, the CLI) start this module in
a child process. The request is a JSON object with an `op`:

* `"torch_to_onnx"`: `package_dir`, `out_dir`, `signature` (`{"inputs"|"outputs": [{"name", "dtype",
  "dims"}]}`, numpy dtype names, dims without the batch axis or null), `max_batch_size`, and optional
  `opset`, `tolerances` (`{dtype: [atol, rtol]}`), `user_inputs` (a list of `{input name: path.npy}`),
  `entrypoint`, `class_name`, `params`, `seed`.
* `"onnx_to_trt"`: `onnx_path`, `plan_path`, `max_batch_size`, optional `fp16`.

Progress goes to stderr, one line per stage, as `progress: <stage>`; anything the user's code prints
goes to stderr too (stdout is pointed at stderr), so the parent reads one stream. The result file is
always written when the request could be read: `{"ok": true, ...}` or `{"ok": false, "error_type",
"stage", "message", "parity"}`. Exit status: 0 ok, 1 conversion failed (result written), 2 bad usage.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

PROGRESS_PREFIX = "progress: "
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _progress(stage: str) -> None:
    sys.stderr.write(f"{PROGRESS_PREFIX}{stage}\n")
    sys.stderr.flush()


def _signature(raw: dict[str, Any]) -> Any:
    from converters.signature import PackageSignature, TensorDecl

    def decls(items: list[dict[str, Any]]) -> list[TensorDecl]:
        return [TensorDecl(t["name"], t["dtype"], t.get("dims")) for t in items]

    return PackageSignature(inputs=decls(raw.get("inputs", [])), outputs=decls(raw.get("outputs", [])))


def _load_user_inputs(items: list[dict[str, str]]) -> list[dict[str, Any]]:
    import numpy as np

    batches = []
    for index, batch in enumerate(items):
        arrays = {}
        for name, path in batch.items():
            try:
                arrays[name] = np.load(path, allow_pickle=False)
            except Exception as exc:
                raise ValueError(f"user input {index} '{name}': cannot read {path} as a .npy array ({exc})") from exc
        batches.append(arrays)
    return batches


def torch_to_onnx(request: dict[str, Any]) -> dict[str, Any]:
    from converters.parity import Tolerance
    from converters.pipeline import convert_package_to_onnx
    from converters.torch_export import DEFAULT_OPSET

    if importlib.util.find_spec("torch") is None:
        return {
            "ok": False,
            "error_type": "TorchUnavailable",
            "stage": "setup",
            "message": f"torch is not installed in {sys.executable}'s environment",
            "parity": None,
        }
    tolerances = {dtype: Tolerance(float(a), float(r)) for dtype, (a, r) in (request.get("tolerances") or {}).items()}
    result = convert_package_to_onnx(
        request["package_dir"],
        request["out_dir"],
        _signature(request["signature"]),
        max_batch_size=int(request["max_batch_size"]),
        opset=int(request.get("opset") or DEFAULT_OPSET),
        tolerances=tolerances,
        user_inputs=_load_user_inputs(request.get("user_inputs") or []),
        entrypoint=request.get("entrypoint", "snooze_model.py"),
        class_name=request.get("class_name", "Model"),
        params=request.get("params") or {},
        seed=int(request.get("seed", 0)),
        progress=_progress,
    )
    return {
        "ok": True,
        "onnx_path": str(result.onnx_path),
        "exporter": result.exporter.value,
        "export_secs": result.export_secs,
        "dynamo_error": result.dynamo_error,
        "parity": json.loads(result.parity_report.to_json()),
    }


def onnx_to_trt(request: dict[str, Any]) -> dict[str, Any]:
    from converters.tensorrt_build import build_tensorrt_plan

    result = build_tensorrt_plan(
        request["onnx_path"],
        request["plan_path"],
        max_batch_size=int(request["max_batch_size"]),
        fp16=bool(request.get("fp16", False)),
        progress=_progress,
    )
    return {
        "ok": True,
        "plan_path": str(result.plan_path),
        "build_secs": result.build_secs,
        "fp16": result.fp16,
        "tensorrt_version": result.tensorrt_version,
        "profile": {name: [list(s) for s in shapes] for name, shapes in result.profile.shapes.items()},
    }


OPS = {"torch_to_onnx": torch_to_onnx, "onnx_to_trt": onnx_to_trt}


def _failure(exc: BaseException) -> dict[str, Any]:
    from converters.errors import ExportError, ParityError

    report = getattr(exc, "report", None)
    stage = "parity" if isinstance(exc, ParityError) else "export" if isinstance(exc, ExportError) else "convert"
    return {
        "ok": False,
        "error_type": type(exc).__name__,
        "stage": stage,
        "message": str(exc),
        "parity": json.loads(report.to_json()) if report is not None and hasattr(report, "to_json") else None,
    }


def run(request_path: Path, result_path: Path) -> int:
    try:
        request = json.loads(request_path.read_text(encoding="utf-8"))
        op = OPS[request["op"]]
    except Exception as exc:
        sys.stderr.write(f"converters.worker: bad request {request_path}: {exc!r}\n")
        return EXIT_USAGE
    from converters.errors import ConversionError

    try:
        result = op(request)
    except ConversionError as exc:
        result = _failure(exc)
    except Exception as exc:  # a bug or an unexpected error in user code: report it, with the traceback
        traceback.print_exc()
        result = {**_failure(exc), "message": f"unexpected {type(exc).__name__}: {exc}"}
    result["op"] = request["op"]
    tmp = result_path.with_name(result_path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, allow_nan=False, default=str), encoding="utf-8")
    os.replace(tmp, result_path)
    return EXIT_OK if result.get("ok") else EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.stderr.write("usage: python -m converters.worker REQUEST.json RESULT.json\n")
        return EXIT_USAGE
    # Whatever user code prints must not mix with anything a parent parses on stdout: send it to stderr.
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return run(Path(args[0]), Path(args[1]))


if __name__ == "__main__":
    sys.exit(main())
