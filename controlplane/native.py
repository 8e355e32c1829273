"""Prefer native backends: turn a custom torch package into an ONNX package when that is safe.

`prefer_native(package_dir, ...)` decides what to publish. ONNX and TensorRT packages are native
already. A custom package whose `snooze_model.py` offers the `export_module` hook (see
`converters/torch_export.py`) is exported and checked for parity **in a child process**
(`python -m converters.worker`): the control plane and the CLI never import user code or torch.
If export and parity pass, a new ONNX package is assembled in `out_dir`:

```
<out_dir>/model.onnx            (+ model.onnx.data when the weights reach 2 GiB)
<out_dir>/parity.json           the parity report
<out_dir>/snooze_model.json     timeouts, metadata (with `converted_from`), the signature only when the
                                package declared dims the ONNX file leaves variable
<out_dir>/provenance/...        the original custom package, as it was (never imported)
```

Otherwise the custom package itself is the one to publish, and `NativeDecision.reason` says why
(no hook, torch missing, which exporter failed and why, worst parity error vs tolerance).

A publish command needs only:

```python
with native_package(path, max_batch_size=8, params=overrides, progress=print) as decision:
    print(decision.reason)
    publish(decision.publish_path, params=decision.publish_params(overrides))
```
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from controlplane.conversion_worker import DEFAULT_TIMEOUT_SECS, ConversionFailed, Progress, run_worker
from controlplane.dtypes import parse_dtype
from controlplane.errors import InvalidPackageError, SnoozeError
from controlplane.modes import TensorFormat
from controlplane.source_inspect import export_hook
from controlplane.spec import (
    MANIFEST_FILE,
    ModelPackage,
    PackageKind,
    TensorSpec,
    load_package,
    package_kind,
    validate_params,
)
from converters.files import ONNX_FILE

PARITY_FILE = "parity.json"
PROVENANCE_DIR = "provenance"
REJECTED_DIR = "rejected"
DEFAULT_OPSET = 18  # converters.torch_export.DEFAULT_OPSET, without importing it here
FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class NativeDecision:
    """What to publish, and why."""

    publish_path: Path
    """The package folder to publish: the new ONNX package, or the original package."""
    native: bool
    """True when `publish_path` is served by a native backend (ONNX / TensorRT)."""
    reason: str
    """One line for the user: what was done, or why the custom package is published instead."""
    report: dict[str, Any] | None
    """The parity report (as in parity.json) when parity was checked."""
    export_secs: float | None
    converted: bool = False
    """True when `publish_path` is a package built here from a custom one."""
    exporter: str | None = None
    stage: str | None = None
    """Where a fallback happened: package, hook, torch, export, parity, worker."""
    hint: str | None = None
    """How to make the export succeed, on a fallback."""
    artifacts: Path | None = None
    """On a parity failure: the rejected model.onnx and its parity.json, for diagnosis."""

    def publish_params(self, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
        """Params to send with the publish: a converted package has the custom params baked into the
        exported graph (and an ONNX package's params are onnxruntime session options), so none."""
        return {} if self.converted else dict(overrides or {})

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["publish_path"] = str(self.publish_path)
        body["artifacts"] = str(self.artifacts) if self.artifacts else None
        return body


# ---------------------------------------------------------------------------------------------
# Cheap checks that need no user code


def find_export_hook(package_dir: Path, entrypoint: str = "snooze_model.py", class_name: str = "Model") -> str | None:
    """Where the package defines its export hook (`Model.export_module` or a module-level
    `export_module`), found by parsing the entry file: nothing is imported. None when there is none."""
    path = Path(package_dir) / entrypoint
    return export_hook(path.read_text(encoding="utf-8"), class_name, filename=str(path))


def torch_available() -> bool:
    """Whether the worker's interpreter (this one) can import torch; torch is not imported."""
    return importlib.util.find_spec("torch") is not None


def tolerances_from(atol: float | None, rtol: float | None) -> dict[str, tuple[float, float]]:
    """Per-dtype tolerances from one --atol/--rtol pair: each given value replaces the default of every
    floating dtype; integer, bool and string outputs always compare exactly."""
    if atol is None and rtol is None:
        return {}
    from converters.parity import DEFAULT_TOLERANCES  # numpy + onnx only, no torch

    return {
        dtype: (atol if atol is not None else tol.atol, rtol if rtol is not None else tol.rtol)
        for dtype, tol in DEFAULT_TOLERANCES.items()
    }


def _signature_request(package: ModelPackage) -> dict[str, Any]:
    def decls(tensors: list[TensorSpec]) -> list[dict[str, Any]]:
        return [{"name": t.name, "dtype": parse_dtype(t.datatype).numpy, "dims": list(t.dims)} for t in tensors]

    return {"inputs": decls(package.inputs), "outputs": decls(package.outputs)}


# ---------------------------------------------------------------------------------------------
# Prefer native


def prefer_native(
    package_dir: str | os.PathLike[str],
    *,
    max_batch_size: int,
    out_dir: str | os.PathLike[str],
    opset: int = DEFAULT_OPSET,
    tolerances: Mapping[str, tuple[float, float]] | None = None,
    progress: Progress | None = None,
    timeout: float = DEFAULT_TIMEOUT_SECS,
    params: Mapping[str, Any] | None = None,
    user_inputs: Sequence[Mapping[str, str | os.PathLike[str]]] = (),
) -> NativeDecision:
    """Decide what to publish for `package_dir`; export a custom torch package to ONNX when possible.

    `out_dir` (absent or empty; not inside the package) receives the ONNX package on success, or a
    `rejected/` folder with the export and its parity.json when parity fails. `tolerances` maps numpy
    dtype names to (atol, rtol) (see `tolerances_from`); `params` are the deployment's param overrides
    (the export hook sees `Model(**params)`); `user_inputs` are extra parity batches as
    `{input name: path.npy}`. Raises InvalidPackageError for an invalid package or unusable `out_dir`
    and ConversionFailed when the worker times out or crashes; an export or parity failure is a
    decision (native=False), not an error.
    """
    notify = progress or (lambda _stage: None)
    package_dir = Path(package_dir).resolve()
    out_dir = Path(out_dir).resolve()
    kind = package_kind(package_dir)
    if kind.triton_folder:  # served with its own config: never converted (its checks run at publish, on the server)
        return NativeDecision(
            package_dir,
            kind is not PackageKind.TRITON_PYTHON,
            f"a Triton model folder ({kind.value}); served with its own config",
            None,
            None,
        )
    package = load_package(package_dir)
    if package.kind is not PackageKind.CUSTOM:
        return NativeDecision(
            package_dir, True, f"already a native package ({package.kind.value}); nothing to convert", None, None
        )
    fallback = functools.partial(_fallback, package_dir)
    hook = _export_hook(package, max_batch_size, fallback)
    if isinstance(hook, NativeDecision):
        return hook

    effective = validate_params(package, dict(params or {}), model_id=package_dir.name)
    created = _prepare_out_dir(out_dir, package_dir)
    work = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir))
    decision: NativeDecision | None = None
    try:
        request = {
            "op": "torch_to_onnx",
            "package_dir": str(package_dir),
            "out_dir": str(work),
            "signature": _signature_request(package),
            "max_batch_size": max_batch_size,
            "opset": opset,
            "tolerances": {k: list(v) for k, v in (tolerances or {}).items()},
            "user_inputs": [{k: str(Path(v).resolve()) for k, v in batch.items()} for batch in user_inputs],
            "entrypoint": package.manifest.entrypoint,
            "class_name": package.manifest.class_name,
            "params": effective,
        }
        notify(f"starting the export worker ({hook})")
        result = run_worker(request, progress=notify, timeout=timeout, env=package.manifest.env)
        _artifact_beside_report(result, work)
        if not result.get("ok"):
            decision = _failed(result, work, out_dir, package_dir, fallback)
        else:
            notify("assembling the ONNX package")
            decision = _assemble(package, result, work, out_dir, opset, hook)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if created and (decision is None or not decision.native) and not any(out_dir.iterdir()):
            out_dir.rmdir()  # nothing to show: leave no empty folder behind
    return decision


def _fallback(package_dir: Path, stage: str, why: str, hint: str | None = None, **extra: Any) -> NativeDecision:
    """The decision to serve the custom package itself, saying at which ``stage`` the export stopped and why."""
    return NativeDecision(
        package_dir,
        False,
        f"serving the custom package (python backend): {why}",
        extra.pop("report", None),
        extra.pop("export_secs", None),
        stage=stage,
        hint=hint,
        **extra,
    )


def _export_hook(
    package: ModelPackage, max_batch_size: int, fallback: Callable[..., NativeDecision]
) -> str | NativeDecision:
    """Where the package's export hook is, or the fallback saying why no export can run: raw tensors, no batch
    axis, no hook (or an entry file that does not parse), no torch here. Nothing is imported."""
    manifest = package.manifest
    entry = package.path / manifest.entrypoint
    if manifest.tensor_format == TensorFormat.RAW:
        return fallback(
            "package",
            f"{package.path / MANIFEST_FILE}: tensor_format 'raw' (per-request tensors) cannot be checked "
            "against a collated batch",
            "use tensor_format 'numpy' if requests can be concatenated along the batch axis",
        )
    if max_batch_size <= 0:
        return fallback(
            "package",
            "max_batch_size 0: the exporter always makes a dynamic batch axis",
            "publish with max_batch_size > 0 to serve the exported model",
        )
    try:
        hook = find_export_hook(package.path, manifest.entrypoint, manifest.class_name)
    except (SyntaxError, UnicodeDecodeError) as exc:
        return fallback("hook", f"{entry}: cannot be parsed to look for an export hook ({exc})")
    if hook is None:
        return fallback(
            "hook",
            f"{entry} has no export hook",
            f"define {manifest.class_name}.export_module(self) returning (torch.nn.Module, "
            "{input_name: example_batch}) to have it served as ONNX",
        )
    if not torch_available():
        return fallback(
            "torch", "torch is not installed here, so the export cannot run", "pip install 'snoozeml[torch]'"
        )
    return hook


def _artifact_beside_report(result: Mapping[str, Any], work: Path) -> None:
    """The parity report leaves the temporary ``work`` folder with the ONNX file it checked (for the package, or
    ``rejected/``): it names that file as it sits beside the report, not by a path that is gone."""
    report = result.get("parity")
    if not isinstance(report, dict) or not report.get("artifact"):
        return
    artifact = Path(report["artifact"])
    report["artifact"] = artifact.relative_to(work).as_posix() if artifact.is_relative_to(work) else artifact.name
    path = work / PARITY_FILE
    try:
        written = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(written, dict):
        written["artifact"] = report["artifact"]
        path.write_text(json.dumps(written, indent=2) + "\n", encoding="utf-8")


def _prepare_out_dir(out_dir: Path, package_dir: Path) -> bool:
    """Check `out_dir` is usable and create it; True when it was created here."""
    if out_dir == package_dir or out_dir.is_relative_to(package_dir):
        raise InvalidPackageError(
            f"{out_dir}: the output folder is inside the package {package_dir}",
            hint="choose an output folder outside the package",
        )
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise InvalidPackageError(
            f"{out_dir}: the output folder exists and is not empty",
            hint="choose a new folder, or remove this one",
        )
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    return created


def _worst_parity(report: Mapping[str, Any] | None) -> str:
    """'output y on random, batch 3: max abs 0.31 > atol 0.0001 + rtol 0.001 (5 of 12 elements)'."""
    comparisons = (report or {}).get("comparisons", [])
    failures = [c for c in comparisons if not c.get("passed")]
    if not failures:
        return "no comparison failed"
    numeric = [c for c in failures if c.get("max_abs") is not None]
    worst = max(numeric, key=lambda c: c["max_abs"]) if numeric else failures[0]
    where = f"output '{worst['output']}' on {worst['case']}"
    if worst.get("max_abs") is None:
        return f"{where}: {worst.get('detail')}"
    numbers = (
        f"max abs error {worst['max_abs']:.3g} (max rel {worst['max_rel']:.3g}) > "
        f"tolerance atol {worst['atol']:g} + rtol {worst['rtol']:g} x |reference|"
    )
    detail = f" ({worst['detail']})" if worst.get("detail") else ""
    return f"{where}: {numbers}{detail}; {len(failures)} of {len(comparisons)} comparisons failed"


def _failed(
    result: Mapping[str, Any], work: Path, out_dir: Path, package_dir: Path, fallback: Callable[..., NativeDecision]
) -> NativeDecision:
    stage, message = result.get("stage", "export"), result.get("message", "")
    report = result.get("parity")
    if result.get("error_type") == "TorchUnavailable":
        return fallback("torch", message, "pip install 'snoozeml[torch]'")
    if stage == "parity":
        rejected = out_dir / REJECTED_DIR
        rejected.mkdir(exist_ok=True)
        for name in os.listdir(work):
            if not name.startswith("."):
                os.replace(work / name, rejected / name)
        return fallback(
            "parity",
            f"parity failed: {_worst_parity(report)}",
            "fix the export (e.g. data-dependent control flow is frozen by tracing), or loosen the tolerance "
            "(--atol/--rtol) if the difference is acceptable",
            report=report,
            artifacts=rejected,
        )
    if stage == "export":
        return fallback(
            "export",
            f"export failed: {message.replace(str(work), str(out_dir))}",
            "make the module exportable (each exporter's reason is given), or keep serving the custom package",
            report=report,
        )
    return fallback("worker", f"conversion failed: {message}", report=report)


def _assemble(
    package: ModelPackage, result: Mapping[str, Any], work: Path, out_dir: Path, opset: int, hook: str
) -> NativeDecision:
    """Move the export into `out_dir`, write its manifest, keep the custom package as provenance, and
    check the result loads as an ONNX package."""
    for name in os.listdir(work):
        if name == ONNX_FILE or name.startswith(ONNX_FILE + ".") or name == PARITY_FILE:
            os.replace(work / name, out_dir / name)
    provenance = out_dir / PROVENANCE_DIR
    for rel in package.files:
        dest = provenance / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(package.path / rel, dest)

    exporter, export_secs = result.get("exporter"), result.get("export_secs")
    (out_dir / MANIFEST_FILE).write_text(
        json.dumps(_converted_manifest(package, out_dir, exporter, export_secs, opset, hook), indent=2) + "\n",
        encoding="utf-8",
    )
    try:
        converted = load_package(out_dir)
    except SnoozeError as exc:  # should not happen: the worker checked the signature
        raise ConversionFailed(f"{out_dir}: the converted package does not load: {exc.message}", hint=exc.hint) from exc
    if converted.kind is not PackageKind.ONNX:
        raise ConversionFailed(f"{out_dir}: the converted package is {converted.kind.value}, not onnx")
    report = result.get("parity") or {}
    worst: dict[str, float] = {}
    for c in report.get("comparisons", []):
        if c.get("max_abs") is not None and c["max_abs"] >= worst.get(c["output"], -1.0):
            worst[c["output"]] = c["max_abs"]
    errors = ", ".join(f"{name} max abs {err:.2g}" for name, err in worst.items())
    reason = (
        f"exported to ONNX ({exporter} exporter, opset {opset}) in {export_secs:.1f} s; parity passed on "
        f"{len(report.get('comparisons', []))} comparisons ({errors}); the custom package is kept in "
        f"{PROVENANCE_DIR}/"
    )
    return NativeDecision(out_dir, True, reason, report, export_secs, converted=True, exporter=exporter)


def _converted_manifest(
    package: ModelPackage, out_dir: Path, exporter: str | None, export_secs: float | None, opset: int, hook: str
) -> dict[str, Any]:
    manifest = package.manifest
    body: dict[str, Any] = {
        "load_timeout_secs": manifest.load_timeout_secs,
        "request_timeout_secs": manifest.request_timeout_secs,
    }
    threads = manifest.env.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        # The python-backend ONNX runner takes onnxruntime SessionOptions as params: keep the thread cap.
        body["params_schema"] = {
            "intra_op_num_threads": {"type": "int", "default": int(threads), "description": "from OMP_NUM_THREADS"}
        }
    body["metadata"] = {
        **manifest.metadata,
        "converted_from": {
            "kind": PackageKind.CUSTOM,
            "provenance": f"{PROVENANCE_DIR}/",
            "entrypoint": manifest.entrypoint,
            "class": manifest.class_name,
            "hook": hook,
            "exporter": exporter,
            "opset": opset,
            "export_secs": round(export_secs, 3) if export_secs is not None else None,
            "parity_report": PARITY_FILE,
        },
    }
    # The ONNX file gives names, dtypes and dims; the declared signature is kept only where it says
    # more (a fixed size where the export left an axis variable).
    from converters.onnx_inspect import inspect_onnx

    sig = inspect_onnx(out_dir / ONNX_FILE)
    for label, declared, exported in (
        ("inputs", package.inputs, sig.inputs),
        ("outputs", package.outputs, sig.outputs),
    ):
        dims = {t.name: t.dims_without_batch for t in exported}
        if any(dims.get(t.name) != list(t.dims) for t in declared):
            body[label] = [t.model_dump() for t in declared]
    return body


@contextlib.contextmanager
def native_package(
    package_dir: str | os.PathLike[str], *, enabled: bool = True, **kwargs: Any
) -> Iterator[NativeDecision]:
    """`prefer_native` into a temporary folder that lives as long as the `with` block (for publish).

    With `enabled=False` (`--no-convert`) the package is published as it is."""
    if not enabled:
        kind = package_kind(Path(package_dir))
        if not kind.triton_folder:  # a Triton folder is checked at publish, on the server (auto-complete runs there)
            load_package(Path(package_dir))
        native = kind not in (PackageKind.CUSTOM, PackageKind.TRITON_PYTHON)
        yield NativeDecision(
            Path(package_dir).resolve(),
            native,
            "conversion disabled (--no-convert)" + ("" if native else ": serving the custom package (python backend)"),
            None,
            None,
            stage=None if native else "disabled",
        )
        return
    with tempfile.TemporaryDirectory(prefix="snooze-native-") as tmp:
        yield prefer_native(package_dir, out_dir=Path(tmp) / "package", **kwargs)
