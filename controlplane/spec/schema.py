"""The schema of what users write: a package's manifest (``snooze_model.json``), a deployment (a
``[[models]]`` entry of models.toml or a publish request), and ``ModelSpec``, the two joined, which the
renderer consumes. Pydantic models and plain records only; reading folders is ``controlplane.spec.loading``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from controlplane.dtypes import parse_dtype
from controlplane.modes import KeepAliveMode, SequenceStrategy, TensorFormat, Worker
from controlplane.source_inspect import predict_is_generator

if TYPE_CHECKING:
    from controlplane.spec.triton_folder import TritonFolder

MANIFEST_FILE = "snooze_model.json"
CUSTOM_ENTRYPOINT = "snooze_model.py"
ENTRY_POINT_GROUP = "snoozeml.models"
MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$"
MODULE_NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"


class PackageKind(StrEnum):
    CUSTOM = "custom"
    ONNX = "onnx"
    TENSORRT = "tensorrt"
    # A Triton model folder (its own config.pbtxt and/or numbered version folders), one kind per backend.
    TRITON_PYTHON = "triton-python"
    TRITON_ONNX = "triton-onnx"
    TRITON_PLAN = "triton-plan"
    TRITON_ENSEMBLE = "triton-ensemble"

    @property
    def triton_folder(self) -> bool:
        """A Triton model folder: its config is the user's, kept as written (controlplane/spec/triton_folder.py)."""
        return self.value.startswith("triton-")


class Device(StrEnum):
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


PARAM_TYPES: dict[str, Any] = {
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
    tensor_format: TensorFormat = TensorFormat.NUMPY
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

    strategy: SequenceStrategy = Field(
        SequenceStrategy.DIRECT,
        description="direct: a batch slot per sequence; oldest: dynamic batching of the oldest sequences",
    )
    max_sequence_idle_secs: float = Field(
        60, gt=0, description="Triton ends a sequence with no request for this long (its state is dropped)"
    )
    max_candidate_sequences: int | None = Field(
        None, ge=1, description="oldest: how many sequences may wait for a batch (Triton's default: max_batch_size)"
    )

    @model_validator(mode="after")
    def _candidates_need_oldest(self) -> SequenceSpec:
        if self.max_candidate_sequences is not None and self.strategy != SequenceStrategy.OLDEST:
            raise ValueError('max_candidate_sequences applies to strategy = "oldest" only')
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
    keep_alive: KeepAliveMode = Field(
        KeepAliveMode.FIXED,
        description="fixed: unload after idle_timeout_secs; adaptive: learn keep-alive and pre-warm windows from "
        "the model's own idle times (controlplane/keepalive.py), idle_timeout_secs where no pattern is found",
    )
    worker: Worker = Field(
        Worker.IN_STUB,
        description="custom models (and ONNX models the python backend serves): in-stub runs the model in its "
        "python-backend stub; preforked runs it in a "
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
    wakes: list[str] = Field(
        default_factory=list,
        description="Models this one calls through BLS, woken with it whenever it wakes (a BLS call into any "
        "other sleeping model wakes that one on the call: docs/packages.md, BLS)",
    )

    @field_validator("wakes")
    @classmethod
    def _wakes_are_model_ids(cls, wakes: list[str]) -> list[str]:
        for name in wakes:
            if not re.match(MODEL_ID_PATTERN, name):
                raise ValueError(f"'{name}' is not a model id (letters, digits, '_', '.', '-'; up to 128)")
        return list(dict.fromkeys(wakes))

    @model_validator(mode="after")
    def _wakes_name_others(self) -> DeploymentSpec:
        if self.id in self.wakes:
            raise ValueError(f"wakes lists the model itself ('{self.id}'): list the models it calls")
        return self

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
    triton: TritonFolder | None = None  # a Triton model folder's config and versions (kind triton-*)


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


def is_decoupled(package: ModelPackage) -> bool:
    """A custom package streams when its manifest says so, or (unset) when its predict is a generator; a Triton
    model folder when its config's transaction policy says so."""
    if package.triton is not None:
        return bool(package.triton.config.model_transaction_policy.decoupled)
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


def format_validation_error(exc: ValidationError, where: str) -> str:
    """A validation error of these models in the user's words, each field named (loading and discovery)."""
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
