"""What users write: model packages, their manifest, and deployment settings (models.toml).

A *package* is a folder with ``snooze_model.py`` (custom), ``model.onnx`` or ``model.plan``, plus an
optional ``snooze_model.json`` manifest. A *deployment* says how one package is served (id, device,
batching, idle timeout, instances). ``ModelSpec`` joins the two and is what the renderer consumes.

Nothing here imports user code: the control plane never runs a model in its own process.
"""

from __future__ import annotations

import ast
import json
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from controlplane.dtypes import parse_dtype
from controlplane.errors import InvalidPackageError

MANIFEST_FILE = "snooze_model.json"
CUSTOM_ENTRYPOINT = "snooze_model.py"
ONNX_FILE = "model.onnx"
PLAN_FILE = "model.plan"
ENTRY_POINT_GROUP = "snoozeml.models"
MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$"
MODULE_NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
_IGNORED_NAMES = {"__pycache__", ".git", ".ipynb_checkpoints", ".DS_Store"}


class PackageKind(str, Enum):
    CUSTOM = "custom"
    ONNX = "onnx"
    TENSORRT = "tensorrt"


class Device(str, Enum):
    CPU = "cpu"
    GPU = "gpu"
    AUTO = "auto"


class TensorSpec(BaseModel):
    """One input or output. ``dims`` exclude the batch axis; -1 marks a variable dimension."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    # numpy users write "dtype"; it means the same, so it is accepted as well.
    datatype: str = Field(
        validation_alias=AliasChoices("datatype", "dtype"),
        description="KServe v2 name (FP32, INT64, BYTES, ...) or numpy name; 'dtype' is accepted too",
    )
    dims: list[int] = Field(default_factory=list)

    @field_validator("datatype")
    @classmethod
    def _normalise_dtype(cls, value: str) -> str:
        return parse_dtype(value).wire

    @field_validator("dims")
    @classmethod
    def _check_dims(cls, dims: list[int]) -> list[int]:
        bad = [d for d in dims if d == 0 or d < -1]
        if bad:
            raise ValueError(f"dims {dims}: each dimension is a positive size or -1 (variable)")
        return dims


class ParamSpec(BaseModel):
    """One declared model parameter: its type, default and meaning."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["int", "float", "str", "bool", "list", "dict"]
    default: Any = None
    required: bool = False
    description: str = ""


_PARAM_TYPES: dict[str, Any] = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "list": list,
    "dict": dict[str, Any],
}


class Manifest(BaseModel):
    """``snooze_model.json``: everything about a package that is not code or weights."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    python: str | None = Field(None, description="Python versions the package supports, e.g. '>=3.10'")
    entrypoint: str = Field(CUSTOM_ENTRYPOINT, description="File inside the package defining the class")
    class_name: str = Field("Model", alias="class", description="Class implementing load/predict")
    load_timeout_secs: float = Field(300, gt=0)
    request_timeout_secs: float = Field(60, gt=0)
    tensor_format: Literal["numpy", "raw"] = "numpy"
    decoupled: bool | None = Field(
        None,
        description="Stream: each dict predict yields is one response (Triton's decoupled transaction "
        "policy); unset = decoupled exactly when the class's predict is a generator (read from its source)",
    )
    env: dict[str, str] = Field(default_factory=dict)
    preload: list[str] = Field(
        default_factory=list,
        description="Modules the preloaded parent of a preforked model imports (numpy always), e.g. ['torch']",
    )
    inputs: list[TensorSpec] | None = None
    outputs: list[TensorSpec] | None = None
    warmup: bool | dict[str, str] = Field(
        True,
        description="The load runs one inference: true (inputs from the signature), false (off: a predict with "
        "side effects) or {input name: .npy file in the package} (one request's tensor, no batch axis)",
    )
    params_schema: dict[str, ParamSpec] = Field(default_factory=dict)
    params: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(
        default_factory=dict, description="Free-form capability/interface description, served as-is"
    )

    @field_validator("python")
    @classmethod
    def _check_python(cls, value: str | None) -> str | None:
        if value is not None:
            python_specifier(value)
        return value

    @field_validator("preload")
    @classmethod
    def _check_preload(cls, value: list[str]) -> list[str]:
        bad = [m for m in value if not re.fullmatch(MODULE_NAME_PATTERN, m)]
        if bad:
            raise ValueError(f"preload {bad}: each entry is an importable module name such as 'torch' or 'PIL.Image'")
        return list(dict.fromkeys(value))

    @field_validator("entrypoint")
    @classmethod
    def _check_entrypoint(cls, value: str) -> str:
        if Path(value).is_absolute() or ".." in Path(value).parts or not value.endswith(".py"):
            raise ValueError(f"entrypoint {value!r} must be a .py file inside the package")
        return value


def python_specifier(value: str) -> SpecifierSet:
    """'3.11' means 3.11.*; anything else is a PEP 440 specifier such as '>=3.10,<3.13'."""
    text = value.strip()
    if re.fullmatch(r"\d+\.\d+", text):
        text = f"=={text}.*"
    try:
        return SpecifierSet(text)
    except InvalidSpecifier as exc:
        raise ValueError(f"python {value!r} is not a version ('3.11') or a specifier ('>=3.10')") from exc


class SequenceSpec(BaseModel):
    """``[models.sequence]``: a stateful model, rendered as Triton's sequence batcher. Requests carry a
    correlation id and start/end flags; every request of one sequence goes to the same instance."""

    model_config = ConfigDict(extra="forbid")

    strategy: Literal["direct", "oldest"] = Field(
        "direct", description="direct: a batch slot per sequence; oldest: dynamic batching of the oldest sequences"
    )
    max_sequence_idle_secs: float = Field(
        60, gt=0, description="Triton ends a sequence with no request for this long (its state is dropped)"
    )
    max_candidate_sequences: int | None = Field(
        None, ge=1, description="oldest: how many sequences may wait for a batch (Triton's default: max_batch_size)"
    )

    @model_validator(mode="after")
    def _candidates_need_oldest(self) -> SequenceSpec:
        if self.max_candidate_sequences is not None and self.strategy != "oldest":
            raise ValueError("max_candidate_sequences applies to strategy = \"oldest\" only")
        return self


class DeploymentSpec(BaseModel):
    """How one package is served: a ``[[models]]`` entry of models.toml or a publish request."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=MODEL_ID_PATTERN, description="Triton model name, unique")
    path: Path = Field(description="Package folder (relative paths are relative to models.toml)")
    device: Device = Device.CPU
    max_batch_size: int = Field(8, ge=0, description="0 disables batching (no batch axis)")
    max_batch_delay_ms: float = Field(0, ge=0, description="Dynamic batcher max queue delay")
    idle_timeout_secs: float = Field(300, gt=0, description="Unload after this long without traffic")
    keep_alive: Literal["fixed", "adaptive"] = Field(
        "fixed",
        description="fixed: unload after idle_timeout_secs; adaptive: learn keep-alive and pre-warm windows from "
        "the model's own idle times (controlplane/keepalive.py), idle_timeout_secs where no pattern is found",
    )
    worker: Literal["in-stub", "preforked"] = Field(
        "in-stub",
        description="custom models: in-stub runs the model in its python-backend stub; preforked runs it in a "
        "worker forked from a parent that has imported the package's 'preload' modules (fast cold starts)",
    )
    instances: int = Field(1, ge=1, description="Instances loaded on wake-up")
    max_instances: int = Field(4, ge=1, description="Upper bound for the autoscaler")
    memory_mb: float | None = Field(None, gt=0, description="Declared footprint, when not measurable")
    params: dict[str, Any] = Field(default_factory=dict, description="Overrides of the manifest params")
    onnx_tensorrt: bool = Field(False, description="full target: ONNX Runtime's TensorRT accelerator")
    fp16: bool = Field(False, description="with onnx_tensorrt: FP16 precision")
    execution_env_path: str | None = Field(
        None, description="python backend EXECUTION_ENV_PATH (conda-pack tarball or folder)"
    )
    sequence: SequenceSpec | None = Field(None, description="A stateful model: Triton's sequence batcher")

    @model_validator(mode="after")
    def _sequence_outlives_no_idle_unload(self) -> DeploymentSpec:
        seq = self.sequence
        if seq is not None and self.idle_timeout_secs < seq.max_sequence_idle_secs:
            # An idle unload must never cut a live sequence: its last request is at most that old.
            raise ValueError(
                f"idle_timeout_secs ({self.idle_timeout_secs:g}) is below sequence.max_sequence_idle_secs "
                f"({seq.max_sequence_idle_secs:g}): an idle unload could end a live sequence; raise "
                "idle_timeout_secs or lower max_sequence_idle_secs"
            )
        return self


@dataclass(frozen=True)
class ModelPackage:
    """A validated package folder."""

    path: Path
    kind: PackageKind
    manifest: Manifest
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    files: list[str]  # relative paths to copy, sorted
    batch_dynamic: bool = True  # ONNX: first axis dynamic on every tensor
    model_file: str | None = None  # model.onnx / model.plan
    external_data: tuple[str, ...] = ()  # ONNX external-data files, relative to the package


@dataclass(frozen=True)
class ModelSpec:
    """A package and its deployment: everything the renderer needs."""

    deployment: DeploymentSpec
    package: ModelPackage
    params: dict[str, Any] = field(default_factory=dict)  # validated, defaults applied
    notes: tuple[str, ...] = ()  # what publishing decided for the user (a default it changed, and why)

    @property
    def id(self) -> str:
        return self.deployment.id

    @property
    def decoupled(self) -> bool:
        return is_decoupled(self.package)


def predict_is_generator(source: str, class_name: str) -> bool:
    """Whether ``class_name.predict`` in ``source`` is a generator function, read from the source
    (``ast``; the control plane never runs user code): a ``yield`` in its own body, not a nested one."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "predict":
                    return _yields(item)
    return False


def _yields(function: ast.AST) -> bool:
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))
    return False


def is_decoupled(package: ModelPackage) -> bool:
    """A custom package streams when its manifest says so, or (unset) when its predict is a generator."""
    if package.kind is not PackageKind.CUSTOM:
        return False
    manifest = package.manifest
    if manifest.decoupled is not None:
        return manifest.decoupled
    entry = package.path / manifest.entrypoint
    try:
        source = entry.read_text(encoding="utf-8")
    except OSError:
        return False
    return predict_is_generator(source, manifest.class_name)


# ---------------------------------------------------------------------------------------------
# Loading a package


def _format_validation_error(exc: ValidationError, where: str) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        if err["type"] == "extra_forbidden" and err["loc"][-1] == "shape":
            # numpy's shape includes the batch axis; dims never does, so the word is not taken as is.
            parts.append(
                f"unknown field '{loc}': tensors declare 'dims', the shape of one item without the batch "
                "axis (a batch of shape [N, 3] is \"dims\": [3]); rename 'shape' to 'dims' and drop the batch axis"
            )
        elif err["type"] == "extra_forbidden":
            parts.append(f"unknown field '{loc}' (remove it or check its spelling)")
        elif err["type"] == "missing":
            parts.append(f"missing required field '{loc}'")
        else:
            parts.append(f"field '{loc}': {err['msg']}")
    return f"{where}: " + "; ".join(parts)


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
            _format_validation_error(exc, str(path)),
            hint=f"see docs/packages.md for the fields of {MANIFEST_FILE}",
        ) from exc


def package_kind(package_dir: Path) -> PackageKind:
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
        raise InvalidPackageError(
            f"{package_dir}: not a model package: no {CUSTOM_ENTRYPOINT}, {ONNX_FILE} or {PLAN_FILE}",
            hint="add one of these files (a custom model, an ONNX file or a TensorRT plan)",
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


def load_package(path: str | Path) -> ModelPackage:
    """Validate a package folder without importing its code. Raises InvalidPackageError."""
    package_dir = Path(path)
    if not package_dir.is_dir():
        raise InvalidPackageError(
            f"{package_dir}: package folder not found", hint="pass the folder that holds snooze_model.py"
        )
    kind = package_kind(package_dir)
    manifest = read_manifest(package_dir)
    files = package_files(package_dir)
    manifest_path = package_dir / MANIFEST_FILE
    if kind is PackageKind.CUSTOM:
        if manifest.entrypoint not in files:
            raise InvalidPackageError(
                f"{manifest_path}: entrypoint '{manifest.entrypoint}' is not in the package",
                hint="set 'entrypoint' to a .py file of the package",
            )
        missing = [name for name in ("inputs", "outputs") if not getattr(manifest, name)]
        if missing:
            hint = _MANIFEST_HINT if not manifest_path.exists() else "add " + ", ".join(
                f'"{name}": [{{"name": "x", "datatype": "FP32", "dims": [3]}}]' for name in missing
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
        package_dir, kind, manifest, list(manifest.inputs or []), list(manifest.outputs or []), files,
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
        return [
            TensorSpec(name=t.name, datatype=t.dtype, dims=list(t.dims[1:] if batch else t.dims))
            for t in tensors
        ]

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
        typ = _PARAM_TYPES[spec.type]
        default = ... if spec.required and spec.default is None else spec.default
        fields[name] = (typ if default is ... else typ | None, default)
    params_model = create_model(  # type: ignore[call-overload]
        "Params", __config__=ConfigDict(extra="forbid", strict=False), **fields
    )
    try:
        return params_model.model_validate(values).model_dump()
    except ValidationError as exc:
        raise InvalidPackageError(
            _format_validation_error(exc, f"{where} params"),
            hint=f"declared params: {', '.join(f'{k} ({v.type})' for k, v in schema.items())}",
        ) from exc


def resolve(deployment: DeploymentSpec) -> ModelSpec:
    """Load and validate the package of one deployment."""
    package = load_package(deployment.path)
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
                why = str(exc).split(": ", 1)[-1].split(". Fix:", 1)[0].removeprefix(
                    "cannot serve with max_batch_size > 0 because ")
                notes.append(f"max_batch_size 0 (no batching): {why}; Triton batches along the first axis only, "
                             "so requests are served one at a time with the file's full shapes")
                deployment = deployment.model_copy(update={"max_batch_size": 0})
                return _checked(ModelSpec(deployment, package, params, tuple(notes)))
            raise InvalidPackageError(
                f"model '{deployment.id}': {exc}", hint="or set max_batch_size = 0 for this model"
            ) from exc
    return _checked(ModelSpec(deployment, package, params, tuple(notes)))


def _checked(spec: ModelSpec) -> ModelSpec:
    """The deployment checks that hold whatever max_batch_size publishing chose."""
    deployment, package = spec.deployment, spec.package
    if deployment.worker == "preforked" and package.kind is not PackageKind.CUSTOM:
        raise InvalidPackageError(
            f"model '{deployment.id}': worker = \"preforked\" applies to custom models (snooze_model.py); "
            f"this package is {package.kind.value}",
            hint='remove worker = "preforked" for this model',
        )
    if deployment.max_instances < deployment.instances:
        raise InvalidPackageError(
            f"model '{deployment.id}': max_instances ({deployment.max_instances}) is below "
            f"instances ({deployment.instances})",
            hint="raise max_instances or lower instances",
        )
    return spec


# ---------------------------------------------------------------------------------------------
# Finding packages: models.toml, a models folder, entry points


def load_models_toml(path: str | Path) -> list[DeploymentSpec]:
    toml_path = Path(path)
    try:
        data = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise InvalidPackageError(f"{toml_path}: file not found") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InvalidPackageError(f"{toml_path}: not valid TOML ({exc})") from exc
    unknown = sorted(set(data) - {"models"})
    if unknown:
        raise InvalidPackageError(
            f"{toml_path}: unknown top-level key(s) {unknown}", hint="models.toml holds [[models]] tables only"
        )
    entries = data.get("models", [])
    if not isinstance(entries, list):
        raise InvalidPackageError(f"{toml_path}: 'models' must be an array of tables ([[models]])")
    specs = []
    for i, entry in enumerate(entries):
        where = f"{toml_path} [[models]] #{i + 1}" + (f" (id '{entry.get('id')}')" if "id" in entry else "")
        try:
            spec = DeploymentSpec.model_validate(entry)
        except ValidationError as exc:
            raise InvalidPackageError(_format_validation_error(exc, where)) from exc
        if not spec.path.is_absolute():
            spec = spec.model_copy(update={"path": (toml_path.parent / spec.path).resolve()})
        specs.append(spec)
    return _check_unique_ids(specs, str(toml_path))


def _check_unique_ids(specs: list[DeploymentSpec], where: str) -> list[DeploymentSpec]:
    seen: dict[str, Path] = {}
    for spec in specs:
        if spec.id in seen:
            raise InvalidPackageError(
                f"{where}: model id '{spec.id}' is used twice ({seen[spec.id]} and {spec.path})",
                hint="give each model its own id",
            )
        seen[spec.id] = spec.path
    return specs


def is_package_dir(path: Path, *, discoverable_only: bool = False) -> bool:
    """A folder holding a model file; discovery looks only for snooze_model.py and model.onnx."""
    names = (CUSTOM_ENTRYPOINT, ONNX_FILE) if discoverable_only else (CUSTOM_ENTRYPOINT, ONNX_FILE, PLAN_FILE)
    return path.is_dir() and any((path / name).is_file() for name in names)


def discover(models_dir: str | Path) -> list[DeploymentSpec]:
    """Deployments for a models folder: its models.toml entries plus every sub-folder holding
    snooze_model.py or model.onnx that models.toml does not already name (id = folder name)."""
    root = Path(models_dir)
    if not root.is_dir():
        raise InvalidPackageError(f"{root}: models folder not found")
    toml_path = root / "models.toml"
    specs = load_models_toml(toml_path) if toml_path.exists() else []
    named_paths = {s.path.resolve() for s in specs}
    named_ids = {s.id for s in specs}
    for child in sorted(root.iterdir()):
        named = child.resolve() in named_paths or child.name in named_ids
        if is_package_dir(child, discoverable_only=True) and not named:
            try:
                specs.append(DeploymentSpec(id=child.name, path=child.resolve()))
            except ValidationError as exc:
                raise InvalidPackageError(
                    _format_validation_error(exc, f"{child}"),
                    hint="rename the folder (letters, digits, '_', '.', '-') or list it in models.toml",
                ) from exc
    return _check_unique_ids(specs, str(root))


def entry_point_deployments() -> list[DeploymentSpec]:
    """Packages exposed by installed distributions in the ``snoozeml.models`` entry-point group.

    The entry point names the model id; its object is a package path, a module (its folder is the
    package) or a callable returning either."""
    from importlib.metadata import entry_points

    specs = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if callable(obj) and not isinstance(obj, type):
                obj = obj()
            path = Path(obj.__file__).parent if hasattr(obj, "__file__") else Path(obj)
        except Exception as exc:
            raise InvalidPackageError(
                f"entry point '{ep.name} = {ep.value}' in group {ENTRY_POINT_GROUP}: cannot be loaded ({exc})",
                hint="it must name a package folder path, a module inside the package, or a callable returning one",
            ) from exc
        specs.append(DeploymentSpec(id=ep.name, path=path))
    return specs


def resolve_all(deployments: Iterable[DeploymentSpec]) -> list[ModelSpec]:
    return [resolve(d) for d in deployments]
