"""Loading a package folder and joining it with its deployment: the manifest read and checked, the
kind told from its files, an ONNX file's signature read (never run), params validated.

Nothing here imports user code: the control plane never runs a model in its own process.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, ValidationError, create_model

from controlplane.errors import InvalidPackageError
from controlplane.modes import Worker
from controlplane.spec.schema import (
    CUSTOM_ENTRYPOINT,
    MANIFEST_FILE,
    PARAM_TYPES,
    DeploymentSpec,
    Manifest,
    ModelPackage,
    ModelSpec,
    PackageKind,
    TensorSpec,
    format_validation_error,
)
from controlplane.spec.triton_folder import (
    CONFIG_FILE,
    load_triton_folder,
    looks_like_triton_folder,
    triton_deployment,
    triton_folder_kind,
    triton_notes,
)
from converters.files import ONNX_FILE, PLAN_FILE

_IGNORED_NAMES = {"__pycache__", ".git", ".ipynb_checkpoints", ".DS_Store"}


def read_manifest(package_dir: Path) -> Manifest:
    path = package_dir / MANIFEST_FILE
    if not path.exists():
        return Manifest()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidPackageError(
            f"{path}: not valid JSON ({exc})", hint="fix the JSON syntax of the manifest"
        ) from exc
    if not isinstance(raw, dict):
        raise InvalidPackageError(f"{path}: the manifest must be a JSON object")
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        raise InvalidPackageError(
            format_validation_error(exc, str(path)),
            hint=f"see docs/packages.md for the fields of {MANIFEST_FILE}",
        ) from exc


def package_kind(package_dir: Path) -> PackageKind:
    """The package's kind from its files: snoozeml's own (snooze_model.py, model.onnx, model.plan) first, then a
    Triton model folder (config.pbtxt and/or numbered version folders); a folder that is neither is refused."""
    found = [
        kind
        for kind, name in (
            (PackageKind.CUSTOM, CUSTOM_ENTRYPOINT),
            (PackageKind.ONNX, ONNX_FILE),
            (PackageKind.TENSORRT, PLAN_FILE),
        )
        if (package_dir / name).is_file()
    ]
    if not found:
        manifest = package_dir / MANIFEST_FILE
        if manifest.is_file():  # a custom package may name another entrypoint
            entry = read_manifest(package_dir).entrypoint
            if (package_dir / entry).is_file():
                return PackageKind.CUSTOM
        if looks_like_triton_folder(package_dir):
            return triton_folder_kind(package_dir)
        raise InvalidPackageError(
            f"{package_dir}: not a model package: no {CUSTOM_ENTRYPOINT}, {ONNX_FILE} or {PLAN_FILE}, and not a "
            f"Triton model folder (no {CONFIG_FILE}, no numbered version folder holding model.py, {ONNX_FILE} or "
            f"{PLAN_FILE})",
            hint="add one of these files (a custom model, an ONNX file or a TensorRT plan), or lay the folder out "
            "as Triton does (config.pbtxt and 1/model.py), or move it out of the models folder",
        )
    # A custom package may ship an ONNX file it uses itself: the Python entrypoint wins.
    return found[0]


def package_files(package_dir: Path) -> list[str]:
    """Every regular file of the package, relative and sorted; symlinks must stay inside."""
    root = package_dir.resolve()
    files = []
    for path in sorted(package_dir.rglob("*")):
        rel = path.relative_to(package_dir)
        if any(part in _IGNORED_NAMES for part in rel.parts):
            continue
        if path.is_symlink():
            target = path.resolve()
            if not target.is_relative_to(root):
                raise InvalidPackageError(
                    f"{path}: symlink points outside the package (to {target})",
                    hint="copy the file into the package instead of linking to it",
                )
        if path.is_file():
            files.append(rel.as_posix())
    return files


def load_package(path: str | Path, *, model_id: str | None = None) -> ModelPackage:
    """Validate a package folder without importing its code (a Triton python model's auto_complete_config runs in
    a child process). ``model_id``: the name it is published under (default: the folder's). Raises
    InvalidPackageError."""
    package_dir = Path(path)
    if not package_dir.is_dir():
        raise InvalidPackageError(
            f"{package_dir}: package folder not found",
            hint="pass the folder that holds snooze_model.py, or a Triton model folder (config.pbtxt, 1/)",
        )
    kind = package_kind(package_dir)
    files = package_files(package_dir)
    if kind.triton_folder:
        return load_triton_folder(package_dir, files, model_id=model_id)
    manifest = read_manifest(package_dir)
    manifest_path = package_dir / MANIFEST_FILE
    if kind is PackageKind.CUSTOM:
        if manifest.entrypoint not in files:
            raise InvalidPackageError(
                f"{manifest_path}: entrypoint '{manifest.entrypoint}' is not in the package",
                hint="set 'entrypoint' to a .py file of the package",
            )
        missing = [name for name in ("inputs", "outputs") if not getattr(manifest, name)]
        if missing:
            hint = (
                _MANIFEST_HINT
                if not manifest_path.exists()
                else "add "
                + ", ".join(f'"{name}": [{{"name": "x", "datatype": "FP32", "dims": [3]}}]' for name in missing)
            )
            raise InvalidPackageError(_missing_signature_message(package_dir, missing), hint=hint)
        _check_unique_names(manifest.inputs or [], manifest.outputs or [], manifest_path)
        return ModelPackage(
            package_dir, kind, manifest, list(manifest.inputs or []), list(manifest.outputs or []), files
        )
    if kind is PackageKind.ONNX:
        return _load_onnx_package(package_dir, manifest, files)
    for name in ("inputs", "outputs"):
        if not getattr(manifest, name):
            raise InvalidPackageError(
                f"{manifest_path}: a TensorRT plan package must declare its '{name}' in the manifest",
                hint="copy them from the ONNX model the plan was built from",
            )
    return ModelPackage(
        package_dir,
        kind,
        manifest,
        list(manifest.inputs or []),
        list(manifest.outputs or []),
        files,
        model_file=PLAN_FILE,
    )


_MANIFEST_HINT = (
    f"write {MANIFEST_FILE} next to {CUSTOM_ENTRYPOINT}, e.g. "
    '{"inputs": [{"name": "x", "datatype": "FP32", "dims": [3]}], '
    '"outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}]} '
    "(dims without the batch axis; docs/packages.md has a complete manifest)"
)


def _missing_signature_message(package_dir: Path, missing: list[str]) -> str:
    """A custom model's signature cannot be read from Python code: say which part is missing, and
    whether the manifest itself is missing (then 'optional' does not apply to this package)."""
    what = " and ".join(f"'{name}'" for name in missing)
    manifest_path = package_dir / MANIFEST_FILE
    if not manifest_path.exists():
        return (
            f"{package_dir}: a custom model needs a manifest {MANIFEST_FILE} declaring its {what} "
            f"(name, datatype, dims without the batch axis), and the package has none"
        )
    return f"{manifest_path}: a custom model must declare its {what} (name, datatype, dims without the batch axis)"


def _check_unique_names(inputs: list[TensorSpec], outputs: list[TensorSpec], where: Path) -> None:
    for label, tensors in (("input", inputs), ("output", outputs)):
        names = [t.name for t in tensors]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise InvalidPackageError(f"{where}: duplicate {label} name(s) {dupes}")


def _load_onnx_package(package_dir: Path, manifest: Manifest, files: list[str]) -> ModelPackage:
    from converters.errors import ConversionError
    from converters.onnx_inspect import inspect_onnx

    onnx_path = package_dir / ONNX_FILE
    try:
        sig = inspect_onnx(onnx_path)
    except ConversionError as exc:
        raise InvalidPackageError(str(exc)) from exc
    batch = sig.batch_dynamic

    def derived(tensors: Any) -> list[TensorSpec]:
        return [TensorSpec(name=t.name, datatype=t.dtype, dims=list(t.dims[1:] if batch else t.dims)) for t in tensors]

    inputs, outputs = derived(sig.inputs), derived(sig.outputs)
    manifest_path = package_dir / MANIFEST_FILE
    for label, declared, actual in (("inputs", manifest.inputs, inputs), ("outputs", manifest.outputs, outputs)):
        if declared is not None:
            _check_declared_matches(label, declared, actual, manifest_path, onnx_path)
    return ModelPackage(
        package_dir, PackageKind.ONNX, manifest, inputs, outputs, files, batch, ONNX_FILE, tuple(sig.external_data)
    )


def _check_declared_matches(
    label: str, declared: list[TensorSpec], actual: list[TensorSpec], manifest_path: Path, onnx_path: Path
) -> None:
    by_name = {t.name: t for t in actual}
    problems = []
    for t in declared:
        real = by_name.get(t.name)
        if real is None:
            problems.append(f"'{t.name}' is not an ONNX {label[:-1]} (the file has {sorted(by_name)})")
        elif real.datatype != t.datatype:
            problems.append(f"'{t.name}' is {real.datatype} in the ONNX file, {t.datatype} in the manifest")
        elif len(real.dims) != len(t.dims) or any(
            a != b and -1 not in (a, b) for a, b in zip(real.dims, t.dims, strict=False)
        ):
            problems.append(f"'{t.name}' has dims {real.dims} in the ONNX file, {t.dims} in the manifest")
    if {t.name for t in declared} != set(by_name) and not problems:
        problems.append(f"the manifest lists {sorted(t.name for t in declared)}, the file has {sorted(by_name)}")
    if problems:
        raise InvalidPackageError(
            f"{manifest_path}: {label} do not match {onnx_path.name}: " + "; ".join(problems),
            hint=f"remove '{label}' from the manifest (they are read from the ONNX file) or correct them",
        )


# ---------------------------------------------------------------------------------------------
# Joining a package and its deployment


def validate_params(package: ModelPackage, overrides: dict[str, Any], *, model_id: str) -> dict[str, Any]:
    """Manifest params + deployment overrides, checked against the declared params schema."""
    schema = package.manifest.params_schema
    values = {**package.manifest.params, **overrides}
    where = f"model '{model_id}' ({package.path / MANIFEST_FILE})"
    if not schema:
        if values:
            raise InvalidPackageError(
                f"{where}: params {sorted(values)} given but the package declares no 'params_schema'",
                hint="declare each parameter in 'params_schema' with its type and default",
            )
        return {}
    fields: dict[str, Any] = {}
    for name, spec in schema.items():
        typ = PARAM_TYPES[spec.type]
        default = ... if spec.required and spec.default is None else spec.default
        fields[name] = (typ if default is ... else typ | None, default)
    params_model = create_model("Params", __config__=ConfigDict(extra="forbid", strict=False), **fields)
    try:
        return params_model.model_validate(values).model_dump()
    except ValidationError as exc:
        raise InvalidPackageError(
            format_validation_error(exc, f"{where} params"),
            hint=f"declared params: {', '.join(f'{k} ({v.type})' for k, v in schema.items())}",
        ) from exc


def resolve(deployment: DeploymentSpec) -> ModelSpec:
    """Load and validate the package of one deployment."""
    package = load_package(deployment.path, model_id=deployment.id)
    if package.triton is not None:
        return _checked(ModelSpec(triton_deployment(deployment, package), package, {}, triton_notes(package)))
    params = validate_params(package, deployment.params, model_id=deployment.id)
    notes: list[str] = []
    if package.kind is PackageKind.ONNX and deployment.max_batch_size > 0 and not package.batch_dynamic:
        from converters.onnx_inspect import inspect_onnx

        try:
            inspect_onnx(package.path / ONNX_FILE).require_batchable()
        except Exception as exc:
            if "max_batch_size" not in deployment.model_fields_set:  # the default, not the user's choice
                # A batch axis that is not the first (a state tensor [2, batch, 128]) or none at all: served as
                # it is, each request one call (the package's dims are the file's full shapes already).
                why = (
                    str(exc)
                    .split(": ", 1)[-1]
                    .split(". Fix:", 1)[0]
                    .removeprefix("cannot serve with max_batch_size > 0 because ")
                )
                notes.append(
                    f"max_batch_size 0 (no batching): {why}; Triton batches along the first axis only, "
                    "so requests are served one at a time with the file's full shapes"
                )
                deployment = deployment.model_copy(update={"max_batch_size": 0})
                return _checked(ModelSpec(deployment, package, params, tuple(notes)))
            raise InvalidPackageError(
                f"model '{deployment.id}': {exc}", hint="or set max_batch_size = 0 for this model"
            ) from exc
    return _checked(ModelSpec(deployment, package, params, tuple(notes)))


def _checked(spec: ModelSpec) -> ModelSpec:
    """The deployment checks that hold whatever max_batch_size publishing chose."""
    deployment, package = spec.deployment, spec.package
    if deployment.worker == Worker.PREFORKED and package.kind not in (PackageKind.CUSTOM, PackageKind.ONNX):
        raise InvalidPackageError(
            f"model '{deployment.id}': worker = \"preforked\" applies to custom models (snooze_model.py) and to "
            f"ONNX models served by the python backend's onnxruntime runner; this package is {package.kind.value}",
            hint='remove worker = "preforked" for this model',
        )
    if deployment.max_instances < deployment.instances:
        raise InvalidPackageError(
            f"model '{deployment.id}': max_instances ({deployment.max_instances}) is below "
            f"instances ({deployment.instances})",
            hint="raise max_instances or lower instances",
        )
    return spec


def resolve_all(deployments: Iterable[DeploymentSpec]) -> list[ModelSpec]:
    return [resolve(d) for d in deployments]
