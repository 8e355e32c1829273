"""`snoozectl validate`'s static checks of one model folder: nothing is loaded, and package code runs only in
the import probe's child processes (``controlplane/package_check.py``). The config parses as Triton's
``ModelConfig`` and names its folder, version folders hold the file the backend needs, ONNX graphs agree with
their configs, python-backend models agree with their runtime spec and import without an ML framework."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controlplane.dtypes import from_triton
from controlplane.errors import InvalidPackageError
from controlplane.package_check import IMPORT_TIMEOUT_SECS, ProbePool
from controlplane.render import (
    DEPLOYMENT_FILE,
    PACKAGE_SUBDIR,
    TritonTarget,
    parse_config,
)
from controlplane.validation.report import CheckResult, Recorder
from controlplane.warmup_samples import WARMUP_DIR
from converters.files import ONNX_FILE, PLAN_FILE, PYTHON_MODEL_FILE
from python_backend.spec import SPEC_FILE, RuntimeKind

# platform -> backend, and the file Triton looks for when the config names none.
PLATFORM_BACKENDS = {
    "onnxruntime_onnx": "onnxruntime",
    "tensorrt_plan": "tensorrt",
    "pytorch_libtorch": "pytorch",
    "tensorflow_graphdef": "tensorflow",
    "tensorflow_savedmodel": "tensorflow",
}
_DEFAULT_FILES = {
    "python": PYTHON_MODEL_FILE,
    "onnxruntime": ONNX_FILE,
    "tensorrt": PLAN_FILE,
    "pytorch": "model.pt",
    "tensorflow_graphdef": "model.graphdef",
    "tensorflow_savedmodel": "model.savedmodel",
}
_VERSION_RE = re.compile(r"[1-9][0-9]*")


@dataclass
class _ModelFolder:
    repo: Path
    path: Path
    rec: Recorder
    config: Any = None  # model_config_pb2.ModelConfig once parsed
    backend: str | None = None
    model_file: str | None = None
    versions: list[Path] = field(default_factory=list)
    probes: Any = None  # the ProbePool that imports packages in child processes

    @property
    def name(self) -> str:
        return self.path.name

    def rel(self, path: Path) -> str:
        try:
            return path.relative_to(self.repo).as_posix()
        except ValueError:
            return str(path)

    @property
    def batching(self) -> bool:
        return self.config is not None and self.config.max_batch_size > 0


def _check_config(m: _ModelFolder) -> None:
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


def _resolve_backend(m: _ModelFolder, rel: str) -> None:
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


def _check_versions(m: _ModelFolder) -> None:
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


def _check_model_files(m: _ModelFolder) -> None:
    if not m.backend or not m.versions:
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


def _check_target(m: _ModelFolder, target: TritonTarget) -> None:
    if not m.backend:
        return
    if target.has(m.backend):
        m.rec.ok("target", f"backend '{m.backend}' is available on target '{target.name}'")
        return
    extra = " and a GPU" if m.backend == "tensorrt" else ""
    m.rec.skip(
        "target",
        f"backend '{m.backend}' is not on target '{target.name}' "
        f"({sorted(target.backends)}): it needs a Triton with the {m.backend} backend{extra}; "
        "not loaded here",
    )


# --- ONNX ------------------------------------------------------------------------------------


def config_tensors(config: Any, kind: str) -> list[tuple[str, str, list[int]]]:
    items = config.input if kind == "input" else config.output
    from tritonclient.grpc import model_config_pb2

    return [(t.name, model_config_pb2.DataType.Name(t.data_type), list(t.dims)) for t in items]


def _dims_agree(model_dims: list[int], config_dims: list[int]) -> bool:
    """A fixed model axis must equal the config's; a dynamic (-1) model axis accepts anything.
    A scalar may be configured as [1] (Triton needs a shape)."""
    if not model_dims and config_dims in ([], [1]):
        return True
    return len(model_dims) == len(config_dims) and all(
        md == -1 or md == cd for md, cd in zip(model_dims, config_dims, strict=True)
    )


def _check_onnx(m: _ModelFolder, onnx_path: Path) -> None:
    from converters.errors import ConversionError
    from converters.onnx_inspect import inspect_onnx

    rel = m.rel(onnx_path)
    try:
        sig = inspect_onnx(onnx_path)
    except ConversionError as exc:
        text = str(exc)
        if "external-data" in text:
            m.rec.fail(
                "onnx_external_data",
                text,
                file=rel,
                fix="copy the external-data file next to the .onnx file, or re-save the model with "
                "its weights inlined, then re-render",
            )
        else:
            m.rec.fail("onnx_graph", text, file=rel, fix="re-export the ONNX model and re-render")
        return
    if sig.external_data:
        m.rec.ok("onnx_external_data", f"external data present: {', '.join(sig.external_data)}", rel)
    if m.batching and not sig.batch_dynamic:
        fixed = [t.name for t in (*sig.inputs, *sig.outputs) if not t.batch_dynamic]
        m.rec.fail(
            "onnx_batch_axis",
            f"max_batch_size is {m.config.max_batch_size} but tensor(s) {fixed} have no dynamic first (batch) axis",
            file=rel,
            fix="re-export with a dynamic batch axis on every input and output (torch.onnx.export "
            "dynamic_axes / dynamic_shapes), or render the model with max_batch_size 0",
        )
        return
    problems = _onnx_signature_problems(m, sig)
    if problems:
        m.rec.fail(
            "onnx_signature",
            "config.pbtxt does not agree with the ONNX graph: " + "; ".join(problems),
            file=rel,
            fix="re-render the model from its package (the signature is read from the ONNX "
            "file), or correct the inputs/outputs in config.pbtxt",
        )
    else:
        m.rec.ok("onnx_signature", "config inputs/outputs, dtypes and dims agree with the ONNX graph", rel)


def _onnx_signature_problems(m: _ModelFolder, sig: Any) -> list[str]:
    problems: list[str] = []
    for kind, graph_tensors in (("input", sig.inputs), ("output", sig.outputs)):
        graph = {t.name: t for t in graph_tensors}
        configured = config_tensors(m.config, kind)
        for name, triton_type, dims in configured:
            t = graph.get(name)
            if t is None:
                problems.append(f"{kind} '{name}' is not in the graph (graph {kind}s: {sorted(graph)})")
                continue
            want = from_triton(triton_type).numpy
            if t.dtype != want:
                problems.append(f"{kind} '{name}' is {t.dtype} in the graph, {triton_type} in the config")
            model_dims = t.dims[1:] if m.batching else t.dims
            if not _dims_agree(model_dims, dims):
                problems.append(
                    f"{kind} '{name}' has dims {model_dims} in the graph"
                    f"{' (batch axis dropped)' if m.batching else ''}, {dims} in the config"
                )
        if kind == "input":
            missing = sorted(set(graph) - {name for name, _, _ in configured})
            if missing:
                problems.append(f"graph input(s) {missing} are not in the config")
    return problems


# --- python backend -----------------------------------------------------------------------------


def _check_python(m: _ModelFolder) -> None:
    for version in m.versions:
        entry = version / (m.model_file or PYTHON_MODEL_FILE)
        runtime_file = version / SPEC_FILE
        generated = any(p.exists() for p in (runtime_file, version / "python_backend", m.path / DEPLOYMENT_FILE))
        spec = _check_runtime_spec(m, runtime_file) if generated else None
        if not generated:
            m.rec.skip(
                "runtime_spec",
                "hand-written python model (no snooze_runtime.json): snoozeml checks the config and the import only",
                m.rel(version),
            )
        package_dir = version / PACKAGE_SUBDIR
        if spec is not None and spec.kind is RuntimeKind.ONNX:
            onnx_path = package_dir / (spec.onnx_file or "")
            if not onnx_path.is_file():
                m.rec.fail(
                    "onnx_graph",
                    f"snooze_runtime.json names onnx_file '{spec.onnx_file}', which is not in package/",
                    file=m.rel(onnx_path),
                    fix="re-render the model from its package",
                )
            else:
                _check_onnx(m, onnx_path)
        if spec is not None:
            _check_manifest_and_params(m, spec, package_dir)
        if entry.is_file():
            _check_imports(m, entry, spec, package_dir)


def _check_runtime_spec(m: _ModelFolder, path: Path) -> Any:
    from python_backend.spec import SpecError, load_spec

    rel = m.rel(path)
    fix = "re-render the model (snoozectl render / publish); do not edit snooze_runtime.json by hand"
    try:
        spec = load_spec(str(path))
    except SpecError as exc:
        m.rec.fail("runtime_spec", str(exc), file=rel, fix=fix)
        return None
    problems = []
    if spec.model_id != m.name:
        problems.append(f"model_id is '{spec.model_id}', the folder is '{m.name}'")
    if spec.max_batch_size != m.config.max_batch_size:
        problems.append(f"max_batch_size is {spec.max_batch_size}, config.pbtxt says {m.config.max_batch_size}")
    for kind, declared in (("input", spec.inputs), ("output", spec.outputs)):
        configured = {n: (ty, d) for n, ty, d in config_tensors(m.config, kind)}
        if set(configured) != {t.name for t in declared}:
            problems.append(
                f"{kind}s {sorted(t.name for t in declared)} differ from config.pbtxt's {sorted(configured)}"
            )
            continue
        for t in declared:
            ty, dims = configured[t.name]
            if from_triton(ty).wire != t.datatype:
                problems.append(f"{kind} '{t.name}' is {t.datatype} here, {ty} in config.pbtxt")
            if list(t.dims) != dims and not (not t.dims and dims == [1]):
                problems.append(f"{kind} '{t.name}' has dims {list(t.dims)} here, {dims} in config.pbtxt")
    if problems:
        m.rec.fail("runtime_spec", "inconsistent with config.pbtxt: " + "; ".join(problems), file=rel, fix=fix)
        return spec
    m.rec.ok("runtime_spec", f"{SPEC_FILE} ({spec.kind}) agrees with config.pbtxt", rel)
    return spec


def _check_manifest_and_params(m: _ModelFolder, spec: Any, package_dir: Path) -> None:
    from controlplane.spec import MANIFEST_FILE, ModelPackage, PackageKind, read_manifest, validate_params

    manifest_path = package_dir / MANIFEST_FILE
    rel = m.rel(manifest_path)
    try:
        manifest = read_manifest(package_dir)
    except InvalidPackageError as exc:
        m.rec.fail("manifest", exc.message, file=rel, fix=exc.hint or "correct the manifest and re-render")
        return
    if spec.kind is RuntimeKind.CUSTOM:
        drift = [
            f"{key} is {ours!r} in {SPEC_FILE} but {theirs!r} in the manifest"
            for key, ours, theirs in (
                ("entrypoint", spec.entrypoint, manifest.entrypoint),
                ("class", spec.class_name, manifest.class_name),
                ("tensor_format", spec.tensor_format, manifest.tensor_format),
            )
            if ours != theirs
        ]
        if drift:
            m.rec.fail("manifest", "; ".join(drift), file=rel, fix="re-render the model from its package")
            return
    kind = PackageKind(spec.kind)
    package = ModelPackage(package_dir, kind, manifest, [], [], [])
    if kind is PackageKind.ONNX and not manifest_path.exists():
        # An ONNX package is served without its manifest (render checked the params against its schema):
        # what is left to check here is that onnxruntime knows them.
        validated, rel = dict(spec.params), m.rel(package_dir.parent / SPEC_FILE)
    else:
        try:
            validated = validate_params(package, dict(spec.params), model_id=m.name)
        except InvalidPackageError as exc:
            m.rec.fail(
                "params",
                exc.message,
                file=m.rel(package_dir.parent / SPEC_FILE),
                fix=exc.hint or "declare the params in the manifest's params_schema",
            )
            return
    if spec.kind is RuntimeKind.ONNX and validated:
        bad = _unknown_session_options(validated)
        if bad:
            m.rec.fail(
                "params",
                f"params {bad} are not onnxruntime SessionOptions fields",
                file=rel,
                fix="ONNX models take SessionOptions fields as params (e.g. intra_op_num_threads)",
            )
            return
    m.rec.ok("params", f"manifest and params validate ({len(validated)} param(s))", rel)


def _unknown_session_options(params: dict[str, Any]) -> list[str]:
    try:
        import onnxruntime as ort  # the control plane's own dependency; never the user's code
    except ImportError:
        return []
    options = ort.SessionOptions()
    return sorted(k for k in params if not hasattr(options, k))


def _check_imports(m: _ModelFolder, entry: Path, spec: Any, package_dir: Path) -> None:
    """The entry file, and a custom package's entrypoint, imported by the runtime's probe (a child process)."""
    custom = spec is not None and spec.kind is RuntimeKind.CUSTOM
    job = {
        "entry_file": str(entry.resolve()),
        "package_dir": str(package_dir.resolve()),
        "entrypoint": spec.entrypoint if custom else "",
        "class_name": spec.class_name if custom else "",
        "env": dict(spec.env) if spec is not None else {},
        "cwd": str(entry.parent.resolve()),
        "timeout": IMPORT_TIMEOUT_SECS,
    }
    rel_entry = m.rel(entry)
    probe = m.probes.run(job)
    if "timeout" in probe:
        m.rec.fail(
            "entry_import",
            f"importing the model took longer than {IMPORT_TIMEOUT_SECS:.0f}s",
            file=rel_entry,
            fix="move heavy work (framework imports, weight loading) into load()",
        )
        return
    if "crashed" in probe:
        m.rec.fail(
            "entry_import",
            f"the import process exited with code {probe['crashed']}: {probe['output']}",
            file=rel_entry,
            fix="make the module importable with this interpreter's packages",
        )
        return
    baseline = set(probe["baseline"])
    entry_ok = _judge_entry(m, probe["entry"], baseline, rel_entry)
    if custom and entry_ok:
        _judge_package(m, probe["package"], spec, m.rel(package_dir / spec.entrypoint))


def _judge_entry(m: _ModelFolder, entry: dict[str, Any], baseline: set[str], rel: str) -> bool:
    if not entry["ok"]:
        m.rec.fail(
            "entry_import",
            f"the entry file does not import:\n{entry['error']}",
            file=rel,
            fix="re-render the model; a hand-written model.py must import with numpy and the "
            "standard library (triton_python_backend_utils is provided by the stub)",
        )
        return False
    if not entry["has_class"]:
        m.rec.fail(
            "entry_import",
            "the entry file defines no TritonPythonModel class",
            file=rel,
            fix="re-render the model, or define class TritonPythonModel in model.py",
        )
        return False
    pulled = sorted(set(entry["frameworks"]) - baseline)
    if pulled:
        m.rec.fail(
            "entry_import",
            f"importing the entry file imports {pulled}",
            file=rel,
            fix="import ML frameworks inside initialize()/load(), not at module level",
        )
        return False
    m.rec.ok("entry_import", "entry file imports without an ML framework; TritonPythonModel found", rel)
    return True


def _judge_package(m: _ModelFolder, pkg: dict[str, Any], spec: Any, rel: str) -> None:
    if not pkg["ok"]:
        m.rec.fail(
            "package_import",
            f"the package entrypoint does not import:\n{pkg['error']}",
            file=rel,
            fix="fix the error above; the package must import with only its own files and the environment's packages",
        )
        return
    pulled = sorted(set(pkg["frameworks"]) - set(pkg["before"]))
    if pulled:
        m.rec.fail(
            "package_import",
            f"importing {spec.entrypoint} imports {pulled} at module level",
            file=rel,
            fix=f"move `import {pulled[0]}` into {spec.class_name}.load() (the package must import "
            "cheaply: the framework is imported when an instance loads)",
        )
    else:
        m.rec.ok("package_import", f"{spec.entrypoint} imports without an ML framework", rel)
    if not pkg["is_class"]:
        m.rec.fail(
            "model_class",
            f"{spec.entrypoint} defines no class '{spec.class_name}'",
            file=rel,
            fix="define the class, or set 'class' in snooze_model.json to the class's name",
        )
    elif pkg["missing"]:
        m.rec.fail(
            "model_class",
            f"class {spec.class_name} has no callable {pkg['missing']}",
            file=rel,
            fix="a model needs load(self, model_dir, device) and predict(self, inputs) -> dict",
        )
    else:
        m.rec.ok("model_class", f"class {spec.class_name} has load() and predict()", rel)


def _check_deployment_record(m: _ModelFolder) -> None:
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
    m = _ModelFolder(Path(repo), Path(folder), Recorder(Path(folder).name), probes=probes)
    _check_config(m)
    if m.config is None:
        return m.rec.results
    _check_versions(m)
    _check_model_files(m)
    _check_target(m, target)
    if m.backend == "onnxruntime":
        for version in m.versions:
            if (version / (m.model_file or "")).is_file():
                _check_onnx(m, version / m.model_file)
    elif m.backend == "python":
        _check_python(m)
    _check_deployment_record(m)
    return m.rec.results
