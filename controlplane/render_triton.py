"""A Triton model folder -> its folder in the generated repository: the user's config kept as written, the few
fields snoozeml must own changed (each said in the model's notes: publish output and status), the files copied.

What snoozeml owns, and why:
- ``name``: the model id (Triton names a model by its folder; the repository's folder is the id).
- a python model's ``<version>/model.py``: the generated wrapper (python_backend/triton_wrapper.py) that runs the
  user's file, moved beside it unchanged, inside the lifecycle; so ``default_model_filename`` is cleared.
- an ONNX model on a Triton without the onnxruntime backend (the embedded one): ``backend: "python"`` running
  snoozeml's ONNX runner (onnxruntime in the python backend), ``platform``, ``default_model_filename`` and
  ``optimization`` cleared (they are the onnxruntime backend's), everything else kept: instance groups,
  dynamic/sequence batching, max_batch_size, model_warmup, version_policy.
- the ``snooze_publish`` parameter, added by the store (controlplane/store/transactions.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from controlplane.errors import InvalidPackageError
from controlplane.modes import Worker
from controlplane.spec import ModelSpec, PackageKind
from controlplane.spec.triton_folder import (
    CONFIG_FILE,
    ENSEMBLE,
    ONNXRUNTIME,
    PLATFORM_BY_BACKEND,
    PYTHON,
    TENSORRT,
    USER_MODULE,
    TritonFolder,
)
from converters.files import PYTHON_MODEL_FILE
from python_backend.spec import SPEC_FILE

# Said for every Triton python model: the promises of snoozeml packages that do not hold for code run as written.
PYTHON_LIMITS = (
    "request_timeout_secs does not apply: execute is the model's own code, run as written (Triton's python "
    "backend sets no time limit either), so a request that hangs holds its instance",
    "warm-up: the config's model_warmup runs at load, as on Triton; snoozeml's generated and learned warm-ups "
    "do not apply",
)


def _owned_name(config: Any, folder: TritonFolder, model_id: str, notes: list[str]) -> None:
    if folder.written_name and folder.written_name != model_id:
        notes.append(
            f"name: '{model_id}' (config.pbtxt says '{folder.written_name}'): a model is named by its id, as Triton "
            "names it by its folder"
        )
    config.name = model_id


def _target_backend(spec: ModelSpec, folder: TritonFolder, target: Any) -> str:
    """The backend the folder runs on there; a plan without TensorRT is refused, an ONNX model without
    onnxruntime runs on the python backend."""
    if folder.backend == TENSORRT and not target.has("tensorrt"):
        raise InvalidPackageError(
            f"model '{spec.id}': a TensorRT plan needs a Triton with the tensorrt backend and a GPU; the "
            f"'{target.name}' target has {sorted(target.backends)}",
            hint="serve it with --target full on a GPU machine, or publish the ONNX model instead",
        )
    if folder.backend == ONNXRUNTIME and not target.has(ONNXRUNTIME):
        return PYTHON
    return folder.backend


def _onnx_on_python(config: Any, notes: list[str], target_name: str) -> None:
    """An ONNX model's config for the python backend's ONNX runner: the onnxruntime backend's fields go."""
    was = f"platform {config.platform}" if config.platform else f"backend {config.backend}"
    notes.append(
        f"backend: python (config.pbtxt says {was}): the '{target_name}' Triton has no onnxruntime backend, so the "
        "ONNX file runs on snoozeml's ONNX runner (onnxruntime in the python backend) with this config's instance "
        "groups, batching, max_batch_size and model_warmup"
    )
    cleared = [
        name
        for name, present in (
            ("default_model_filename", bool(config.default_model_filename)),
            ("optimization", config.HasField("optimization")),
        )
        if present
    ]
    config.platform = ""
    config.default_model_filename = ""
    config.ClearField("optimization")
    config.backend = PYTHON
    if cleared:
        notes.append(f"{', '.join(cleared)}: cleared (the onnxruntime backend's; the ONNX runner does not read them)")


def triton_config(spec: ModelSpec, target: Any) -> tuple[Any, str, list[str]]:
    """The folder's config as published on ``target``: (ModelConfig, backend, notes on what changed)."""
    folder = spec.package.triton
    assert folder is not None
    config = model_config_pb2.ModelConfig()
    config.CopyFrom(folder.config)
    notes = list(spec.notes)
    _owned_name(config, folder, spec.id, notes)
    backend = _target_backend(spec, folder, target)
    if folder.backend == ONNXRUNTIME and backend == PYTHON:
        _onnx_on_python(config, notes, target.name)
    elif folder.backend == PYTHON:
        config.backend = PYTHON
        if config.default_model_filename:
            notes.append(
                f"default_model_filename: cleared (was '{config.default_model_filename}'): the model's file runs "
                f"as {USER_MODULE}.py beside snoozeml's generated model.py"
            )
            config.default_model_filename = ""
        notes.extend(PYTHON_LIMITS)
    elif not config.backend and not config.platform:
        config.platform = PLATFORM_BY_BACKEND[folder.backend]  # what the version folders said
    if spec.deployment.execution_env_path:
        config.parameters["EXECUTION_ENV_PATH"].string_value = spec.deployment.execution_env_path
        notes.append("parameters EXECUTION_ENV_PATH: the deployment's execution_env_path")
    return config, backend, notes


def _version_files(spec: ModelSpec) -> dict[int, list[str]]:
    """Each version folder's files, relative to the version folder."""
    folder = spec.package.triton
    assert folder is not None
    found: dict[int, list[str]] = {v: [] for v in folder.versions}
    for rel in spec.package.files:
        head, _, rest = rel.partition("/")
        if rest and head.isdigit() and int(head) in found:
            found[int(head)].append(rest)
    return found


def triton_files(spec: ModelSpec, backend: str, rendered: Any, runtime_sources: list[Path], entry: Any) -> None:
    """Fill ``rendered`` (copies, writes, folders) with the folder's files as served on ``backend``.

    ``entry(template, **values)`` renders a template; ``runtime_sources`` is the python_backend runtime."""
    from controlplane.render import PACKAGE_SUBDIR, RUNTIME_SUBDIR, no_bytecode, python_entry, runtime_config

    package = spec.package
    folder = package.triton
    assert folder is not None
    per_version = _version_files(spec)
    for rel in package.files:  # the model folder's own files outside its versions (warmup/, labels, ...)
        head = rel.partition("/")[0]
        if not (head.isdigit() and int(head) in per_version) and rel != CONFIG_FILE:
            rendered.copies.append((package.path / rel, rel))
    for version, files in per_version.items():
        rendered.dirs.append(str(version))  # an ensemble's (or any) empty version folder is kept
        if backend == PYTHON and folder.backend == ONNXRUNTIME:
            for rel in files:
                rendered.copies.append((package.path / str(version) / rel, f"{version}/{PACKAGE_SUBDIR}/{rel}"))
            runtime = {**runtime_config(spec), "kind": PackageKind.ONNX.value, "onnx_file": folder.model_file}
            rendered.writes[f"{version}/{SPEC_FILE}"] = (json.dumps(runtime, indent=2) + "\n").encode()
            preforked = spec.deployment.worker == Worker.PREFORKED
            rendered.shared.update(python_entry(str(version), preforked=preforked))
        elif backend == PYTHON:
            for rel in files:
                dest = f"{USER_MODULE}.py" if rel == folder.model_file else rel
                rendered.copies.append((package.path / str(version) / rel, f"{version}/{dest}"))
            if folder.model_file in files:
                wrapper = entry("triton_python_model.py.j2", model_id=spec.id, user_module=USER_MODULE)
                rendered.writes[f"{version}/{PYTHON_MODEL_FILE}"] = wrapper.encode()
                rendered.shared.update(no_bytecode(str(version)))
        else:
            for rel in files:
                rendered.copies.append((package.path / str(version) / rel, f"{version}/{rel}"))
            continue
        for src in runtime_sources:
            rendered.copies.append((src, f"{version}/{RUNTIME_SUBDIR}/{src.name}"))


def config_text(config: Any) -> str:
    return text_format.MessageToString(config)


__all__ = ["ENSEMBLE", "PYTHON_LIMITS", "config_text", "triton_config", "triton_files"]
