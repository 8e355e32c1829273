"""Importing a package's model class the way an instance does, and the import probe built on it.

``import_model_class`` is the one definition of how a package's entrypoint is imported (package folder
first on ``sys.path``, module named after the file) and what its class must have; ``runners`` uses it in
the stub, and the control plane's checks (publish, ``snoozectl validate``) use it through the probe.

The probe (``python -m python_backend.import_probe``) is a child interpreter, so no package code runs in
the control plane: it reads jobs, one JSON object per line on stdin, and answers each with one JSON line
on stdout. Each job runs in a process forked from the probe (a fresh module table, environment and
working directory per package, without paying for an interpreter and numpy each time), in a process
group of its own that is killed whole when the job outlives its timeout. One probe per environment
checks many packages; the control plane runs one per core.

A job: ``{"package_dir", "entrypoint", "class_name", "env", "cwd", "entry_file", "triton_module", "timeout"}``
(``entry_file``: a rendered ``model.py`` to import first; ``entrypoint`` empty: no package import;
``triton_module``: a Triton python model's own file, imported as Triton's stub imports it).
An answer: ``{"baseline": [frameworks imported before], "entry": {...}, "package": {...}, "triton": {...}}``, or
``{"timeout": secs}``, or ``{"crashed": exit code, "output": its last lines}`` when the job's process
ended without answering.

Standard library only at import time (it travels with the runtime), Python 3.10 syntax.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import select
import signal
import sys
import time
import traceback
import types
from typing import Any

# Imported at module level by a package, these make every cold start pay for them: validate reports it.
ML_FRAMEWORKS = ("torch", "tensorflow", "jax", "onnxruntime", "tensorrt")
# How long importing one package may take (its module-level code only: frameworks belong in load()).
IMPORT_TIMEOUT_SECS = 60.0
_REPORT_CHARS = 4000


def entry_module_name(entrypoint: str) -> str:
    """snooze_model.py -> snooze_model; sub/model.py -> sub.model."""
    return os.path.normpath(entrypoint)[: -len(".py")].replace(os.sep, ".")


def import_model_class(package_dir: str, entrypoint: str, class_name: str) -> tuple[type | None, list[str]]:
    """Import ``entrypoint`` with ``package_dir`` first on sys.path (the package's sibling modules import as
    on the author's machine); the class named ``class_name`` (None when there is none) and the methods of
    the model contract it lacks. Import errors propagate."""
    if package_dir not in sys.path:
        sys.path.insert(0, package_dir)
    module = importlib.import_module(entry_module_name(entrypoint))
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        return None, []
    return cls, [m for m in ("load", "predict") if not callable(getattr(cls, m, None))]


# ---------------------------------------------------------------------------------------------------
# The probe (child interpreter)


def _frameworks() -> list[str]:
    return sorted(f for f in ML_FRAMEWORKS if f in sys.modules)


def _error(package_dir: str | None = None) -> str:
    """The traceback of the exception being handled: the package's frames when there are, else the last few."""
    exc = sys.exc_info()[1]
    frames: list[traceback.FrameSummary] = traceback.extract_tb(exc.__traceback__ if exc else None)
    if package_dir:
        own = [f for f in frames if f.filename.startswith(package_dir + os.sep)]
        frames = own or frames[-4:]
    else:
        frames = frames[-4:]
    text = "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(*sys.exc_info()[:2]))
    if package_dir:
        text = text.replace(package_dir + os.sep, "")
    return text[-_REPORT_CHARS:]


def _import_entry_file(entry_file: str) -> dict[str, Any]:
    """A rendered model.py: it must import with numpy and the standard library and define TritonPythonModel."""
    # The entry file imports the runtime copied beside it, not the one this probe runs from.
    for name in [n for n in sys.modules if n == "python_backend" or n.startswith("python_backend.")]:
        del sys.modules[name]
    if "triton_python_backend_utils" not in sys.modules:  # provided by Triton's stub only
        sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
    try:
        spec = importlib.util.spec_from_file_location("snooze_probe_entry", entry_file)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException:
        return {"ok": False, "error": _error(), "frameworks": _frameworks()}
    return {"ok": True, "frameworks": _frameworks(), "has_class": hasattr(module, "TritonPythonModel")}


def _import_package(package_dir: str, entrypoint: str, class_name: str) -> dict[str, Any]:
    before = _frameworks()
    try:
        cls, missing = import_model_class(package_dir, entrypoint, class_name)
    except BaseException:
        return {"ok": False, "before": before, "error": _error(package_dir), "frameworks": _frameworks()}
    return {
        "ok": True,
        "before": before,
        "frameworks": _frameworks(),
        "is_class": cls is not None,
        "missing": missing if cls is not None else ["load", "predict"],
    }


def _import_triton_module(path: str, model_dir: str) -> dict[str, Any]:
    """A Triton python model's file, imported as the stub imports model.py (``<version>.<name>``, its version and
    model folders on sys.path) with the stand-in ``triton_python_backend_utils`` of publish's auto-complete."""
    version_dir = os.path.dirname(path)
    for folder in (version_dir, model_dir):
        if folder not in sys.path:
            sys.path.append(folder)
    before = _frameworks()
    try:
        module = importlib.import_module(f"{os.path.basename(version_dir)}.{os.path.basename(path)[: -len('.py')]}")
    except BaseException:
        return {"ok": False, "error": _error(model_dir), "frameworks": _frameworks(), "before": before}
    cls = getattr(module, "TritonPythonModel", None)
    return {
        "ok": True,
        "before": before,
        "frameworks": _frameworks(),
        "has_class": isinstance(cls, type),
        "has_execute": callable(getattr(cls, "execute", None)),
    }


def probe_job(job: dict[str, Any]) -> dict[str, Any]:
    """One job, in the current process (the forked child)."""
    os.environ.update(job.get("env") or {})
    if job.get("cwd"):
        os.chdir(job["cwd"])
    triton = job.get("triton_module")
    if triton:
        # Only the control plane's probe gets this job: the stand-in is publish's, not part of the travelling runtime.
        from .auto_complete import STANDIN_NAME, standin_module

        sys.modules[STANDIN_NAME] = standin_module(triton["model_dir"])
    result: dict[str, Any] = {"baseline": _frameworks()}
    if job.get("entry_file"):
        result["entry"] = _import_entry_file(job["entry_file"])
    if triton:
        result["triton"] = _import_triton_module(triton["file"], triton["model_dir"])
    if job.get("entrypoint"):
        result["package"] = _import_package(job["package_dir"], job["entrypoint"], job.get("class_name") or "Model")
    return result


def run_forked(job: dict[str, Any]) -> dict[str, Any]:
    """``probe_job`` in a forked child with its own process group; its answer, or why there is none."""
    timeout = float(job.get("timeout") or IMPORT_TIMEOUT_SECS)
    answer_r, answer_w = os.pipe()
    output = os.memfd_create("snooze-probe-output")  # the child's stdout and stderr: user prints land here
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            os.setpgid(0, 0)
            os.close(answer_r)
            os.dup2(output, 1)
            os.dup2(output, 2)
            answer = json.dumps(probe_job(job)).encode()
            while answer:
                answer = answer[os.write(answer_w, answer) :]
        except BaseException:
            code = 70
        finally:
            os._exit(code)
    with _suppress_race():
        os.setpgid(pid, pid)  # also here: the group exists before any kill, whoever runs first
    os.close(answer_w)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    timed_out = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([answer_r], [], [], left)[0]:
            timed_out = True
            break
        chunk = os.read(answer_r, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(answer_r)
    if timed_out:
        with _suppress_race():
            os.killpg(pid, signal.SIGKILL)  # the job and whatever it started
    _, status = os.waitpid(pid, 0)
    os.lseek(output, 0, os.SEEK_SET)
    printed = os.read(output, 1 << 20).decode("utf-8", errors="replace")
    os.close(output)
    if timed_out:
        return {"timeout": timeout}
    try:
        return json.loads(b"".join(chunks))
    except ValueError:  # exit codes as subprocess gives them: negative for a signal
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return {"crashed": code, "output": "\n".join(printed.strip().splitlines()[-12:])}


class _suppress_race:
    """ProcessLookupError / PermissionError from a process that already ended or exec'd: nothing to do."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, *_: Any) -> bool:
        return kind is not None and issubclass(kind, (ProcessLookupError, PermissionError))


def serve(stdin: Any = None, stdout: Any = None) -> None:
    """Answer jobs from ``stdin`` until it closes."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    try:
        import numpy  # noqa: F401  (every package and runtime imports it: once here, not once per job)
    except ImportError:
        pass
    for line in stdin:
        if not line.strip():
            continue
        stdout.write(json.dumps(run_forked(json.loads(line))) + "\n")
        stdout.flush()


if __name__ == "__main__":
    serve()
