"""Model packages -> a generated Triton model repository.

Configs are built from jinja2 templates, parsed into Triton's own ``ModelConfig`` protobuf (any
mistake fails here, not at load time) and written as protobuf text. Every model folder is built in a
staging folder beside the repository and moved into place with a rename, so a failed render leaves
the repository exactly as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import platform
import re
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import Iterable, Iterator
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
from controlplane.spec import Device, ModelSpec, PackageKind, TensorSpec, python_specifier
from controlplane.warmup import warmup_plan, warmup_view

VERSION = "1"
RUNTIME_FILE = "snooze_runtime.json"
PACKAGE_SUBDIR = "package"
RUNTIME_SUBDIR = "python_backend"
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
    if name == "embedded":
        return embedded_target()
    if name == "full":
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
        "kind": "onnx" if spec.package.kind is PackageKind.ONNX else "custom",
        "entrypoint": manifest.entrypoint,
        "class_name": manifest.class_name,
        "onnx_file": spec.package.model_file,
        "tensor_format": manifest.tensor_format,
        "env": dict(manifest.env),
        "params": spec.params,
        "request_timeout_secs": manifest.request_timeout_secs,
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


def render_model(spec: ModelSpec, target: TritonTarget) -> RenderedModel:
    """Build one model folder in memory and validate its config against Triton's schema."""
    _check_python(spec, target)
    backend = _backend_for(spec, target)
    dep = spec.deployment
    batching = dep.max_batch_size > 0
    parameters = {}
    if backend == "python" and dep.execution_env_path:
        parameters["EXECUTION_ENV_PATH"] = dep.execution_env_path
    inputs = [_tensor_view(t, batching) for t in spec.package.inputs]
    # No warm-up for a stream (answers go through response senders) or a stateful model (a sample carries no
    # sequence and would start one): those pay their first inference on their first request.
    warmup = None if (backend == "python" and spec.decoupled) or dep.sequence is not None else warmup_plan(
        spec, inputs, native=backend != "python")
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
    text = _environment().get_template(f"{backend}.pbtxt.j2").render(m=view)
    config = parse_config(text, where=f"model '{spec.id}' (rendered config)")
    rendered = RenderedModel(spec.id, backend, config, text_format.MessageToString(config))
    package = spec.package
    if backend == "python":
        # An ONNX package needs only its model and weights (not its provenance or reports).
        served = package.files if package.kind is PackageKind.CUSTOM else [package.model_file, *package.external_data]
        for rel in served:
            rendered.copies.append((package.path / rel, f"{VERSION}/{PACKAGE_SUBDIR}/{rel}"))
        for src in _runtime_sources():
            rendered.copies.append((src, f"{VERSION}/{RUNTIME_SUBDIR}/{src.name}"))
        entry = _environment().get_template("python_model.py.j2").render(model_id=spec.id)
        rendered.writes[f"{VERSION}/model.py"] = entry.encode()
        rendered.writes[f"{VERSION}/{RUNTIME_FILE}"] = (json.dumps(runtime_config(spec), indent=2) + "\n").encode()
    else:
        # Native backends: the model file and its external-data files sit in the version folder.
        for rel in (package.model_file, *package.external_data):
            rendered.copies.append((package.path / rel, f"{VERSION}/{rel}"))
    if warmup is not None:
        rendered.writes.update(warmup.files)
    rendered.writes["config.pbtxt"] = rendered.config_text.encode()
    rendered.writes[DEPLOYMENT_FILE] = (json.dumps(deployment_record(spec, backend), indent=2) + "\n").encode()
    return rendered


def deployment_record(spec: ModelSpec, backend: str) -> dict[str, Any]:
    """Everything the control plane needs to know about a published model, without its package."""
    manifest = spec.package.manifest
    return {
        "format": 1,
        "deployment": spec.deployment.model_dump(mode="json"),
        "kind": spec.package.kind.value,
        "backend": backend,
        "inputs": [t.model_dump() for t in spec.package.inputs],
        "outputs": [t.model_dump() for t in spec.package.outputs],
        "params": spec.params,
        "metadata": manifest.metadata,
        "load_timeout_secs": manifest.load_timeout_secs,
        "request_timeout_secs": manifest.request_timeout_secs,
        "decoupled": spec.decoupled,
        "notes": list(spec.notes),
    }


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


# ---------------------------------------------------------------------------------------------
# Writing, atomically


INNER_STAGING = ".snooze-staging"


def _staging_roots(repo: Path) -> tuple[Path, Path]:
    return repo.parent / f".{repo.name}.staging", repo / INNER_STAGING


def _staging_root(repo: Path) -> Path:
    """Staging must be on the repository's filesystem (rename is atomic only there). Beside the
    repository where its parent is writable and on that filesystem, so Triton never sees it; else (the
    repository is a volume's mount root, as in the containers) a hidden folder inside it, which Triton
    lists in its index but never loads, and which snoozeml skips."""
    outside, inside = _staging_roots(repo)
    with contextlib.suppress(OSError):
        outside.mkdir(parents=True, exist_ok=True)
        if _same_filesystem(outside, repo):
            return outside
    inside.mkdir(parents=True, exist_ok=True)
    return inside


def _same_filesystem(a: Path, b: Path) -> bool:
    return a.stat().st_dev == b.stat().st_dev


def _materialise(rendered: RenderedModel, folder: Path) -> None:
    for src, rel in rendered.copies:
        dest = folder / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
    for rel, content in rendered.writes.items():
        dest = folder / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(content)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # filesystem or kernel without it
        return False
    raise OSError(err, os.strerror(err), str(b))


def _writer() -> str:
    """``<host>.<pid>``: who writes a staging folder. The repository may be shared by the nodes of a fleet
    (one filesystem, several machines), so a pid alone does not name a writer."""
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "localhost"
    return f"{host}.{os.getpid()}"


@contextlib.contextmanager
def repository_lock(repo: Path) -> Iterator[None]:
    """Serialise writers of one repository across processes and machines (flock on the shared filesystem)."""
    with open(_staging_root(Path(repo)) / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_model(rendered: RenderedModel, repo: Path) -> Path:
    """Write one model folder into ``repo`` atomically; an existing folder is replaced whole."""
    repo = Path(repo)
    repo.mkdir(parents=True, exist_ok=True)
    # <model>@<host>.<pid>.<random>: recover_staging() tells a killed writer's leftovers by host and pid.
    staging = Path(tempfile.mkdtemp(prefix=f"{rendered.model_id}@{_writer()}.", dir=_staging_root(repo)))
    final = repo / rendered.model_id
    try:
        _materialise(rendered, staging / "model")
        if final.exists():
            # One atomic swap where the kernel offers it: readers never see the model missing.
            if not _exchange(staging / "model", final):
                retired = staging / "retired"
                os.rename(final, retired)
                try:
                    os.rename(staging / "model", final)
                except OSError:
                    os.rename(retired, final)  # put the old model back: nothing changed
                    raise
        else:
            os.rename(staging / "model", final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def render_repository(specs: Iterable[ModelSpec], repo: Path, target: TritonTarget) -> list[Path]:
    """Render every model first (all-or-nothing validation), then write each one atomically."""
    rendered = [render_model(spec, target) for spec in specs]
    return [write_model(r, repo) for r in rendered]


def remove_model(repo: Path, model_id: str) -> bool:
    """Take a model folder out of the repository with one rename, then delete it."""
    final = Path(repo) / model_id
    if not final.exists():
        return False
    graveyard = _staging_root(Path(repo)) / f"{model_id}@{_writer()}.removed{uuid.uuid4().hex[:8]}"
    os.rename(final, graveyard)
    shutil.rmtree(graveyard, ignore_errors=True)
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_staging(repo: Path) -> list[str]:
    """Clean up after writers that were killed mid-write (their pid is in the staging folder's name).

    A killed publish leaves its staging folder (possibly large); one killed between its two renames
    also leaves the previous version in ``retired/`` with no model in the repository: that version is
    put back. Folders of live processes, and names not written by this module, are left alone.
    Returns the names of the folders removed.
    """
    removed = []
    for root in _staging_roots(Path(repo)):
        if root.is_dir():
            removed += _recover_in(root, Path(repo))
    return removed


def _recover_in(root: Path, repo: Path) -> list[str]:
    removed = []
    host = _writer().rpartition(".")[0]
    for entry in sorted(p for p in root.iterdir() if p.is_dir()):
        model_id, at, writer = entry.name.partition("@")
        if at:  # <model>@<host>.<pid>.<random>: only this host's writers can be checked from here
            writer_host, _, rest = writer.rpartition(".")
            writer_host, _, pid = writer_host.rpartition(".")
            if writer_host != host:
                continue
        else:  # written before fleets: <model>.<pid>.<random>
            model_id, _, rest = entry.name.rpartition(".")
            model_id, _, pid = model_id.rpartition(".")
        if not model_id or not pid.isdigit() or not rest or _pid_alive(int(pid)):
            continue
        retired, final = entry / "retired", Path(repo) / model_id
        if retired.is_dir() and not final.exists():
            os.rename(retired, final)
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry.name)
    return removed
