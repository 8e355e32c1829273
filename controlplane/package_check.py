"""Check that a custom package imports, in a child process: the control plane never runs user code
in its own process. The child imports the entrypoint the way the python-backend runtime does
(package folder first on sys.path, module named after the file) and checks the class contract."""

from __future__ import annotations

import ast
import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

IMPORT_CHECK_TIMEOUT_SECS = 30.0
_MAX_REPORT_CHARS = 4000

_CHILD = r"""
import importlib, os, sys, traceback
package_dir, entrypoint, class_name = sys.argv[1:4]
sys.path.insert(0, package_dir)
module_name = os.path.normpath(entrypoint)[: -len(".py")].replace(os.sep, ".")
try:
    module = importlib.import_module(module_name)
except BaseException as exc:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(package_dir)]
    text = "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(exc))
    sys.stderr.write(text.replace(package_dir + os.sep, ""))
    sys.exit(3)
cls = getattr(module, class_name, None)
if not isinstance(cls, type):
    sys.stderr.write(f"{entrypoint} defines no class {class_name!r}")
    sys.exit(4)
missing = [m for m in ("load", "predict") if not callable(getattr(cls, m, None))]
if missing:
    sys.stderr.write(f"class {class_name} in {entrypoint} has no {' or '.join(missing)} method")
    sys.exit(5)
"""


def check_import(
    package_dir: Path,
    entrypoint: str,
    class_name: str,
    timeout: float = IMPORT_CHECK_TIMEOUT_SECS,
    *,
    env: Mapping[str, str] | None = None,
) -> str | None:
    """None when ``entrypoint`` imports and defines ``class_name`` with load/predict; else the problem
    (the traceback of the import, relative to the package). ``env`` is the manifest's env."""
    folder = str(Path(package_dir).resolve())
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, folder, entrypoint, class_name],
        cwd=folder,
        env={**os.environ, **(env or {}), "PYTHONDONTWRITEBYTECODE": "1"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # the whole group is killed on timeout, children of the import too
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return (
            f"importing {entrypoint} took longer than {timeout:g}s; module-level code must be quick "
            "(import heavy frameworks and load weights inside load())"
        )
    if proc.returncode == 0:
        return None
    report = err.decode("utf-8", errors="replace").strip()[-_MAX_REPORT_CHARS:]
    if proc.returncode == 3:
        return f"importing {entrypoint} failed:\n{report}"
    if proc.returncode in (4, 5):
        return report
    return f"importing {entrypoint} ended the process (exit code {proc.returncode}){': ' + report if report else ''}"


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
            tree = ast.parse((package_dir / rel).read_bytes(), filename=rel)
        except (SyntaxError, ValueError):
            continue  # the import check reports a file that does not parse
        for line, name in _required_imports(tree):
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


def _required_imports(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, module) of absolute imports that are not guarded by ``except ImportError``."""
    guarded: set[int] = set()  # ids of nodes inside a try body whose handlers catch ImportError
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            guarded.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return handler.type is None or any(isinstance(k, ast.Name) and k.id in names for k in kinds)
