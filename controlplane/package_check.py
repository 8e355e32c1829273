"""Importing packages in child processes: the control plane never runs user code in its own process.

Both the publish check (``check_import``) and ``snoozectl validate`` go through the runtime's import probe
(``python_backend/import_probe.py``: the one definition of how a package is imported, its timeout and the
process-group kill of a job that outlives it). A probe is one interpreter that checks many packages, each in
a process forked from it; ``probe_imports`` spreads a batch of jobs over one probe per core.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from controlplane.source_inspect import required_imports
from python_backend.import_probe import IMPORT_TIMEOUT_SECS, ML_FRAMEWORKS

__all__ = [
    "IMPORT_TIMEOUT_SECS",
    "ML_FRAMEWORKS",
    "ImportProbe",
    "ProbePool",
    "check_import",
    "missing_modules",
    "probe_imports",
]


class ImportProbe:
    """One probe interpreter (``python -m python_backend.import_probe``) for this environment."""

    def __init__(self, python: str | None = None) -> None:
        root = str(Path(__file__).resolve().parents[1])  # where python_backend is, installed or not
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # no __pycache__ left in the packages
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [python or sys.executable, "-m", "python_backend.import_probe"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=root,
            start_new_session=True,  # a Ctrl-C of the CLI does not reach it mid-answer; close() ends it
        )

    def run(self, job: Mapping[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(dict(job)) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            return {"crashed": self.proc.poll(), "output": f"the import probe (pid {self.proc.pid}) ended"}
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> ImportProbe:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class ProbePool:
    """Up to ``size`` probes shared by threads: ``run`` takes a free one (started on first need)."""

    def __init__(self, size: int | None = None) -> None:
        self.size = max(1, size or os.cpu_count() or 1)
        self._free: queue.SimpleQueue[ImportProbe] = queue.SimpleQueue()
        self._started: list[ImportProbe] = []
        self._lock = threading.Lock()

    def run(self, job: Mapping[str, Any]) -> dict[str, Any]:
        try:
            probe = self._free.get_nowait()
        except queue.Empty:
            with self._lock:
                fresh = len(self._started) < self.size
                if fresh:
                    self._started.append(ImportProbe())
                    probe = self._started[-1]
            if not fresh:
                probe = self._free.get()
        try:
            return probe.run(job)
        finally:
            self._free.put(probe)

    def close(self) -> None:
        for probe in self._started:
            probe.close()

    def __enter__(self) -> ProbePool:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def probe_imports(jobs: Sequence[Mapping[str, Any]], workers: int | None = None) -> list[dict[str, Any]]:
    """Answers to ``jobs`` (in order), from up to ``workers`` probes (default: one per core)."""
    if not jobs:
        return []
    count = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    with ProbePool(count) as probes, concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(probes.run, jobs))


def check_import(
    package_dir: Path,
    entrypoint: str,
    class_name: str,
    timeout: float = IMPORT_TIMEOUT_SECS,
    *,
    env: Mapping[str, str] | None = None,
) -> str | None:
    """None when ``entrypoint`` imports and defines ``class_name`` with load/predict; else the problem
    (the traceback of the import, relative to the package). ``env`` is the manifest's env."""
    folder = str(Path(package_dir).resolve())
    job = {
        "package_dir": folder,
        "entrypoint": entrypoint,
        "class_name": class_name,
        "env": dict(env or {}),
        "cwd": folder,
        "timeout": timeout,
    }
    with ImportProbe() as probe:
        answer = probe.run(job)
    if "timeout" in answer:
        return (
            f"importing {entrypoint} took longer than {timeout:g}s; module-level code must be quick "
            "(import heavy frameworks and load weights inside load())"
        )
    if "crashed" in answer:
        output = answer.get("output") or ""
        said = f": {output}" if output else ""
        return f"importing {entrypoint} ended the process (exit code {answer['crashed']}){said}"
    package = answer["package"]
    if not package["ok"]:
        return f"importing {entrypoint} failed:\n{package['error'].strip()}"
    if not package["is_class"]:
        return f"{entrypoint} defines no class {class_name!r}"
    if package["missing"]:
        return f"class {class_name} in {entrypoint} has no {' or '.join(package['missing'])} method"
    return None


def check_triton_import(model_file: Path, model_dir: Path, timeout: float = IMPORT_TIMEOUT_SECS) -> str | None:
    """None when a Triton python model's file imports as Triton's stub imports it (``<version>.model``, with a
    stand-in ``triton_python_backend_utils``) and defines TritonPythonModel with execute; else the problem."""
    job = {
        "triton_module": {"file": str(model_file.resolve()), "model_dir": str(model_dir.resolve())},
        "env": {},
        "cwd": str(model_file.parent.resolve()),
        "timeout": timeout,
    }
    with ImportProbe() as probe:
        answer = probe.run(job)
    where = f"{model_file.parent.name}/{model_file.name}"
    if "timeout" in answer:
        return f"importing {where} took longer than {timeout:g}s; module-level code must be quick"
    if "crashed" in answer:
        output = answer.get("output") or ""
        return f"importing {where} ended the process (exit code {answer['crashed']})" + (
            f": {output}" if output else ""
        )
    result = answer["triton"]
    if not result["ok"]:
        return f"importing {where} failed:\n{result['error'].strip()}"
    if not result["has_class"] or not result["has_execute"]:
        return f"{where} defines no class TritonPythonModel with execute(self, requests)"
    return None


def missing_modules(package_dir: Path, files: Iterable[str]) -> list[tuple[str, int, str]]:
    """``(file, line, module)`` for every import in the package's Python files, module level or inside
    a function such as ``load()``, whose top-level module is neither the package's own, nor the
    standard library, nor installed in this interpreter (the one the embedded Triton's python backend
    runs models with). An import inside a ``try`` that catches ImportError is optional and left out.
    Nothing is imported: the files are parsed, and modules are only looked up."""
    own = {Path(f).parts[0].removesuffix(".py") for f in files}
    found: list[tuple[str, int, str]] = []
    for rel in sorted(f for f in files if f.endswith(".py")):
        try:
            imports = required_imports((package_dir / rel).read_bytes(), filename=rel)
        except (SyntaxError, ValueError):
            continue  # the import check reports a file that does not parse
        for line, name in imports:
            top = name.split(".")[0]
            if top in own or top in sys.stdlib_module_names or top in sys.builtin_module_names:
                continue
            try:
                spec = importlib.util.find_spec(top)
            except (ImportError, ValueError):
                spec = None
            if spec is None:
                found.append((rel, line, top))
    return sorted(found)
