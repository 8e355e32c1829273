"""Asking a model's stub to doze, and reading whether it woke: the control plane's side of
``python_backend/doze.py``.

A stub that can doze listens on ``<journal dir>/<pid>-<start ticks>.doze``; one ask, one JSON answer. Whether a
dozing stub woke since is read from its ``.worker`` note (``python_backend/preforked.py``): the note is gone while
it dozes, and a wake writes it again with the new worker's pid and ``wake_secs``. Blocking calls: the lifecycle runs
them in worker threads.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from controlplane.triton.processes import StubProcess, read_stat
from python_backend.doze import BUSY, DOZE, DOZE_SUFFIX, MAX_MESSAGE, STATE, socket_address
from python_backend.journal import WORKER_SUFFIX

# How long a doze may take: the model's unload() in its worker gets python_backend.preforked.DOZE_UNLOAD_SECS
# (10 s), and its exit as long again, before the stub answers.
DOZE_ASK_SECS = 25.0
STATE_ASK_SECS = 2.0  # a state answer takes no lock: only a stub that hangs as a whole is slower


@dataclass(frozen=True)
class DozeAnswer:
    """A stub's answer to a doze: it dozed, or why not (``busy``: a batch runs; asked again later)."""

    dozed: bool
    why: str = ""
    secs: float | None = None

    @property
    def busy(self) -> bool:
        return not self.dozed and self.why == BUSY


@dataclass(frozen=True)
class Wake:
    """A dozing stub's worker came back: a request woke it in ``secs`` (None: not said)."""

    worker_pid: int
    secs: float | None


class StubControl(Protocol):
    """What the lifecycle asks of a stub that can doze (``SocketStubControl``; the fast tier has its own)."""

    def doze(self, stub: StubProcess) -> DozeAnswer: ...

    def woke(self, stub: StubProcess) -> Wake | None: ...

    def dozing(self, stub: StubProcess) -> bool: ...


class SocketStubControl:
    """The stubs' doze sockets and worker notes in ``journal_dir`` (None: no journal, no doze)."""

    def __init__(self, journal_dir: Path | None, proc_root: Path = Path("/proc")) -> None:
        self.journal_dir = journal_dir
        self.proc_root = proc_root

    def doze(self, stub: StubProcess) -> DozeAnswer:
        if self.journal_dir is None:
            return DozeAnswer(False, "no journal folder: the stubs cannot be asked")
        path = self.journal_dir / f"{stub.pid}-{stub.start_ticks}{DOZE_SUFFIX}"
        try:
            raw = _ask(str(path), DOZE, DOZE_ASK_SECS)
        except FileNotFoundError:
            return DozeAnswer(False, "its stub cannot doze (in-stub, or a runtime without doze)")
        except (OSError, ValueError) as e:
            return DozeAnswer(False, f"its stub did not answer ({type(e).__name__}: {e})")
        secs = raw.get("secs")
        return DozeAnswer(bool(raw.get("dozed")), str(raw.get("why") or ""), float(secs) if secs is not None else None)

    def dozing(self, stub: StubProcess) -> bool:
        """Whether the stub dozes now (asked on its socket; False where it cannot doze or does not answer)."""
        return self.state(stub).get("dozing") is True

    def state(self, stub: StubProcess) -> dict[str, Any]:
        """The stub's doze state (``python_backend/doze.py``'s ``state`` answer: dozing, its wakes, the last one's
        time and its ask for room); empty where it cannot doze or does not answer."""
        if self.journal_dir is None:
            return {}
        try:
            return _ask(str(self.journal_dir / f"{stub.pid}-{stub.start_ticks}{DOZE_SUFFIX}"), STATE, STATE_ASK_SECS)
        except (OSError, ValueError):
            return {}

    def woke(self, stub: StubProcess) -> Wake | None:
        """The live worker a dozing stub's note names (a request woke it), or None (still dozing, or gone)."""
        if self.journal_dir is None:
            return None
        note = self.journal_dir / f"{stub.pid}-{stub.start_ticks}{WORKER_SUFFIX}"
        try:
            raw = json.loads(note.read_text(encoding="utf-8"))
            pid, ticks = int(raw["pid"]), int(raw.get("start_ticks") or 0)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        stat = read_stat(pid, self.proc_root)
        if stat is None or stat.state == "Z" or (ticks and stat.start_ticks != ticks):
            return None
        secs = raw.get("wake_secs")
        return Wake(pid, float(secs) if isinstance(secs, (int, float)) else None)


def _ask(path: str, ask: bytes, timeout: float) -> dict[str, Any]:
    address, dir_fd = socket_address(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(address)
        except ConnectionRefusedError:
            raise FileNotFoundError(path) from None  # a socket left by a stub that is gone: nobody listens
        finally:
            if dir_fd is not None:
                os.close(dir_fd)
        sock.send(ask)
        raw = json.loads(sock.recv(MAX_MESSAGE) or b"{}")
    finally:
        with contextlib.suppress(OSError):
            sock.close()
    if not isinstance(raw, dict):
        raise ValueError(f"not a JSON object: {raw!r}")
    return raw
