"""Package -> ONNX in one call: load the package, export, check parity, save the report.

This runs the package's own code (its `Model` and export hook) in the calling process: a caller that
must not run user code (the control plane) runs it in a child process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from converters.errors import ParityError
from converters.files import ONNX_FILE
from converters.parity import ParityReport, Tolerance, check_parity
from converters.signature import PackageSignature
from converters.torch_export import (
    DEFAULT_OPSET,
    Exporter,
    TorchRunner,
    export_module_to_onnx,
    load_export_hook,
)

PARITY_FILE = "parity.json"


@dataclass(frozen=True)
class ConversionResult:
    onnx_path: Path
    exporter: Exporter
    export_secs: float
    parity_report: ParityReport
    dynamo_error: str | None
    """Why the dynamo exporter failed, when the TorchScript one was used."""


def convert_package_to_onnx(
    package_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    signature: PackageSignature,
    *,
    max_batch_size: int,
    opset: int = DEFAULT_OPSET,
    tolerances: Mapping[str, Tolerance] | None = None,
    user_inputs: Sequence[Mapping[str, np.ndarray]] = (),
    entrypoint: str = "snooze_model.py",
    class_name: str = "Model",
    params: Mapping[str, Any] | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> ConversionResult:
    """Export a package's torch module to `<out_dir>/model.onnx` and check it against the package.

    The parity reference is the package's own `predict` when it has a model class (that is what would
    be served otherwise), else the torch module. The report is saved as `<out_dir>/parity.json` in
    both outcomes. Raises ExportError (no ONNX file written) or ParityError (the file and the report
    stay for diagnosis; `.report` holds the report); both are ConversionError.
    """
    notify = progress or (lambda _stage: None)
    out_dir = Path(out_dir)
    notify("loading the package")
    hook = load_export_hook(package_dir, entrypoint=entrypoint, class_name=class_name, params=params)
    exported = export_module_to_onnx(
        hook.module,
        hook.example_inputs,
        out_dir / ONNX_FILE,
        signature.output_names,
        expected=signature,
        opset=opset,
        progress=notify,
    )
    if hook.model is not None and callable(getattr(hook.model, "predict", None)):
        reference, reference_name = hook.model.predict, f"{class_name}.predict"
    else:
        names = [t.name for t in exported.signature.inputs]
        reference, reference_name = TorchRunner(hook.module, names, signature.output_names), "torch module"
    notify(f"checking parity with {reference_name}")
    report = check_parity(
        reference,
        exported.onnx_path,
        max_batch_size=max_batch_size,
        reference_name=reference_name,
        example_inputs=hook.example_inputs,
        user_inputs=user_inputs,
        tolerances=tolerances,
        seed=seed,
        report_path=out_dir / PARITY_FILE,
    )
    if not report.passed:
        raise ParityError(f"{exported.onnx_path}: {report.summary()} (report: {out_dir / PARITY_FILE})", report)
    notify("done")
    return ConversionResult(
        onnx_path=exported.onnx_path,
        exporter=exported.exporter,
        export_secs=exported.export_secs,
        parity_report=report,
        dynamo_error=exported.dynamo_error,
    )
