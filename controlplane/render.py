"""Model packages -> a generated Triton model repository.

Configs are built from jinja2 templates, parsed into Triton's own ``ModelConfig`` protobuf (any
mistake fails here, not at load time) and written as protobuf text. A render is a ``RenderedModel`` in
memory; the store (``controlplane.store.transactions``) writes it into the repository with one rename,
so a failed render leaves the repository exactly as it was.
"""

from __future__ import annotations

import json
import platform
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from controlplane.dtypes import parse_dtype
from controlplane.errors import InvalidPackageError
from controlplane.modes import TargetName, Worker
from controlplane.spec import Device, ModelPackage, ModelSpec, PackageKind, TensorSpec, python_specifier
from controlplane.warmup_samples import warmup_plan, warmup_view
from converters.files import PYTHON_MODEL_FILE
from python_backend.spec import SPEC_FILE

VERSION = "1"
PACKAGE_SUBDIR = "package"
RUNTIME_SUBDIR = "python_backend"
# The config parameter that holds a publish's token (store/transactions.py writes it): what Triton reports of the
# config it loaded tells the publish it came from.
PUBLISH_PARAMETER = "snooze_publish"
DEPLOYMENT_FILE = "snooze_deployment.json"  # what was published; lets a restarted control plane recover


@dataclass(frozen=True)
class TritonTarget:
    """What a Triton build can run: its backends and the Python of its python backend."""

    name: str
    backends: frozenset[str]
    python_version: str  # "3.11"; python-backend models run on this interpreter

    def has(self, backend: str) -> bool:
        return backend in self.backends


def embedded_target(backends: Iterable[str] = ("python",)) -> TritonTarget:
    """The Triton in the nvidia-pytriton wheel: python backend only, this interpreter's Python."""
    return TritonTarget("embedded", frozenset(backends), platform.python_version().rsplit(".", 1)[0])


# The official nvcr.io/nvidia/tritonserver:24.10-py3 image (Triton 2.51): its python backend embeds 3.10.
FULL_TARGET = TritonTarget("full", frozenset({"python", "onnxruntime", "tensorrt"}), "3.10")


def target_by_name(name: str) -> TritonTarget:
    if name == TargetName.EMBEDDED:
        return embedded_target()
    if name == TargetName.FULL:
        return FULL_TARGET
    raise InvalidPackageError(f"unknown target {name!r}", hint="use 'embedded' or 'full'")


@dataclass
class RenderedModel:
    """A model folder ready to be written: config text plus the files to copy or write."""

    model_id: str
    backend: str  # python | onnxruntime | tensorrt
    config: model_config_pb2.ModelConfig
    config_text: str
    copies: list[tuple[Path, str]] = field(default_factory=list)  # (source, relative destination)
    writes: dict[str, bytes] = field(default_factory=dict)  # relative destination -> content
    # relative destination -> content that is the same in every model of its kind (the python entry and its
    # bytecode): linked from one file beside the staging folders (a file made costs 0.3-0.5 ms here, a link 9 us)
    shared: dict[str, bytes] = field(default_factory=dict)
    dirs: list[str] = field(default_factory=list)  # relative folders made even when empty (an ensemble's 1/)


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    templates = resources.files("model_repository_templates")
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(lambda name: templates.joinpath(name).read_text(encoding="utf-8")),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _tensor_view(t: TensorSpec, batching: bool) -> dict[str, Any]:
    dims = list(t.dims)
    # Triton needs a non-empty dims: a rank-0 tensor is [1] on the wire. Batching, `reshape: []` hands the
    # model [batch]; without batching Triton 2.51 refuses an empty reshape ("scalar tensors are not supported"),
    # so the backend converts: the ONNX Runtime backend feeds a rank-0 ORT input from dims [1] (its scalar
    # support, onnxruntime_backend PR 213, 23.10+), the python runtime reshapes [1] <-> [] itself.
    reshape = not dims and batching
    return {"name": t.name, "triton_type": parse_dtype(t.datatype).triton, "dims": dims or [1], "reshape": reshape}


def _backend_for(spec: ModelSpec, target: TritonTarget) -> str:
    kind = spec.package.kind
    if kind is PackageKind.TENSORRT:
        if not target.has("tensorrt"):
            raise InvalidPackageError(
                f"model '{spec.id}': a TensorRT plan needs a Triton with the tensorrt backend and a GPU; "
                f"the '{target.name}' target has {sorted(target.backends)}",
                hint="serve it with --target full on a GPU machine, or publish the ONNX model instead",
            )
        return "tensorrt"
    if kind is PackageKind.ONNX and target.has("onnxruntime"):
        return "onnxruntime"
    return "python"


def _check_python(spec: ModelSpec, target: TritonTarget) -> None:
    wanted = spec.package.manifest.python
    if wanted and not python_specifier(wanted).contains(f"{target.python_version}.0"):
        raise InvalidPackageError(
            f"model '{spec.id}': the package needs Python {wanted} but the '{target.name}' target's python "
            f"backend runs {target.python_version}",
            hint="widen 'python' in snooze_model.json, or give the model an execution_env_path "
            "(a conda-pack environment with the right Python)",
        )


def _sequence_view(dep: Any) -> dict[str, Any] | None:
    seq = dep.sequence
    if seq is None:
        return None
    return {
        "strategy": seq.strategy,
        "max_idle_us": int(round(seq.max_sequence_idle_secs * 1_000_000)),
        "max_candidates": seq.max_candidate_sequences,
        "max_queue_delay_us": int(round(dep.max_batch_delay_ms * 1000)),
    }


def runtime_config(spec: ModelSpec) -> dict[str, Any]:
    """The snooze_runtime.json of a python-backend model (see docs/internals.md)."""
    manifest = spec.package.manifest
    return {
        "format": 1,
        "model_id": spec.id,
        "kind": PackageKind.ONNX if spec.package.kind is PackageKind.ONNX else PackageKind.CUSTOM,
        "entrypoint": manifest.entrypoint,
        "class_name": manifest.class_name,
        "onnx_file": spec.package.model_file,
        "tensor_format": manifest.tensor_format,
        "env": dict(manifest.env),
        "params": spec.params,
        "request_timeout_secs": manifest.request_timeout_secs,
        "load_timeout_secs": manifest.load_timeout_secs,  # bounds a wake from doze, which runs inside the stub
        "worker": spec.deployment.worker,
        "preload": list(manifest.preload),
        "decoupled": spec.decoupled,
        "sequence": spec.deployment.sequence is not None,
        "max_batch_size": spec.deployment.max_batch_size,
        "inputs": [t.model_dump() for t in spec.package.inputs],
        "outputs": [t.model_dump() for t in spec.package.outputs],
    }


def _runtime_sources() -> list[Path]:
    from python_backend import runtime_files

    return [Path(p) for p in runtime_files()]


def _model_files(package: ModelPackage) -> list[str]:
    """An ONNX or TensorRT package's model file and its external-data files."""
    assert package.model_file is not None, f"{package.path}: a {package.kind} package is loaded with its model file"
    return [package.model_file, *package.external_data]


def _template(name: str, **values: Any) -> str:
    return _environment().get_template(name).render(**values)


@lru_cache(maxsize=64)
def python_entry(version: str, *, preforked: bool = False) -> dict[str, bytes]:
    """A python-backend model's ``<version>/model.py``, which runs the snoozeml runtime, and the ``__pycache__`` that
    keeps its folder unwritten (``no_bytecode``): the same for every model (it names none), so rendered once and
    linked into each model's folder (``RenderedModel.shared``). ``preforked``: it also imports the prefork machinery."""
    source = _environment().get_template("python_model.py.j2").render(model_id="", preforked=preforked)
    return {f"{version}/{PYTHON_MODEL_FILE}": source.encode(), **no_bytecode(version)}


def no_bytecode(version: str) -> dict[str, bytes]:
    """An empty file named ``__pycache__`` in a python model's version folder: no Python can write bytecode there (the
    import of the entry file compiles it, a few lines, and its attempt to cache the bytecode fails quietly, as
    Python's imports do). The stub's Python runs isolated (``PYTHONDONTWRITEBYTECODE`` does nothing), and a file
    written into the model's folder is a change of the model's files to Triton: it loads the model anew (a second set
    of instances, the first ended) when a load next names it. Rendered bytecode covered only the control plane's
    Python (a stub of another version, 3.10 in the official image, wrote its own beside it) and cost a folder per
    model. What the entry imports after it caches its bytecode outside the repository (``_bytecode.py.j2``)."""
    return {f"{version}/__pycache__": b""}


def render_triton_folder(spec: ModelSpec, target: TritonTarget) -> RenderedModel:
    """A Triton model folder: its own config, kept but for the fields snoozeml owns (controlplane/render_triton.py)."""
    from controlplane.render_triton import triton_config, triton_files

    config, backend, notes = triton_config(spec, target)
    text = text_format.MessageToString(config)
    config = parse_config(text, where=f"model '{spec.id}' ({spec.package.path / 'config.pbtxt'})")
    rendered = RenderedModel(spec.id, backend, config, text)
    triton_files(spec, backend, rendered, _runtime_sources() if backend == "python" else [], _template)
    rendered.writes["config.pbtxt"] = text.encode()
    record = deployment_record(spec, backend, notes=notes)
    rendered.writes[DEPLOYMENT_FILE] = (json.dumps(record, indent=2) + "\n").encode()
    return rendered


def render_model(spec: ModelSpec, target: TritonTarget) -> RenderedModel:
    """Build one model folder in memory and validate its config against Triton's schema."""
    if spec.package.triton is not None:
        return render_triton_folder(spec, target)
    _check_python(spec, target)
    backend = _backend_for(spec, target)
    dep = spec.deployment
    if backend != "python" and dep.worker == Worker.PREFORKED:
        raise InvalidPackageError(
            f"model '{spec.id}': worker = \"preforked\" runs the model in the python backend, but on the "
            f"'{target.name}' target this {spec.package.kind.value} model runs in Triton's {backend} backend",
            hint='remove worker = "preforked" for this model, or serve it on the embedded target',
        )
    batching = dep.max_batch_size > 0
    parameters = {}
    if backend == "python" and dep.execution_env_path:
        parameters["EXECUTION_ENV_PATH"] = dep.execution_env_path
    inputs = [_tensor_view(t, batching) for t in spec.package.inputs]
    # No warm-up for a stream (answers go through response senders) or a stateful model (a sample carries no
    # sequence and would start one): those pay their first inference on their first request.
    warmup = (
        None
        if (backend == "python" and spec.decoupled) or dep.sequence is not None
        else warmup_plan(spec, inputs, native=backend != "python")
    )
    view = {
        "id": spec.id,
        "max_batch_size": dep.max_batch_size,
        "max_queue_delay_us": int(round(dep.max_batch_delay_ms * 1000)),
        "inputs": inputs,
        "outputs": [_tensor_view(t, batching) for t in spec.package.outputs],
        "instance_kind": {Device.CPU: "KIND_CPU", Device.GPU: "KIND_GPU", Device.AUTO: "KIND_AUTO"}[dep.device],
        "instances": dep.instances,
        "parameters": parameters,
        "onnx_tensorrt": dep.onnx_tensorrt,
        "fp16": dep.fp16,
        "warmup": warmup_view(warmup),
        "decoupled": backend == "python" and spec.decoupled,
        "sequence": _sequence_view(dep),
    }
    config = _rendered_config(backend, view, where=f"model '{spec.id}' (rendered config)")
    rendered = RenderedModel(spec.id, backend, config, text_format.MessageToString(config))
    package = spec.package
    if backend == "python":
        # An ONNX package needs only its model and weights (not its provenance or reports).
        served = package.files if package.kind is PackageKind.CUSTOM else _model_files(package)
        for rel in served:
            rendered.copies.append((package.path / rel, f"{VERSION}/{PACKAGE_SUBDIR}/{rel}"))
        for src in _runtime_sources():
            rendered.copies.append((src, f"{VERSION}/{RUNTIME_SUBDIR}/{src.name}"))
        rendered.shared.update(python_entry(VERSION, preforked=dep.worker == Worker.PREFORKED))
        rendered.writes[f"{VERSION}/{SPEC_FILE}"] = (json.dumps(runtime_config(spec), indent=2) + "\n").encode()
    else:
        # Native backends: the model file and its external-data files sit in the version folder.
        for rel in _model_files(package):
            rendered.copies.append((package.path / rel, f"{VERSION}/{rel}"))
    if warmup is not None:
        rendered.writes.update(warmup.files)
    rendered.writes["config.pbtxt"] = rendered.config_text.encode()
    rendered.writes[DEPLOYMENT_FILE] = (json.dumps(deployment_record(spec, backend), indent=2) + "\n").encode()
    return rendered


def deployment_record(spec: ModelSpec, backend: str, *, notes: Iterable[str] | None = None) -> dict[str, Any]:
    """Everything the control plane needs to know about a published model, without its package. ``notes``: what
    publishing decided (default: the spec's)."""
    manifest = spec.package.manifest
    triton = spec.package.triton
    return {
        "format": 1,
        "deployment": spec.deployment.model_dump(mode="json"),
        "kind": spec.package.kind,
        "backend": backend,
        "inputs": [t.model_dump() for t in spec.package.inputs],
        "outputs": [t.model_dump() for t in spec.package.outputs],
        "params": spec.params,
        "metadata": manifest.metadata,
        "load_timeout_secs": manifest.load_timeout_secs,
        "request_timeout_secs": manifest.request_timeout_secs,
        "decoupled": spec.decoupled,
        "notes": list(spec.notes if notes is None else notes),
        "ensemble_steps": [list(step) for step in triton.ensemble_steps] if triton is not None else [],
        # The versions Triton serves (a Triton folder's version_policy; a package is version 1).
        "versions": [str(v) for v in triton.served] if triton is not None else [VERSION],
    }


_NAME_PLACEHOLDER = "snooze-model-name-placeholder"
_PARSED_KEPT = 64
_parsed: dict[str, bytes] = {}  # a rendered config's text, its name a placeholder -> the config parsed (serialized)
_parsed_lock = threading.Lock()  # publishes run in worker threads


def _rendered_config(backend: str, view: dict[str, Any], *, where: str) -> model_config_pb2.ModelConfig:
    """The template's config for ``view``, parsed and validated. Models of one signature and deployment render the
    same text but for their name: parsed once (10,000 packages: the parse was a fifth of a publish), each copy named
    after its model. A template that names the model anywhere else is parsed per model."""
    template = _environment().get_template(f"{backend}.pbtxt.j2")
    text = template.render(m={**view, "id": _NAME_PLACEHOLDER})
    if text.count(_NAME_PLACEHOLDER) != 1:
        return parse_config(template.render(m=view), where=where)
    with _parsed_lock:
        kept = _parsed.get(text)
    if kept is None:
        kept = parse_config(text, where=where).SerializeToString()
        with _parsed_lock:
            if len(_parsed) >= _PARSED_KEPT:
                _parsed.pop(next(iter(_parsed)))
            _parsed[text] = kept
    config = model_config_pb2.ModelConfig.FromString(kept)
    config.name = view["id"]
    return config


def parse_config(text: str, *, where: str) -> model_config_pb2.ModelConfig:
    """Parse protobuf text into Triton's ModelConfig; raise InvalidPackageError naming ``where``."""
    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise InvalidPackageError(f"{where}: not a valid Triton ModelConfig: {exc}") from exc
    if not config.input or not config.output:
        raise InvalidPackageError(f"{where}: a model needs at least one input and one output")
    return config
