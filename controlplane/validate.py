"""`snoozectl validate`: the CI gate for a generated Triton model repository.

Static checks read every model folder without running model code in this process: the config
parses as Triton's ``ModelConfig`` and names its folder, version folders hold the file the backend
needs, ONNX graphs agree with their configs, and python-backend models import in a *child* process
(user code never runs in the control plane) without pulling their ML framework in at import time.
With ``load=True`` every model the target can run is loaded into a real tritonserver (the embedded
one, or ``triton_url``), answers one warm-up inference built from its config, and is unloaded.

Every failure names the model, the file and the fix.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from controlplane.dtypes import from_triton
from controlplane.errors import InvalidPackageError, SnoozeError
from controlplane.render import (
    DEPLOYMENT_FILE,
    PACKAGE_SUBDIR,
    RUNTIME_FILE,
    TritonTarget,
    embedded_target,
    parse_config,
    target_by_name,
)

OK, FAIL, SKIP = "ok", "fail", "skip"
REPOSITORY = "(repository)"
ML_FRAMEWORKS = ("torch", "tensorflow", "jax", "onnxruntime", "tensorrt")
IMPORT_TIMEOUT_SECS = 120.0
DEFAULT_LOAD_TIMEOUT_SECS = 300.0

# platform -> backend, and the file Triton looks for when the config names none.
_PLATFORM_BACKENDS = {
    "onnxruntime_onnx": "onnxruntime",
    "tensorrt_plan": "tensorrt",
    "pytorch_libtorch": "pytorch",
    "tensorflow_graphdef": "tensorflow",
    "tensorflow_savedmodel": "tensorflow",
}
_DEFAULT_FILES = {
    "python": "model.py",
    "onnxruntime": "model.onnx",
    "tensorrt": "model.plan",
    "pytorch": "model.pt",
    "tensorflow_graphdef": "model.graphdef",
    "tensorflow_savedmodel": "model.savedmodel",
}
_VERSION_RE = re.compile(r"[1-9][0-9]*")


# ---------------------------------------------------------------------------------------------
# Results


@dataclass
class CheckResult:
    """One check of one model. ``message`` is complete on its own: model, file, problem and fix."""

    model: str
    check: str
    status: str  # ok | fail | skip
    message: str
    file: str | None = None  # relative to the repository
    fix: str | None = None
    load_secs: float | None = None

    @property
    def ok(self) -> bool:
        return self.status != FAIL

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ok": self.ok}


@dataclass
class ValidationReport:
    repository: str
    target: str
    load: bool
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.ok]

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(r.model for r in self.results if r.model != REPOSITORY))

    def for_model(self, model: str) -> list[CheckResult]:
        return [r for r in self.results if r.model == model]

    @property
    def load_secs(self) -> dict[str, float]:
        """Per-model load time of the models that loaded."""
        return {r.model: r.load_secs for r in self.results if r.check == "load" and r.load_secs is not None}

    def to_dict(self) -> dict[str, Any]:
        return {
            "repository": self.repository,
            "target": self.target,
            "load": self.load,
            "ok": self.ok,
            "models": self.models,
            "failures": len(self.failures),
            "load_secs": self.load_secs,
            "results": [r.to_dict() for r in self.results],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_junit_xml(self) -> str:
        """JUnit XML: one testsuite per model, one testcase per check (load time as the case's time)."""
        root = ET.Element("testsuites", name="snoozectl validate", tests=str(len(self.results)),
                          failures=str(len(self.failures)))
        for model in dict.fromkeys(r.model for r in self.results):
            cases = self.for_model(model)
            suite = ET.SubElement(
                root, "testsuite", name=f"snoozeml.validate.{model}", tests=str(len(cases)),
                failures=str(sum(not c.ok for c in cases)), skipped=str(sum(c.status == SKIP for c in cases)),
                time=f"{sum(c.load_secs or 0.0 for c in cases):.3f}",
            )
            for c in cases:
                case = ET.SubElement(suite, "testcase", classname=f"snoozeml.validate.{model}", name=c.check,
                                     time=f"{c.load_secs or 0.0:.3f}")
                if c.file:
                    case.set("file", c.file)
                if c.status == FAIL:
                    ET.SubElement(case, "failure", message=c.message, type=c.check).text = c.message
                elif c.status == SKIP:
                    ET.SubElement(case, "skipped", message=c.message)
                else:
                    ET.SubElement(case, "system-out").text = c.message
        ET.indent(root)
        return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"

    def write_junit_xml(self, path: str | os.PathLike[str]) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(self.to_junit_xml(), encoding="utf-8")
        return out

    def print_table(self, console: Any = None, *, verbose: bool = False) -> None:
        """A human table: one row per passing model, one row per failed or skipped check
        (every check with ``verbose``)."""
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        table = Table(title=f"snoozectl validate {self.repository} (target {self.target})")
        for col in ("model", "check", "status", "load s", "message"):
            table.add_column(col, overflow="fold")
        style = {OK: "green", FAIL: "bold red", SKIP: "yellow"}
        for model in dict.fromkeys(r.model for r in self.results):
            results = self.for_model(model)
            load = next((r.load_secs for r in results if r.load_secs is not None), None)
            load_text = f"{load:.2f}" if load is not None else ""
            shown = results if verbose else [r for r in results if r.status != OK]
            if not verbose:
                passed = sum(r.status == OK for r in results)
                table.add_row(model, "(all)", f"[{style[OK]}]ok[/]" if all(r.ok for r in results)
                              else f"[{style[FAIL]}]fail[/]", load_text, f"{passed}/{len(results)} checks passed")
            for r in shown:
                table.add_row(model, r.check, f"[{style[r.status]}]{r.status}[/]",
                              f"{r.load_secs:.2f}" if r.load_secs is not None else "", r.message)
        console.print(table)
        n_models = len(self.models)
        if self.ok:
            console.print(f"[green]OK[/]: {n_models} model(s), {len(self.results)} checks, none failed")
        else:
            console.print(f"[bold red]FAILED[/]: {len(self.failures)} of {len(self.results)} checks "
                          f"failed across {n_models} model(s)")


class _Recorder:
    """Collects the results of one model; builds messages that name the model, file and fix."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.results: list[CheckResult] = []

    def ok(self, check: str, message: str, file: str | None = None, load_secs: float | None = None) -> None:
        self.results.append(CheckResult(self.model, check, OK, message, file, None, load_secs))

    def skip(self, check: str, message: str, file: str | None = None) -> None:
        self.results.append(CheckResult(self.model, check, SKIP, message, file))

    def fail(self, check: str, problem: str, *, file: str | None, fix: str) -> None:
        where = f" ({file})" if file else ""
        message = f"model '{self.model}'{where}: {problem}. Fix: {fix}"
        self.results.append(CheckResult(self.model, check, FAIL, message, file, fix))

    @property
    def failed(self) -> bool:
        return any(not r.ok for r in self.results)


# ---------------------------------------------------------------------------------------------
# Static checks


@dataclass
class _ModelFolder:
    repo: Path
    path: Path
    rec: _Recorder
    config: Any = None  # model_config_pb2.ModelConfig once parsed
    backend: str | None = None
    model_file: str | None = None
    versions: list[Path] = field(default_factory=list)

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
        m.rec.fail("config", "no config.pbtxt", file=rel,
                   fix="re-render the repository (snoozectl render / publish); Triton runs with "
                       "--disable-auto-complete-config and needs a complete config")
        return
    try:
        m.config = parse_config(path.read_text(encoding="utf-8"), where=rel)
    except (InvalidPackageError, UnicodeDecodeError) as exc:
        problem = exc.message if isinstance(exc, InvalidPackageError) else f"not UTF-8 text ({exc})"
        m.rec.fail("config", problem, file=rel,
                   fix="correct the protobuf text (see Triton's model_config.proto) or re-render the model")
        return
    m.rec.ok("config", "parses as Triton ModelConfig", rel)
    name = m.config.name
    if name and name != m.name:
        m.rec.fail("name", f"config name '{name}' does not match its folder '{m.name}'", file=rel,
                   fix=f"set name: \"{m.name}\" in config.pbtxt or rename the folder to '{name}'")
    else:
        m.rec.ok("name", f"name matches folder '{m.name}'", rel)
    _resolve_backend(m, rel)


def _resolve_backend(m: _ModelFolder, rel: str) -> None:
    cfg = m.config
    backend = cfg.backend or _PLATFORM_BACKENDS.get(cfg.platform)
    if not backend:
        what = f"platform '{cfg.platform}' is not known" if cfg.platform else "names no backend or platform"
        m.rec.fail("backend", f"the config {what}", file=rel,
                   fix='set backend: "python" or platform: "onnxruntime_onnx" / "tensorrt_plan"')
        return
    m.backend = backend
    default = _DEFAULT_FILES.get(cfg.platform) or _DEFAULT_FILES.get(backend)
    m.model_file = cfg.default_model_filename or default


def _check_versions(m: _ModelFolder) -> None:
    dirs = sorted(p for p in m.path.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
    bad = [p for p in dirs if not _VERSION_RE.fullmatch(p.name)]
    for p in bad:
        m.rec.fail("versions", f"folder '{p.name}' is not a version number; Triton ignores it", file=m.rel(p),
                   fix="name version folders 1, 2, ... (no leading zero) or move the folder out of the model")
    m.versions = sorted((p for p in dirs if p not in bad), key=lambda p: int(p.name))
    if not m.versions:
        m.rec.fail("versions", "no version folder", file=m.rel(m.path),
                   fix="put the model files in a numbered folder (e.g. 1/) or re-render the model")
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
            fix = ("copy the TensorRT engine there (built for this GPU and TensorRT version)"
                   if m.backend == "tensorrt" else "re-render the model (snoozectl render / publish)")
            m.rec.fail("model_file", f"backend '{m.backend}' needs {m.model_file} in version {version.name}",
                       file=m.rel(path), fix=fix)
        else:
            m.rec.ok("model_file", f"{m.model_file} present", m.rel(path))
    if m.backend == "tensorrt":
        m.rec.ok("gpu_only", "TensorRT plan: GPU-only, tied to the GPU's compute capability and TensorRT version "
                 "it was built with", m.rel(m.path / "config.pbtxt"))


def _check_target(m: _ModelFolder, target: TritonTarget) -> None:
    if not m.backend:
        return
    if target.has(m.backend):
        m.rec.ok("target", f"backend '{m.backend}' is available on target '{target.name}'")
        return
    extra = " and a GPU" if m.backend == "tensorrt" else ""
    m.rec.skip("target", f"backend '{m.backend}' is not on target '{target.name}' "
               f"({sorted(target.backends)}): it needs a Triton with the {m.backend} backend{extra}; "
               "not loaded here")


# --- ONNX ------------------------------------------------------------------------------------


def _config_tensors(config: Any, kind: str) -> list[tuple[str, str, list[int]]]:
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
            m.rec.fail("onnx_external_data", text, file=rel,
                       fix="copy the external-data file next to the .onnx file, or re-save the model with "
                           "its weights inlined, then re-render")
        else:
            m.rec.fail("onnx_graph", text, file=rel, fix="re-export the ONNX model and re-render")
        return
    if sig.external_data:
        m.rec.ok("onnx_external_data", f"external data present: {', '.join(sig.external_data)}", rel)
    if m.batching and not sig.batch_dynamic:
        fixed = [t.name for t in (*sig.inputs, *sig.outputs) if not t.batch_dynamic]
        m.rec.fail("onnx_batch_axis", f"max_batch_size is {m.config.max_batch_size} but tensor(s) {fixed} have "
                   "no dynamic first (batch) axis", file=rel,
                   fix="re-export with a dynamic batch axis on every input and output (torch.onnx.export "
                       "dynamic_axes / dynamic_shapes), or render the model with max_batch_size 0")
        return
    problems = _onnx_signature_problems(m, sig)
    if problems:
        m.rec.fail("onnx_signature", "config.pbtxt does not agree with the ONNX graph: " + "; ".join(problems),
                   file=rel, fix="re-render the model from its package (the signature is read from the ONNX "
                   "file), or correct the inputs/outputs in config.pbtxt")
    else:
        m.rec.ok("onnx_signature", "config inputs/outputs, dtypes and dims agree with the ONNX graph", rel)


def _onnx_signature_problems(m: _ModelFolder, sig: Any) -> list[str]:
    problems: list[str] = []
    for kind, graph_tensors in (("input", sig.inputs), ("output", sig.outputs)):
        graph = {t.name: t for t in graph_tensors}
        configured = _config_tensors(m.config, kind)
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
                problems.append(f"{kind} '{name}' has dims {model_dims} in the graph"
                                f"{' (batch axis dropped)' if m.batching else ''}, {dims} in the config")
        if kind == "input":
            missing = sorted(set(graph) - {name for name, _, _ in configured})
            if missing:
                problems.append(f"graph input(s) {missing} are not in the config")
    return problems


# --- python backend -----------------------------------------------------------------------------


def _check_python(m: _ModelFolder) -> None:
    for version in m.versions:
        entry = version / (m.model_file or "model.py")
        runtime_file = version / RUNTIME_FILE
        generated = any(p.exists() for p in (runtime_file, version / "python_backend", m.path / DEPLOYMENT_FILE))
        spec = _check_runtime_spec(m, runtime_file) if generated else None
        if not generated:
            m.rec.skip("runtime_spec", "hand-written python model (no snooze_runtime.json): snoozeml checks the "
                       "config and the import only", m.rel(version))
        package_dir = version / PACKAGE_SUBDIR
        if spec is not None and spec.kind == "onnx":
            onnx_path = package_dir / (spec.onnx_file or "")
            if not onnx_path.is_file():
                m.rec.fail("onnx_graph", f"snooze_runtime.json names onnx_file '{spec.onnx_file}', which is not "
                           "in package/", file=m.rel(onnx_path), fix="re-render the model from its package")
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
        configured = {n: (ty, d) for n, ty, d in _config_tensors(m.config, kind)}
        if set(configured) != {t.name for t in declared}:
            problems.append(f"{kind}s {sorted(t.name for t in declared)} differ from config.pbtxt's "
                            f"{sorted(configured)}")
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
    m.rec.ok("runtime_spec", f"{RUNTIME_FILE} ({spec.kind}) agrees with config.pbtxt", rel)
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
    if spec.kind == "custom":
        drift = [f"{key} is {ours!r} in {RUNTIME_FILE} but {theirs!r} in the manifest"
                 for key, ours, theirs in (("entrypoint", spec.entrypoint, manifest.entrypoint),
                                           ("class", spec.class_name, manifest.class_name),
                                           ("tensor_format", spec.tensor_format, manifest.tensor_format))
                 if ours != theirs]
        if drift:
            m.rec.fail("manifest", "; ".join(drift), file=rel, fix="re-render the model from its package")
            return
    kind = PackageKind.ONNX if spec.kind == "onnx" else PackageKind.CUSTOM
    package = ModelPackage(package_dir, kind, manifest, [], [], [])
    try:
        validated = validate_params(package, dict(spec.params), model_id=m.name)
    except InvalidPackageError as exc:
        m.rec.fail("params", exc.message, file=m.rel(package_dir.parent / RUNTIME_FILE),
                   fix=exc.hint or "declare the params in the manifest's params_schema")
        return
    if spec.kind == "onnx" and validated:
        bad = _unknown_session_options(validated)
        if bad:
            m.rec.fail("params", f"params {bad} are not onnxruntime SessionOptions fields", file=rel,
                       fix="ONNX models take SessionOptions fields as params (e.g. intra_op_num_threads)")
            return
    m.rec.ok("params", f"manifest and params validate ({len(validated)} param(s))", rel)


def _unknown_session_options(params: dict[str, Any]) -> list[str]:
    try:
        import onnxruntime as ort  # the control plane's own dependency; never the user's code
    except ImportError:
        return []
    options = ort.SessionOptions()
    return sorted(k for k in params if not hasattr(options, k))


# The import probe runs in a child interpreter: user code never runs in the validator's process.
_IMPORT_PROBE = r"""
import importlib, importlib.util, json, os, sys, traceback, types
frameworks = json.loads(sys.argv[1])
entry_file, package_dir, entrypoint, class_name = sys.argv[2:6]
env = json.loads(sys.argv[6])
out, sys.stdout = sys.stdout, sys.stderr   # user prints must not corrupt the report
def loaded():
    return sorted(f for f in frameworks if f in sys.modules)
def error():
    return "".join(traceback.format_exc(limit=-4).splitlines(True)[-12:])
result = {"baseline": loaded()}
os.environ.update(env)
try:
    import triton_python_backend_utils  # noqa: F401  (only exists inside Triton's stub)
except ImportError:
    sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
try:
    spec = importlib.util.spec_from_file_location("snooze_validate_entry", entry_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result["entry"] = {"ok": True, "frameworks": loaded(), "has_class": hasattr(module, "TritonPythonModel")}
except BaseException:
    result["entry"] = {"ok": False, "error": error(), "frameworks": loaded()}
if entrypoint:
    before = loaded()
    try:
        if package_dir not in sys.path:
            sys.path.insert(0, package_dir)
        name = os.path.normpath(entrypoint)[: -len(".py")].replace(os.sep, ".")
        mod = importlib.import_module(name)
        cls = getattr(mod, class_name, None)
        is_class = isinstance(cls, type)
        missing = [m for m in ("load", "predict") if not (is_class and callable(getattr(cls, m, None)))]
        result["package"] = {"ok": True, "before": before, "frameworks": loaded(), "is_class": is_class,
                             "missing": missing}
    except BaseException:
        result["package"] = {"ok": False, "before": before, "error": error(), "frameworks": loaded()}
out.write(json.dumps(result))
out.flush()
"""


def _run_import_probe(entry: Path, package_dir: Path, entrypoint: str, class_name: str,
                      env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, "-c", _IMPORT_PROBE, json.dumps(ML_FRAMEWORKS), str(entry), str(package_dir),
           entrypoint, class_name, json.dumps(env)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=IMPORT_TIMEOUT_SECS,
                          cwd=str(entry.parent), stdin=subprocess.DEVNULL)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        tail = "\n".join((proc.stderr or "").strip().splitlines()[-12:])
        return {"crashed": f"the import process exited with code {proc.returncode}: {tail}"}


def _check_imports(m: _ModelFolder, entry: Path, spec: Any, package_dir: Path) -> None:
    custom = spec is not None and spec.kind == "custom"
    entrypoint = spec.entrypoint if custom else ""
    class_name = spec.class_name if custom else ""
    env = dict(spec.env) if spec is not None else {}
    rel_entry = m.rel(entry)
    try:
        probe = _run_import_probe(entry, package_dir, entrypoint, class_name, env)
    except subprocess.TimeoutExpired:
        m.rec.fail("entry_import", f"importing the model took longer than {IMPORT_TIMEOUT_SECS:.0f}s",
                   file=rel_entry, fix="move heavy work (framework imports, weight loading) into load()")
        return
    if "crashed" in probe:
        m.rec.fail("entry_import", probe["crashed"], file=rel_entry,
                   fix="make the module importable with this interpreter's packages")
        return
    baseline = set(probe["baseline"])
    entry_ok = _judge_entry(m, probe["entry"], baseline, rel_entry)
    if custom and entry_ok:
        _judge_package(m, probe["package"], spec, m.rel(package_dir / spec.entrypoint))


def _judge_entry(m: _ModelFolder, entry: dict[str, Any], baseline: set[str], rel: str) -> bool:
    if not entry["ok"]:
        m.rec.fail("entry_import", f"the entry file does not import:\n{entry['error']}", file=rel,
                   fix="re-render the model; a hand-written model.py must import with numpy and the "
                       "standard library (triton_python_backend_utils is provided by the stub)")
        return False
    if not entry["has_class"]:
        m.rec.fail("entry_import", "the entry file defines no TritonPythonModel class", file=rel,
                   fix="re-render the model, or define class TritonPythonModel in model.py")
        return False
    pulled = sorted(set(entry["frameworks"]) - baseline)
    if pulled:
        m.rec.fail("entry_import", f"importing the entry file imports {pulled}", file=rel,
                   fix="import ML frameworks inside initialize()/load(), not at module level")
        return False
    m.rec.ok("entry_import", "entry file imports without an ML framework; TritonPythonModel found", rel)
    return True


def _judge_package(m: _ModelFolder, pkg: dict[str, Any], spec: Any, rel: str) -> None:
    if not pkg["ok"]:
        m.rec.fail("package_import", f"the package entrypoint does not import:\n{pkg['error']}", file=rel,
                   fix="fix the error above; the package must import with only its own files and the "
                       "environment's packages")
        return
    pulled = sorted(set(pkg["frameworks"]) - set(pkg["before"]))
    if pulled:
        m.rec.fail("package_import", f"importing {spec.entrypoint} imports {pulled} at module level", file=rel,
                   fix=f"move `import {pulled[0]}` into {spec.class_name}.load() (the package must import "
                       "cheaply: the framework is imported when an instance loads)")
    else:
        m.rec.ok("package_import", f"{spec.entrypoint} imports without an ML framework", rel)
    if not pkg["is_class"]:
        m.rec.fail("model_class", f"{spec.entrypoint} defines no class '{spec.class_name}'", file=rel,
                   fix="define the class, or set 'class' in snooze_model.json to the class's name")
    elif pkg["missing"]:
        m.rec.fail("model_class", f"class {spec.class_name} has no callable {pkg['missing']}", file=rel,
                   fix="a model needs load(self, model_dir, device) and predict(self, inputs) -> dict")
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
        m.rec.fail("deployment_record", f"unreadable ({type(exc).__name__}: {exc})", file=rel,
                   fix="re-render the model; the control plane recovers published models from this file")
        return
    if m.backend and record.backend != m.backend:
        m.rec.fail("deployment_record", f"records backend '{record.backend}', config.pbtxt is '{m.backend}'",
                   file=rel, fix="re-render the model")
        return
    m.rec.ok("deployment_record", f"{DEPLOYMENT_FILE} readable", rel)


def check_model_static(repo: Path, folder: Path, target: TritonTarget) -> list[CheckResult]:
    """All static checks of one model folder."""
    m = _ModelFolder(Path(repo), Path(folder), _Recorder(Path(folder).name))
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


# ---------------------------------------------------------------------------------------------
# Dynamic checks: load, one warm-up inference, unload


def warmup_inputs(config: Any, seed: int = 0) -> dict[str, Any]:
    """Inputs generated from a config: random data of the right dtype, BYTES -> b"snooze", dims -1 -> 1,
    batch 1 when the model batches."""
    import numpy as np

    rng = np.random.default_rng(seed)
    arrays: dict[str, Any] = {}
    for name, triton_type, dims in _config_tensors(config, "input"):
        shape = ([1] if config.max_batch_size > 0 else []) + [1 if d == -1 else d for d in dims]
        numpy_name = from_triton(triton_type).numpy
        if numpy_name == "object":
            arrays[name] = np.full(shape, b"snooze", dtype=object)
        elif numpy_name == "bool":
            arrays[name] = rng.integers(0, 2, size=shape).astype(bool)
        elif numpy_name.startswith(("int", "uint")):
            arrays[name] = rng.integers(0, 2, size=shape).astype(numpy_name)
        elif numpy_name == "bfloat16":  # tritonclient sends BF16 from float32 arrays
            arrays[name] = rng.random(size=shape, dtype=np.float32)
        else:
            arrays[name] = rng.random(size=shape).astype(numpy_name)
    return arrays


def warmup_infer(http_url: str, config: Any, headers: dict[str, str], timeout: float) -> str:
    """One inference through tritonclient.http; returns a short description, raises on failure."""
    import tritonclient.http as httpclient

    ssl = http_url.startswith("https://")
    url = re.sub(r"^https?://", "", http_url).rstrip("/")
    types = {name: from_triton(t).wire for name, t, _ in _config_tensors(config, "input")}
    inputs = []
    for name, array in warmup_inputs(config).items():
        tensor = httpclient.InferInput(name, list(array.shape), types[name])
        tensor.set_data_from_numpy(array, binary_data=True)
        inputs.append(tensor)
    client = httpclient.InferenceServerClient(url, ssl=ssl, connection_timeout=timeout, network_timeout=timeout)
    try:
        result = client.infer(config.name or "", inputs, headers=headers or None)
    finally:
        client.close()
    outputs = [name for name, _, _ in _config_tensors(config, "output")]
    missing = [name for name in outputs if result.as_numpy(name) is None]
    if missing:
        raise RuntimeError(f"the response lacks output(s) {missing}")
    shapes = ", ".join(f"{n}{list(result.as_numpy(n).shape)}" for n in outputs)
    return shapes


def _load_timeout(folder: Path, default: float) -> float:
    try:
        return float(json.loads((folder / DEPLOYMENT_FILE).read_text(encoding="utf-8"))["load_timeout_secs"])
    except (OSError, ValueError, KeyError, TypeError):
        return default


async def _load_one(admin: Any, http_url: str, folder: Path, config: Any, headers: dict[str, str],
                    default_timeout: float, was_ready: bool) -> list[CheckResult]:
    name = folder.name
    rec = _Recorder(name)
    rel = f"{name}/config.pbtxt"
    timeout = _load_timeout(folder, default_timeout)
    start = time.perf_counter()
    try:
        await admin.load(name, timeout=timeout)
    except SnoozeError as exc:
        rec.fail("load", f"Triton did not load it: {exc.message}", file=rel,
                 fix=exc.hint or "read Triton's reason above (and its log); fix the model and re-render")
        return rec.results
    load_secs = time.perf_counter() - start
    rec.ok("load", f"loaded in {load_secs:.2f}s", rel, load_secs=load_secs)
    start = time.perf_counter()
    try:
        shapes = await asyncio.to_thread(warmup_infer, http_url, config, headers, timeout)
        rec.ok("warmup_infer", f"one inference in {time.perf_counter() - start:.3f}s: {shapes}", rel)
    except Exception as exc:  # tritonclient raises InferenceServerException and transport errors
        rec.fail("warmup_infer", f"the warm-up inference failed: {exc}", file=rel,
                 fix="run the model's predict() on inputs shaped like its config; check dtypes and dims")
    if was_ready:
        rec.ok("unload", "left loaded: it was loaded before validation started", rel)
        return rec.results
    try:
        await admin.unload(name, wait=True, timeout=timeout)
        rec.ok("unload", "unloaded", rel)
    except SnoozeError as exc:
        rec.fail("unload", exc.message, file=rel, fix=exc.hint or "check the model's unload()/finalize()")
    return rec.results


async def _load_all(http_url: str, models: list[tuple[Path, Any]], headers: dict[str, str],
                    default_timeout: float) -> list[CheckResult]:
    from controlplane.triton.client import TritonAdminClient

    # The restricted model-repository API of a compose/Kubernetes Triton wants its key in a header.
    async with TritonAdminClient(http_url, headers=headers or None) as admin:
        try:
            ready = {e.name for e in await admin.repository_index() if e.state == "READY"}
        except SnoozeError as exc:
            rec = _Recorder(REPOSITORY)
            rec.fail("triton", f"Triton at {http_url} does not answer its repository index: {exc}", file=None,
                     fix="check --triton-url and the model-repository API key (--triton-header)")
            return rec.results
        results: list[CheckResult] = []
        for folder, config in models:
            results += await _load_one(admin, http_url, folder, config, headers, default_timeout,
                                       folder.name in ready)
        return results


def _run_coroutine(make: Callable[[], Any]) -> Any:
    """asyncio.run, also when called from inside a running event loop (then on a worker thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


def _dynamic_checks(repo: Path, candidates: list[tuple[Path, Any]], target: TritonTarget,
                    triton_url: str | None, headers: dict[str, str], load_timeout: float) -> list[CheckResult]:
    from controlplane.triton.launcher import EmbeddedTriton, detect_backends

    results: list[CheckResult] = []
    triton = None
    work_dir = None
    backends = set(target.backends)
    if triton_url is None:
        work_dir = Path(tempfile.mkdtemp(prefix="snooze-validate-"))
        triton = EmbeddedTriton(repo, work_dir)
        try:
            triton.start()
        except SnoozeError as exc:
            rec = _Recorder(REPOSITORY)
            rec.fail("triton", f"the embedded tritonserver did not start: {exc.message}", file=None,
                     fix=exc.hint or "install snoozeml[embedded], or pass --triton-url of a running Triton")
            shutil.rmtree(work_dir, ignore_errors=True)
            return rec.results
        backends = detect_backends(work_dir / "backends") or {"python"}  # detected, not assumed
        triton_url = triton.http_url
    try:
        runnable = []
        for folder, config in candidates:
            backend = config.backend or _PLATFORM_BACKENDS.get(config.platform, "")
            if backend in backends:
                runnable.append((folder, config))
            else:
                results.append(CheckResult(folder.name, "load", SKIP,
                                           f"not loaded: this Triton has no '{backend}' backend ({sorted(backends)})"))
        results += _run_coroutine(lambda: _load_all(triton_url, runnable, headers, load_timeout))
    finally:
        if triton is not None:
            triton.stop()
        if work_dir is not None:
            shutil.rmtree(work_dir, ignore_errors=True)
    return results


# ---------------------------------------------------------------------------------------------
# Entry point


def _model_folders(repo: Path) -> list[Path]:
    return sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))


def _resolve_target(target: TritonTarget | str | None) -> TritonTarget:
    if target is None:
        return embedded_target()
    return target if isinstance(target, TritonTarget) else target_by_name(target)


def validate_repository(
    repo: str | os.PathLike[str],
    *,
    load: bool = False,
    triton_url: str | None = None,
    target: TritonTarget | str | None = None,
    triton_headers: dict[str, str] | None = None,
    load_timeout: float = DEFAULT_LOAD_TIMEOUT_SECS,
    models: Iterable[str] | None = None,
) -> ValidationReport:
    """Check a generated Triton model repository; with ``load``, load and warm up every model.

    ``target`` ("embedded", "full" or a TritonTarget) says which backends the serving Triton has;
    ``triton_url`` uses a running Triton instead of starting the embedded one (``triton_headers``
    carry its model-repository API key); ``models`` restricts the check to some model folders.
    """
    # Absolute from here on: the import probe runs with the model folder as its working directory.
    repo_path = Path(repo).absolute()
    tgt = _resolve_target(target)
    report = ValidationReport(str(repo), tgt.name, load)
    rec = _Recorder(REPOSITORY)
    if not repo_path.is_dir():
        rec.fail("repository", "the model repository folder does not exist", file=str(repo_path),
                 fix="pass the folder snoozectl render / serve wrote (e.g. .snooze/model_repository)")
        report.results = rec.results
        return report
    folders = _model_folders(repo_path)
    if models is not None:
        wanted = set(models)
        unknown = sorted(wanted - {f.name for f in folders})
        for name in unknown:
            rec.fail("repository", f"no model folder '{name}'", file=name, fix="check the model name")
        folders = [f for f in folders if f.name in wanted]
    if not folders and not rec.failed:
        rec.fail("repository", "no model folders", file=str(repo_path),
                 fix="render models into it first (snoozectl render)")
    report.results += rec.results
    workers = max(1, min(8, os.cpu_count() or 1, len(folders)))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        per_model = list(pool.map(lambda f: check_model_static(repo_path, f, tgt), folders))
    for results in per_model:
        report.results += results
    if load:
        candidates = []
        for folder, results in zip(folders, per_model, strict=True):
            if any(not r.ok for r in results):
                report.results.append(CheckResult(folder.name, "load", SKIP, "not loaded: static checks failed"))
            else:
                candidates.append((folder, parse_config((folder / "config.pbtxt").read_text(), where=folder.name)))
        if candidates:
            report.results += _dynamic_checks(repo_path, candidates, tgt, triton_url, dict(triton_headers or {}),
                                              load_timeout)
    report.results.sort(key=lambda r: (r.model != REPOSITORY, r.model))  # stable: checks keep their order
    return report
