"""A Triton python model's ``auto_complete_config``, run once at publish in a child process (the control plane
never runs user code in its own process): ``python -m python_backend.auto_complete``, bounded in time, its
process group killed past the limit. See python_backend/auto_complete.py for the stand-in it runs against."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from controlplane.child_processes import kill_group
from controlplane.errors import InvalidPackageError

AUTO_COMPLETE_TIMEOUT_SECS = 60.0
# The last lines of a failure's output shown in the error (a traceback, what the model logged).
ERROR_LINES = 25


def run_auto_complete(
    entry: Path, model_dir: Path, config: dict[str, Any], *, model_id: str, timeout: float | None = None
) -> dict[str, Any]:
    """The config ``entry``'s ``TritonPythonModel.auto_complete_config`` returns for ``config`` (Triton's JSON);
    InvalidPackageError naming the model and file when it fails, returns no config or runs past ``timeout``
    (default ``AUTO_COMPLETE_TIMEOUT_SECS``)."""
    timeout = AUTO_COMPLETE_TIMEOUT_SECS if timeout is None else timeout
    root = str(Path(__file__).resolve().parents[1])  # where python_backend is, installed or not
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # no __pycache__ left in the user's folder
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    where = f"model '{model_id}' ({entry})"
    with tempfile.TemporaryDirectory(prefix="snooze-auto-complete-") as tmp:
        job_file, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job = {
            "entry": str(entry.resolve()),
            "model_dir": str(model_dir.resolve()),
            "version": entry.parent.name,
            "config": config,
            "result": str(result),
        }
        job_file.write_text(json.dumps(job), encoding="utf-8")
        proc = subprocess.Popen(
            [sys.executable, "-m", "python_backend.auto_complete", str(job_file)],
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its whole group is killed past the limit (a model may start processes)
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.communicate()
            raise InvalidPackageError(
                f"{where}: auto_complete_config did not finish within {timeout:g} s",
                hint="make auto_complete_config return quickly (it only describes the model: no weights, no "
                "framework work), or write the config in config.pbtxt",
            ) from None
        finally:
            kill_group(proc.pid)  # what the model may have left running
        if proc.returncode != 0 or not result.is_file():
            tail = "\n".join(output.strip().splitlines()[-ERROR_LINES:])
            raise InvalidPackageError(
                f"{where}: auto_complete_config failed (exit status {proc.returncode}):\n{tail}",
                hint="fix the error above (snoozeml runs auto_complete_config once, at publish, outside Triton, with "
                "the pb_utils.ModelConfig API), or write the complete config in config.pbtxt",
            )
        completed = json.loads(result.read_text(encoding="utf-8"))
    if not isinstance(completed, dict):
        raise InvalidPackageError(f"{where}: auto_complete_config returned no config")
    return completed
