"""Check that a custom package imports, in a child process: the control plane never runs user code
in its own process. The child imports the entrypoint the way the python-backend runtime does
(package folder first on sys.path, module named after the file) and checks the class contract."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
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
