"""`snoozectl validate`'s static checks of a python-backend model folder: its runtime spec agrees with its
config, its manifest and params validate, and its entry file and package import (in the import probe's child
processes, ``controlplane/package_check.py``) without an ML framework."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from controlplane.dtypes import from_triton
from controlplane.errors import InvalidPackageError
from controlplane.package_check import IMPORT_TIMEOUT_SECS
from controlplane.render import DEPLOYMENT_FILE, PACKAGE_SUBDIR
from controlplane.spec import PackageKind
from controlplane.spec.triton_folder import USER_MODULE
from controlplane.validation.model_folder import ModelFolder
from controlplane.validation.static_onnx import check_onnx, config_tensors
from converters.files import PYTHON_MODEL_FILE
from python_backend.spec import SPEC_FILE, RuntimeKind


def _record_kind(m: ModelFolder) -> str:
    """The package kind the model was published from (its deployment record), '' when unreadable."""
    try:
        return str(json.loads((m.path / DEPLOYMENT_FILE).read_text(encoding="utf-8")).get("kind", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def check_python(m: ModelFolder) -> None:
    if _record_kind(m) == PackageKind.TRITON_PYTHON:
        for version in m.versions:
            _check_triton_python(m, version)
        return
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
                check_onnx(m, onnx_path)
        if spec is not None:
            _check_manifest_and_params(m, spec, package_dir)
        if entry.is_file():
            _check_imports(m, entry, spec, package_dir)


def _check_triton_python(m: ModelFolder, version: Path) -> None:
    """A Triton python model's version: the generated wrapper imports and the user's file (moved beside it, as
    Triton's stub imports a model.py) imports and defines TritonPythonModel with execute."""
    entry, user = version / PYTHON_MODEL_FILE, version / f"{USER_MODULE}.py"
    if not entry.is_file():
        return  # the model_file check said so
    if not user.is_file():
        m.rec.fail(
            "triton_model",
            f"the wrapper's model file {USER_MODULE}.py is missing",
            file=m.rel(user),
            fix="re-render the model from its Triton model folder (snoozectl render / publish)",
        )
        return
    job = {
        "entry_file": str(entry.resolve()),
        "triton_module": {"file": str(user.resolve()), "model_dir": str(m.path.resolve())},
        "env": {},
        "cwd": str(version.resolve()),
        "timeout": IMPORT_TIMEOUT_SECS,
    }
    probe = m.probes.run(job)
    rel = m.rel(user)
    if "timeout" in probe or "crashed" in probe:
        what = (
            f"took longer than {IMPORT_TIMEOUT_SECS:.0f}s"
            if "timeout" in probe
            else f"ended the process (exit code {probe['crashed']}): {probe['output']}"
        )
        m.rec.fail("triton_model", f"importing the model {what}", file=rel, fix="make the module import quickly")
        return
    if not _judge_entry(m, probe["entry"], set(probe["baseline"]), m.rel(entry)):
        return
    _judge_triton_module(m, probe["triton"], rel)


def _judge_triton_module(m: ModelFolder, result: dict[str, Any], rel: str) -> None:
    if not result["ok"]:
        m.rec.fail(
            "triton_model",
            f"the model's file does not import:\n{result['error']}",
            file=rel,
            fix="fix the error above; it must import with the environment's packages (triton_python_backend_utils is "
            "the stub's)",
        )
    elif not result["has_class"] or not result["has_execute"]:
        m.rec.fail(
            "triton_model",
            "the model's file defines no class TritonPythonModel with execute()",
            file=rel,
            fix="define class TritonPythonModel with execute(self, requests), as Triton's python backend needs",
        )
    else:
        pulled = sorted(set(result["frameworks"]) - set(result["before"]))
        heavy = f"; it imports {pulled} at module level (every load pays for it)" if pulled else ""
        m.rec.ok("triton_model", f"TritonPythonModel imports, run as written by snoozeml's wrapper{heavy}", rel)


def _check_runtime_spec(m: ModelFolder, path: Path) -> Any:
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


def _check_manifest_and_params(m: ModelFolder, spec: Any, package_dir: Path) -> None:
    from controlplane.spec import MANIFEST_FILE, ModelPackage, read_manifest, validate_params

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


def _check_imports(m: ModelFolder, entry: Path, spec: Any, package_dir: Path) -> None:
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


def _judge_entry(m: ModelFolder, entry: dict[str, Any], baseline: set[str], rel: str) -> bool:
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


def _judge_package(m: ModelFolder, pkg: dict[str, Any], spec: Any, rel: str) -> None:
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
