"""The conversion worker, seen from the control plane: ``python -m converters.worker`` run in a child process
(user code and torch never load here), its stage lines forwarded as progress, stopped at a timeout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from controlplane.errors import SnoozeError
from converters.worker import PROGRESS_PREFIX

DEFAULT_TIMEOUT_SECS = 900.0

Progress = Callable[[str], None]


class ConversionFailed(SnoozeError):
    """A conversion the user asked for explicitly (snoozectl convert) did not succeed."""

    status_code = 422
    code = "conversion_failed"


def run_worker(
    request: Mapping[str, Any],
    *,
    progress: Progress | None = None,
    timeout: float = DEFAULT_TIMEOUT_SECS,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run `python -m converters.worker` on `request` and return its result object.

    Stage lines (`progress: ...`) on the child's stderr go to `progress`; other lines are kept (the
    last 40) for the error message. Raises ConversionFailed when the child times out (its process
    group is killed), crashes, or writes no result.
    """
    notify = progress or (lambda _stage: None)
    with tempfile.TemporaryDirectory(prefix="snooze-convert-") as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(dict(request)), encoding="utf-8")
        child_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "converters.worker", str(request_path), str(result_path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            cwd=tmp,
            env=child_env,
            start_new_session=True,  # its own process group: a timeout kills the whole tree
        )
        tail: deque[str] = deque(maxlen=40)

        def pump() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                line = line.rstrip("\n")
                if line.startswith(PROGRESS_PREFIX):
                    with contextlib.suppress(Exception):
                        notify(line[len(PROGRESS_PREFIX) :])
                elif line.strip():
                    tail.append(line)

        reader = threading.Thread(target=pump, name="convert-worker-stderr", daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(timeout=5)
            raise ConversionFailed(
                f"conversion ({request.get('op')}) did not finish within {timeout:.0f} s; the worker was stopped",
                hint="raise the timeout, or check that the export hook does not hang",
            ) from None
        reader.join(timeout=5)
        if result_path.is_file():
            return json.loads(result_path.read_text(encoding="utf-8"))
        output = "\n".join(tail) or "(no output)"
        raise ConversionFailed(
            f"the conversion worker exited with status {code} and wrote no result; its last output:\n{output}",
            hint="a crash in native code (segfault, out of memory) ends the worker this way",
        )
