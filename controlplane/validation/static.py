"""`snoozectl validate`'s static checks of one model folder: nothing is loaded, and package code runs only in
the import probe's child processes (``controlplane/package_check.py``). The config parses as Triton's
``ModelConfig`` and names its folder, version folders hold the file the backend needs, ONNX graphs agree with
their configs, python-backend models agree with their runtime spec and import without an ML framework."""

from __future__ import annotations

import re
from pathlib import Path

from controlplane.errors import InvalidPackageError
from controlplane.package_check import ProbePool
from controlplane.render import (
    DEPLOYMENT_FILE,
    TritonTarget,
    parse_config,
)
from controlplane.validation.model_folder import ModelFolder
from controlplane.validation.report import CheckResult, Recorder
from controlplane.validation.static_onnx import check_onnx
from controlplane.validation.static_python import check_python
from controlplane.warmup_samples import WARMUP_DIR
from converters.files import ONNX_FILE, PLAN_FILE, PYTHON_MODEL_FILE

# platform -> backend, and the file Triton looks for when the config names none.
PLATFORM_BACKENDS = {
    "onnxruntime_onnx": "onnxruntime",
    "tensorrt_plan": "tensorrt",
    "pytorch_libtorch": "pytorch",
    "tensorflow_graphdef": "tensorflow",
    "tensorflow_savedmodel": "tensorflow",
    "ensemble": "ensemble",
}
# Backends every Triton has (in its core): an ensemble's steps run on theirs.
CORE_BACKENDS = frozenset({"ensemble"})
_DEFAULT_FILES = {
    "python": PYTHON_MODEL_FILE,
    "onnxruntime": ONNX_FILE,
    "tensorrt": PLAN_FILE,
    "pytorch": "model.pt",
    "tensorflow_graphdef": "model.graphdef",
    "tensorflow_savedmodel": "model.savedmodel",
}
_VERSION_RE = re.compile(r"[1-9][0-9]*")


def _check_config(m: ModelFolder) -> None:
    path = m.path / "config.pbtxt"
    rel = m.rel(path)
    if not path.is_file():
        m.rec.fail(
            "config",
            "no config.pbtxt",
            file=rel,
            fix="re-render the repository (snoozectl render / publish); Triton runs with "
            "--disable-auto-complete-config and needs a complete config",
        )
        return
    try:
        m.config = parse_config(path.read_text(encoding="utf-8"), where=rel)
    except (InvalidPackageError, UnicodeDecodeError) as exc:
        problem = exc.message if isinstance(exc, InvalidPackageError) else f"not UTF-8 text ({exc})"
        m.rec.fail(
            "config",
            problem,
            file=rel,
            fix="correct the protobuf text (see Triton's model_config.proto) or re-render the model",
        )
        return
    m.rec.ok("config", "parses as Triton ModelConfig", rel)
    name = m.config.name
    if name and name != m.name:
        m.rec.fail(
            "name",
            f"config name '{name}' does not match its folder '{m.name}'",
            file=rel,
            fix=f"set name: \"{m.name}\" in config.pbtxt or rename the folder to '{name}'",
        )
    else:
        m.rec.ok("name", f"name matches folder '{m.name}'", rel)
    _resolve_backend(m, rel)


def _resolve_backend(m: ModelFolder, rel: str) -> None:
    cfg = m.config
    backend = cfg.backend or PLATFORM_BACKENDS.get(cfg.platform)
    if not backend:
        what = f"platform '{cfg.platform}' is not known" if cfg.platform else "names no backend or platform"
        m.rec.fail(
            "backend",
            f"the config {what}",
            file=rel,
            fix='set backend: "python" or platform: "onnxruntime_onnx" / "tensorrt_plan"',
        )
        return
    m.backend = backend
    default = _DEFAULT_FILES.get(cfg.platform) or _DEFAULT_FILES.get(backend)
    m.model_file = cfg.default_model_filename or default


def _check_versions(m: ModelFolder) -> None:
    dirs = sorted(
        p for p in m.path.iterdir() if p.is_dir() and not p.name.startswith((".", "__")) and p.name != WARMUP_DIR
    )
    bad = [p for p in dirs if not _VERSION_RE.fullmatch(p.name)]
    for p in bad:
        m.rec.fail(
            "versions",
            f"folder '{p.name}' is not a version number; Triton ignores it",
            file=m.rel(p),
            fix="name version folders 1, 2, ... (no leading zero) or move the folder out of the model",
        )
    m.versions = sorted((p for p in dirs if p not in bad), key=lambda p: int(p.name))
    if not m.versions:
        m.rec.fail(
            "versions",
            "no version folder",
            file=m.rel(m.path),
            fix="put the model files in a numbered folder (e.g. 1/) or re-render the model",
        )
    elif not bad:
        m.rec.ok("versions", f"version(s) {', '.join(p.name for p in m.versions)}", m.rel(m.path))


def _check_model_files(m: ModelFolder) -> None:
    if not m.backend or not m.versions:
        return
    if m.backend == "ensemble":
        steps = ", ".join(step.model_name for step in m.config.ensemble_scheduling.step) or "none"
        m.rec.ok("model_file", f"an ensemble (steps: {steps}): its version folders hold no file", m.rel(m.path))
        return
    if m.model_file is None:
        m.rec.skip("model_file", f"backend '{m.backend}': which file it needs is not known to snoozeml")
        return
    for version in m.versions:
        path = version / m.model_file
        if not path.exists():
            fix = (
                "copy the TensorRT engine there (built for this GPU and TensorRT version)"
                if m.backend == "tensorrt"
                else "re-render the model (snoozectl render / publish)"
            )
            m.rec.fail(
                "model_file",
                f"backend '{m.backend}' needs {m.model_file} in version {version.name}",
                file=m.rel(path),
                fix=fix,
            )
        else:
            m.rec.ok("model_file", f"{m.model_file} present", m.rel(path))
    if m.backend == "tensorrt":
        m.rec.ok(
            "gpu_only",
            "TensorRT plan: GPU-only, tied to the GPU's compute capability and TensorRT version it was built with",
            m.rel(m.path / "config.pbtxt"),
        )


def _check_target(m: ModelFolder, target: TritonTarget) -> None:
    if not m.backend:
        return
    if target.has(m.backend) or m.backend in CORE_BACKENDS:
        m.rec.ok("target", f"backend '{m.backend}' is available on target '{target.name}'")
        return
    extra = " and a GPU" if m.backend == "tensorrt" else ""
    m.rec.skip(
        "target",
        f"backend '{m.backend}' is not on target '{target.name}' "
        f"({sorted(target.backends)}): it needs a Triton with the {m.backend} backend{extra}; "
        "not loaded here",
    )


def _check_deployment_record(m: ModelFolder) -> None:
    path = m.path / DEPLOYMENT_FILE
    if not path.exists():
        return
    from controlplane.store import PublishedModel

    rel = m.rel(path)
    try:
        record = PublishedModel.read(m.path)
    except Exception as exc:  # JSON, KeyError, pydantic: any of them means the record is unreadable
        m.rec.fail(
            "deployment_record",
            f"unreadable ({type(exc).__name__}: {exc})",
            file=rel,
            fix="re-render the model; the control plane recovers published models from this file",
        )
        return
    if m.backend and record.backend != m.backend:
        m.rec.fail(
            "deployment_record",
            f"records backend '{record.backend}', config.pbtxt is '{m.backend}'",
            file=rel,
            fix="re-render the model",
        )
        return
    m.rec.ok("deployment_record", f"{DEPLOYMENT_FILE} readable", rel)


def check_model_static(
    repo: Path, folder: Path, target: TritonTarget, probes: ProbePool | None = None
) -> list[CheckResult]:
    """All static checks of one model folder; imports go to ``probes`` (default: a probe of its own)."""
    if probes is None:
        with ProbePool(1) as own:
            return check_model_static(repo, folder, target, own)
    m = ModelFolder(Path(repo), Path(folder), Recorder(Path(folder).name), probes=probes)
    _check_config(m)
    if m.config is None:
        return m.rec.results
    _check_versions(m)
    _check_model_files(m)
    _check_target(m, target)
    if m.backend == "onnxruntime":
        for version in m.versions:
            if m.model_file is not None and (version / m.model_file).is_file():
                check_onnx(m, version / m.model_file)
    elif m.backend == "python":
        check_python(m)
    _check_deployment_record(m)
    return m.rec.results
