"""Child processes that never outlive the control plane.

tritonserver and Envoy run in their own sessions (so that ``stop()`` can kill a whole process group),
which also means nothing takes them down when the control plane is killed with SIGKILL: they kept
serving, holding the gateway ports and their memory, and a restarted ``snoozectl serve`` could not
bind. ``spawn`` asks the kernel to SIGKILL the child when its parent goes (``PR_SET_PDEATHSIG``).

The kernel ties that signal to the *thread* that forked the child, not to the process: a child
started from a short-lived worker thread (``asyncio.to_thread``, a closed event loop's executor)
would be killed when that thread ends. So every child is forked from one thread that lives as long
as the interpreter.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil

PR_SET_PDEATHSIG = 1

_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()
_prctl = None
if sys.platform == "linux":
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # no prctl: children are stopped by stop() only
        _prctl = None


def _die_with_parent(parent: int) -> None:
    """Runs in the child between fork and exec: nothing here may take a lock or allocate much."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above: the signal would never come
        os._exit(1)


def _executor() -> ThreadPoolExecutor:
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snooze-spawner")
        return _spawner


def spawn(cmd: list[str], **popen_kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(cmd, **popen_kwargs)``; the child is SIGKILLed when this process dies."""
    parent = os.getpid()

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(cmd, preexec_fn=lambda: _die_with_parent(parent), **popen_kwargs)  # noqa: PLW1509

    return _executor().submit(start).result()


def kill_group(pgid: int) -> None:
    """SIGKILL a whole process group (a child started with ``start_new_session``); gone is fine."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM the leader, wait up to ``timeout`` for a graceful exit, then SIGKILL its whole group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    kill_group(proc.pid)
    proc.wait()


def log_tail(path: os.PathLike[str] | str, offset: int, lines: int) -> str:
    """The last ``lines`` lines written to ``path`` after byte ``offset`` (this run's part of the log)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def wait_gone(procs: list[psutil.Process], timeout: float) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """``psutil.wait_procs``: (gone, alive) after at most ``timeout`` seconds. Where psutil's wait fails outright (on
    Linux 6.x ``pidfd_open`` of a process reaped meanwhile can fail with ENOENT, which psutil 7 raises), each process
    is polled instead until it is gone (a zombie counts as gone) or the time is up."""
    try:
        return psutil.wait_procs(procs, timeout=timeout)
    except OSError:
        pass
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while True:
        alive = [p for p in alive if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return [p for p in procs if p not in alive], alive
        time.sleep(0.02)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False
