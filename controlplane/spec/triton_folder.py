"""Triton model folders as packages: the folders Triton users already have, served with their own config.

A Triton model folder holds a ``config.pbtxt`` and/or numbered version folders (``1/model.py``,
``1/model.onnx``, ``1/model.plan``, an empty ``1/`` for an ensemble). Its config is the user's: parsed into
Triton's own ``ModelConfig``, checked, and kept as written; the renderer (``controlplane/render_triton.py``)
changes only the fields snoozeml must own and says which. A python model whose class has
``auto_complete_config`` has its config completed here, once, by running that function in a child process
(``controlplane/auto_complete.py``): snoozeml's Triton runs with auto-complete off.

The kinds (``PackageKind.TRITON_*``) follow the backend: python, onnx (``onnxruntime_onnx``), plan
(``tensorrt_plan``) and ensemble. Nothing here imports the user's code.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from pydantic import ValidationError
from tritonclient.grpc import model_config_pb2

from controlplane import source_inspect
from controlplane.dtypes import from_triton
from controlplane.errors import InvalidPackageError
from controlplane.modes import SequenceStrategy, Worker
from controlplane.spec.schema import (
    DeploymentSpec,
    Device,
    Manifest,
    ModelPackage,
    PackageKind,
    SequenceSpec,
    TensorSpec,
    format_validation_error,
)
from converters.files import ONNX_FILE, PLAN_FILE, PYTHON_MODEL_FILE

CONFIG_FILE = "config.pbtxt"
VERSION_PATTERN = re.compile(r"[1-9][0-9]*")
# The user's model.py, moved beside the generated wrapper (same version folder: its sibling imports still work).
USER_MODULE = "triton_user_model"
RUNTIME_DIR = "python_backend"  # where the runtime travels in a version folder (render.RUNTIME_SUBDIR)
# Config parameters snoozeml writes itself: the publish token, a client's override mark, an instance rebuild.
RESERVED_PARAMETER_PREFIX = "snooze_"

PYTHON, ONNXRUNTIME, TENSORRT, ENSEMBLE = "python", "onnxruntime", "tensorrt", "ensemble"
BACKEND_BY_PLATFORM = {"onnxruntime_onnx": ONNXRUNTIME, "tensorrt_plan": TENSORRT, "ensemble": ENSEMBLE}
PLATFORM_BY_BACKEND = {ONNXRUNTIME: "onnxruntime_onnx", TENSORRT: "tensorrt_plan", ENSEMBLE: "ensemble"}
DEFAULT_FILES = {PYTHON: PYTHON_MODEL_FILE, ONNXRUNTIME: ONNX_FILE, TENSORRT: PLAN_FILE}
KIND_BY_BACKEND = {
    PYTHON: PackageKind.TRITON_PYTHON,
    ONNXRUNTIME: PackageKind.TRITON_ONNX,
    TENSORRT: PackageKind.TRITON_PLAN,
    ENSEMBLE: PackageKind.TRITON_ENSEMBLE,
}
# Deployment settings a Triton config already says: set them in config.pbtxt (it is kept as written).
CONFIG_OWNED_SETTINGS = {
    "max_batch_size": "max_batch_size",
    "max_batch_delay_ms": "dynamic_batching.max_queue_delay_microseconds",
    "instances": "instance_group.count",
    "device": "instance_group.kind",
    "sequence": "sequence_batching",
    "onnx_tensorrt": "optimization.execution_accelerators",
    "fp16": "optimization.execution_accelerators",
}
# Triton's default idle limit of a sequence when its config gives none.
DEFAULT_SEQUENCE_IDLE_SECS = 1.0

ModelConfig = model_config_pb2.ModelConfig


@dataclass(frozen=True)
class TritonFolder:
    """What a Triton model folder says: its config (completed where auto-complete ran) and its versions."""

    config: Any  # model_config_pb2.ModelConfig, read-only
    backend: str  # python | onnxruntime | tensorrt | ensemble
    model_file: str  # the file each version folder holds ('' for an ensemble)
    versions: tuple[int, ...]  # the numbered folders, ascending
    served: tuple[int, ...]  # the versions its version_policy serves
    written_name: str = ""  # the config's name as written ('' when it gave none)
    had_config: bool = True  # a config.pbtxt was there (else auto-complete wrote it all)
    completed_by: str = ""  # what completed the config: '' | 'auto_complete_config' | 'the ONNX file'

    @property
    def ensemble_steps(self) -> tuple[tuple[str, str], ...]:
        """(model name, version or '' for the latest) of each step of an ensemble, in the config's order."""
        return tuple(
            (step.model_name, "" if step.model_version < 0 else str(step.model_version))
            for step in self.config.ensemble_scheduling.step
        )


def version_numbers(path: Path) -> list[int]:
    """The numbered version folders of a model folder, ascending."""
    if not path.is_dir():
        return []
    return sorted(int(p.name) for p in path.iterdir() if p.is_dir() and VERSION_PATTERN.fullmatch(p.name))


def looks_like_triton_folder(path: Path) -> bool:
    """A ``config.pbtxt``, or a numbered version folder holding a model file Triton knows."""
    if (path / CONFIG_FILE).is_file():
        return True
    return any(any((path / str(v) / name).exists() for name in DEFAULT_FILES.values()) for v in version_numbers(path))


def triton_folder_kind(path: Path) -> PackageKind:
    """The kind of a Triton model folder, from its config's backend or platform (else its version folders)."""
    return KIND_BY_BACKEND[_backend_of(read_config(path), path, version_numbers(path))]


def triton_notes(package: ModelPackage) -> tuple[str, ...]:
    """What publishing did to the folder's config before rendering (the renderer adds the fields it owns)."""
    folder = package.triton
    assert folder is not None
    if folder.completed_by == "auto_complete_config":
        what = "written" if not folder.had_config else "completed"
        return (
            f"config {what} at publish by the model's auto_complete_config and stored complete: snoozeml's Triton "
            "runs with auto-complete off, so it is not run again at load (publish again after changing it)",
        )
    if folder.completed_by:
        return (f"inputs and outputs read from {folder.completed_by}, as Triton's auto-complete would",)
    return ()


def read_config(path: Path) -> Any:
    """The folder's config.pbtxt parsed into Triton's ModelConfig (no other check); an empty one without it."""
    config = ModelConfig()
    file = path / CONFIG_FILE
    if not file.is_file():
        return config
    try:
        text_format.Parse(file.read_text(encoding="utf-8"), config)
    except UnicodeDecodeError as exc:
        raise InvalidPackageError(f"{file}: not UTF-8 text ({exc})", hint="save config.pbtxt as UTF-8") from exc
    except text_format.ParseError as exc:
        raise InvalidPackageError(
            f"{file}: not a valid Triton ModelConfig: {exc}",
            hint="correct the protobuf text (the fields of Triton's model_config.proto)",
        ) from exc
    return config


def triton_config_json(config: Any) -> dict[str, Any]:
    """A ModelConfig as the JSON Triton hands a python model (``args['model_config']``, auto-complete): proto field
    names, every plain field present, 64-bit integers as numbers (protobuf's JSON writes them as strings)."""
    raw = json_format.MessageToDict(config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    _numbers(raw, config.DESCRIPTOR)
    return raw


_INT64 = (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64)


def _numbers(value: dict[str, Any], descriptor: Descriptor) -> None:
    for key, item in value.items():
        field = descriptor.fields_by_name.get(key)
        if field is None:
            continue
        sub = field.message_type
        if sub is not None and sub.GetOptions().map_entry:
            entry = sub.fields_by_name["value"]
            for k, v in item.items():
                if entry.message_type is not None:
                    _numbers(v, entry.message_type)
                elif entry.cpp_type in _INT64:
                    item[k] = int(v)
        elif sub is not None:
            for element in item if isinstance(item, list) else [item]:
                _numbers(element, sub)
        elif field.cpp_type in _INT64:
            value[key] = [int(x) for x in item] if isinstance(item, list) else int(item)


def _backend_of(config: Any, path: Path, versions: list[int]) -> str:
    where = path / CONFIG_FILE
    if config.backend:
        if config.backend in (PYTHON, ONNXRUNTIME, TENSORRT):
            return str(config.backend)
        raise InvalidPackageError(
            f"{where}: backend '{config.backend}': snoozeml serves Triton model folders of the python, onnxruntime "
            "and tensorrt backends and ensembles",
            hint="convert the model to ONNX (snoozectl convert) or write it as a python model",
        )
    if config.platform:
        if config.platform in BACKEND_BY_PLATFORM:
            return BACKEND_BY_PLATFORM[config.platform]
        raise InvalidPackageError(
            f"{where}: platform '{config.platform}': snoozeml serves onnxruntime_onnx, tensorrt_plan and "
            "ensemble platforms and python models",
            hint="convert the model to ONNX (snoozectl convert) or write it as a python model",
        )
    # No backend named: the version folders' files say which, as Triton's auto-complete would.
    for backend, name in DEFAULT_FILES.items():
        if any((path / str(v) / (config.default_model_filename or name)).exists() for v in versions):
            return backend
    raise InvalidPackageError(
        f"{path}: a Triton model folder whose config names no backend or platform and whose version folders hold "
        f"no {', '.join(DEFAULT_FILES.values())}",
        hint='set backend: "python" or platform: "onnxruntime_onnx" / "tensorrt_plan" / "ensemble" in config.pbtxt',
    )


def served_versions(config: Any, versions: list[int]) -> list[int]:
    """The versions Triton loads under the config's version_policy (latest 1 when it sets none)."""
    policy = config.version_policy
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return list(versions)
    if choice == "specific":
        return sorted(set(policy.specific.versions))
    latest = policy.latest.num_versions if choice == "latest" else 1
    return list(versions[-max(1, latest) :])


def _check_versions(path: Path, folder_versions: list[int], served: list[int], backend: str, model_file: str) -> None:
    if not folder_versions:
        what = "an empty version folder (1/)" if backend == ENSEMBLE else f"its {model_file or 'model'} in 1/"
        raise InvalidPackageError(
            f"{path}: a Triton model folder needs a numbered version folder", hint=f"put {what} in the model folder"
        )
    missing = [v for v in served if v not in folder_versions]
    if missing:
        raise InvalidPackageError(
            f"{path / CONFIG_FILE}: version_policy serves version(s) {missing}, which have no folder here "
            f"(the folder has {folder_versions})",
            hint="add the version folders or change version_policy",
        )
    if backend == ENSEMBLE:
        return
    for v in served:
        if not (path / str(v) / model_file).exists():
            raise InvalidPackageError(
                f"{path / str(v) / model_file}: missing (version {v} is served, by the config's version_policy)",
                hint=f"put the {backend} model there as {model_file}, or change version_policy",
            )


def defines_auto_complete(source: str) -> bool:
    """Whether ``class TritonPythonModel`` defines ``auto_complete_config`` (read from the source, not run)."""
    try:
        tree = source_inspect.parse(source)
    except SyntaxError:
        return False
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TritonPythonModel":
            return any(
                isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == "auto_complete_config"
                for item in node.body
            )
    return False


def _completed_by_model(path: Path, config: Any, model_file: str, version: int, model_id: str) -> tuple[Any, str]:
    """Run the user's ``auto_complete_config`` once (a child process) when its class defines one, as Triton
    would at every load with auto-complete on: the config it returns is the one kept."""
    entry = path / str(version) / model_file
    try:
        source = entry.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidPackageError(f"{entry}: cannot be read ({exc})") from exc
    if not defines_auto_complete(source):
        return config, ""
    from controlplane.auto_complete import run_auto_complete

    start = ModelConfig()
    start.CopyFrom(config)
    start.name = model_id
    start.backend = PYTHON
    completed = run_auto_complete(entry, path, triton_config_json(start), model_id=model_id)
    result = ModelConfig()
    try:
        json_format.ParseDict(completed, result)
    except json_format.ParseError as exc:
        raise InvalidPackageError(
            f"model '{model_id}' ({entry}): auto_complete_config returned a config Triton would refuse: {exc}",
            hint="fix what auto_complete_config sets, or write the config in config.pbtxt",
        ) from exc
    return result, "auto_complete_config"


def _completed_from_onnx(path: Path, config: Any, version: int, model_file: str) -> tuple[Any, str]:
    """An ONNX model whose config declares no tensors: read from the file, as Triton's onnxruntime auto-complete
    would (dims without the first axis when the config batches)."""
    if config.input or config.output:
        return config, ""
    from converters.errors import ConversionError
    from converters.onnx_inspect import inspect_onnx

    onnx_path = path / str(version) / model_file
    try:
        sig = inspect_onnx(onnx_path)
    except ConversionError as exc:
        raise InvalidPackageError(str(exc)) from exc
    completed = ModelConfig()
    completed.CopyFrom(config)
    skip = 1 if config.max_batch_size > 0 else 0
    for target, tensors in ((completed.input, sig.inputs), (completed.output, sig.outputs)):
        for t in tensors:
            item = target.add(name=t.name, dims=list(t.dims[skip:]) or [1])
            item.data_type = model_config_pb2.DataType.Value(from_triton(t.dtype).triton)
    return completed, "the ONNX file"


def tensors_of(config: Any, which: str, where: Path) -> list[TensorSpec]:
    """A config's inputs or outputs as snoozeml's TensorSpec (dims without the batch axis, as in the config)."""
    items = config.input if which == "input" else config.output
    found = []
    for t in items:
        data_type = model_config_pb2.DataType.Name(t.data_type)
        if data_type == "TYPE_INVALID":
            raise InvalidPackageError(
                f"{where}: {which} '{t.name}' has no data_type", hint="set data_type: TYPE_FP32 (or the tensor's type)"
            )
        if not t.dims:
            raise InvalidPackageError(
                f"{where}: {which} '{t.name}' has no dims", hint="set dims (without the batch axis), e.g. dims: [ 4 ]"
            )
        try:
            found.append(TensorSpec(name=t.name, datatype=from_triton(data_type).wire, dims=list(t.dims)))
        except (ValueError, ValidationError) as exc:
            raise InvalidPackageError(f"{where}: {which} '{t.name}': {exc}") from exc
    return found


def check_config(config: Any, where: Path) -> None:
    """What snoozeml refuses in a user's config: fields it must set itself (reserved parameters)."""
    reserved = sorted(k for k in config.parameters if k.startswith(RESERVED_PARAMETER_PREFIX))
    if reserved:
        raise InvalidPackageError(
            f"{where}: parameters {reserved}: keys starting with '{RESERVED_PARAMETER_PREFIX}' are snoozeml's own "
            "(it writes snooze_publish to tell a publish from the one before, snooze_config_override to mark a "
            "client's config, snooze_generation to rebuild instances)",
            hint="rename these parameters",
        )
    if not config.input or not config.output:
        raise InvalidPackageError(
            f"{where}: the model declares no {'inputs' if not config.input else 'outputs'}; snoozeml serves models "
            "with at least one input and one output (their signature answers metadata calls while the model sleeps)",
            hint="declare them in config.pbtxt, or in auto_complete_config",
        )


def load_triton_folder(path: Path, files: list[str], *, model_id: str | None = None) -> ModelPackage:
    """Read and check a Triton model folder (auto-complete run where the model defines it); raises
    InvalidPackageError naming the file and the fix."""
    model_id = model_id or path.resolve().name
    written = read_config(path)
    had_config = (path / CONFIG_FILE).is_file()
    folder_versions = version_numbers(path)
    backend = _backend_of(written, path, folder_versions)
    model_file = "" if backend == ENSEMBLE else (written.default_model_filename or DEFAULT_FILES[backend])
    served = served_versions(written, folder_versions)
    _check_versions(path, folder_versions, served, backend, model_file)
    config, completed_by = written, ""
    newest = max(served) if served else 0
    if backend == PYTHON:
        config, completed_by = _completed_by_model(path, written, model_file, newest, model_id)
        _check_python_versions(path, served, model_file)
    elif backend == ONNXRUNTIME:
        config, completed_by = _completed_from_onnx(path, written, newest, model_file)
    if not had_config and not completed_by:
        raise InvalidPackageError(
            f"{path}: no {CONFIG_FILE}, and {model_file or 'the model'} defines no auto_complete_config to "
            "complete one (snoozeml's Triton runs with auto-complete off)",
            hint=f"write {CONFIG_FILE} (name, backend, max_batch_size, input, output)",
        )
    # Served versions may have changed with the completed config's policy (auto-complete may set it).
    served = served_versions(config, folder_versions)
    _check_versions(path, folder_versions, served, backend, model_file)
    where = path / CONFIG_FILE
    check_config(config, where)
    folder = TritonFolder(
        config=config,
        backend=backend,
        model_file=model_file,
        versions=tuple(folder_versions),
        served=tuple(served),
        written_name=written.name,
        had_config=had_config,
        completed_by=completed_by,
    )
    return ModelPackage(
        path,
        KIND_BY_BACKEND[backend],
        Manifest(),
        tensors_of(config, "input", where),
        tensors_of(config, "output", where),
        files,
        model_file=model_file or None,
        triton=folder,
    )


def _check_python_versions(path: Path, served: Iterable[int], model_file: str) -> None:
    """The wrapper takes the names it writes into a version folder: a folder already using one is refused."""
    for v in served:
        for taken in (f"{USER_MODULE}.py", RUNTIME_DIR):
            if (path / str(v) / taken).exists() and not (taken == f"{USER_MODULE}.py" and model_file == taken):
                raise InvalidPackageError(
                    f"{path / str(v) / taken}: snoozeml writes this name into the version folder (the moved "
                    f"{model_file} and the runtime that wraps it)",
                    hint=f"rename {taken} in version {v}",
                )


# ---------------------------------------------------------------------------------------------
# The deployment of a Triton model folder


def _device(kind: int) -> Device:
    name = model_config_pb2.ModelInstanceGroup.Kind.Name(kind)
    return {"KIND_CPU": Device.CPU, "KIND_GPU": Device.GPU}.get(name, Device.AUTO)


def _sequence(config: Any) -> SequenceSpec | None:
    if not config.HasField("sequence_batching"):
        return None
    seq = config.sequence_batching
    micros = seq.max_sequence_idle_microseconds
    oldest = seq.WhichOneof("strategy_choice") == "oldest"
    return SequenceSpec(
        strategy=SequenceStrategy.OLDEST if oldest else SequenceStrategy.DIRECT,
        max_sequence_idle_secs=micros / 1e6 if micros > 0 else DEFAULT_SEQUENCE_IDLE_SECS,
        max_candidate_sequences=(seq.oldest.max_candidate_sequences or None) if oldest else None,
    )


def triton_deployment(deployment: DeploymentSpec, package: ModelPackage) -> DeploymentSpec:
    """The deployment a Triton model folder is served with: batching, instances, device and sequences as its config
    says (the lifecycle reads them there); idle timeout, keep-alive, memory, max_instances and execution
    environment from the deployment. A setting the config already says, given too, is refused by name."""
    assert package.triton is not None
    where = f"model '{deployment.id}' ({package.path / CONFIG_FILE})"
    given = sorted(name for name in CONFIG_OWNED_SETTINGS if name in deployment.model_fields_set)
    if deployment.worker == Worker.PREFORKED:
        given.append("worker")
    if given:
        owned = ", ".join(f"{name} (config: {CONFIG_OWNED_SETTINGS.get(name, 'the python backend')})" for name in given)
        raise InvalidPackageError(
            f"{where}: deployment setting(s) {owned} do not apply to a Triton model folder: its config.pbtxt is kept "
            "as written and says them"
            + (
                '; worker = "preforked" runs snoozeml\'s custom models only (a Triton python model runs in its stub)'
                if "worker" in given
                else ""
            ),
            hint="set them in config.pbtxt and remove them from models.toml / the publish request",
        )
    if deployment.params:
        raise InvalidPackageError(
            f"{where}: params {sorted(deployment.params)} are given, but params are for snoozeml packages; a Triton "
            "model reads its config's parameters (args['model_config'])",
            hint="set them as parameters { key: ... value: { string_value: ... } } in config.pbtxt",
        )
    config = package.triton.config
    if deployment.execution_env_path and "EXECUTION_ENV_PATH" in config.parameters:
        raise InvalidPackageError(
            f"{where}: execution_env_path is given and the config sets parameter EXECUTION_ENV_PATH too",
            hint="keep one of them",
        )
    if deployment.execution_env_path and package.triton.backend != PYTHON:
        raise InvalidPackageError(
            f"{where}: execution_env_path applies to python models; this folder is {package.kind.value}",
            hint="remove execution_env_path for this model",
        )
    groups = list(config.instance_group)
    instances = groups[0].count if groups and groups[0].count > 0 else 1
    fields = deployment.model_dump()
    fields.update(
        max_batch_size=config.max_batch_size,
        max_batch_delay_ms=config.dynamic_batching.max_queue_delay_microseconds / 1000,
        instances=instances,
        device=_device(groups[0].kind) if groups else Device.CPU,
        sequence=_sequence(config),
    )
    if "max_instances" not in deployment.model_fields_set:
        fields["max_instances"] = max(deployment.max_instances, instances)
    try:
        return DeploymentSpec.model_validate(fields)
    except ValidationError as exc:
        message = format_validation_error(exc, where)
        if "max_sequence_idle_secs" in message:
            message += " (max_sequence_idle_secs: the config's sequence_batching.max_sequence_idle_microseconds)"
        raise InvalidPackageError(message, hint="change the deployment or the config so that they agree") from exc
