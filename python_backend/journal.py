"""The request journal, write side: which requests this model process is running.

Before each batch, the ids of its requests (``x-request-id``, which the gateway's Envoy gives every
request that has none, forwarded by Triton as a request parameter) are written to
``$SNOOZE_JOURNAL_DIR/<pid>-<start ticks>.journal``. If the process dies, the control plane reads the
batch it was running and never runs those requests again; requests that failed on the dead process
without reaching it are served after recovery.
(``controlplane/triton/journal.py`` reads it, with the names and layout defined here: a little-endian
u32 byte count, then the ids joined by newlines. The stub cannot import the control plane, so this
module is where both sides take them from.)

A memory-mapped file on the journal folder (a tmpfs in the deployed topologies): one copy into the
page cache per batch, no system call.

The file's last 16 bytes (``TRAILER``) say whether the process is idle, for the control plane's fast
eviction (``controlplane/lifecycle/unloading.py``): a u64 with the CLOCK_MONOTONIC nanoseconds at which
the last batch ended, a u32 that is 1 while a batch runs (from before ``record`` returns to after the
batch's results are made), and a u32 of flags: bit 0, the model declares ``unload()`` (its clean-up
must run, so it is not ended early).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from typing import Any

JOURNAL_ENV = "SNOOZE_JOURNAL_DIR"
# Envoy's request id header; Triton forwards it to the stub as a request parameter of the same name.
REQUEST_ID_PARAMETER = "x-request-id"
SIZE = 1 << 16
TRAILER = 16  # u64 last batch end (monotonic ns), u32 busy, u32 flags; at SIZE - TRAILER
TRAILER_LAYOUT = struct.Struct("<QII")
LENGTH = struct.Struct("<I")  # the ids' byte count, at 0
FLAG_DECLARES_UNLOAD = 1
_TRAILER_AT = SIZE - TRAILER
_BUSY_AT = SIZE - 8
_IDLE = struct.Struct("<QI")  # end ns and busy = 0, written together
_KEY = f'"{REQUEST_ID_PARAMETER}":"'

# The files a model process keeps in the journal folder, each ``<pid>-<start ticks><suffix>``, except the
# preforked parents' ``<PARENT_PREFIX><key><PARENT_SUFFIX>``.
JOURNAL_SUFFIX = ".journal"  # the request journal
PHASE_SUFFIX = ".phase"  # note_phase: the part of a load a stub is in
WORKER_SUFFIX = ".worker"  # a preforked model's worker status (preforked.py)
SEQUENCES_SUFFIX = ".sequences"  # a stateful model's live sequences (sequences.py)
WARMUP_SUFFIX = ".warmup"  # what a process's warm-up did (warmup.py)
PARENT_PREFIX, PARENT_SUFFIX = "prefork-", ".parent"  # a preforked parent's record (prefork_parent.py)
WAKE_SOCKET = "wake.sock"  # the control plane's wake route (bls_wake.py; doze.py asks it for room)


def start_ticks(pid: int | str = "self") -> int:
    """Field 22 of /proc/<pid>/stat: with the pid, names this process for good."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    return int(raw[raw.rfind(b")") + 2 :].split()[19])


def unreachable(error: OSError, path: str, bound_secs: float) -> str:
    """Why the control plane's wake route (``WAKE_SOCKET``, asked by bls_wake.py and doze.py) gave no answer."""
    if isinstance(error, FileNotFoundError):
        return f"no snoozeml control plane listens at {path} (it is not running here)"
    if isinstance(error, ConnectionRefusedError):
        return f"the snoozeml control plane at {path} refused the call (it is stopping)"
    if isinstance(error, TimeoutError):
        return f"the snoozeml control plane did not answer within {bound_secs:g} s"
    return f"the snoozeml control plane at {path} could not be reached: {error}"


def request_id(parameters: str) -> str:
    """The gateway's id from a request's parameters JSON ('' when it has none)."""
    at = parameters.find(_KEY)
    if at >= 0:
        start = at + len(_KEY)
        return parameters[start : parameters.find('"', start)]
    if REQUEST_ID_PARAMETER not in parameters.lower():
        return ""
    # Spaced JSON, or a header spelled in capitals by an HTTP client that reached Triton directly.
    for key, value in json.loads(parameters).items():
        if key.lower() == REQUEST_ID_PARAMETER and isinstance(value, str):
            return value
    return ""


def own_file(directory: str, suffix: str) -> str:
    """``<directory>/<pid>-<start ticks><suffix>``: a file about this process (journal, worker note)."""
    return os.path.join(directory, f"{os.getpid()}-{start_ticks()}{suffix}")


class WorkerNote:
    """``<journal dir>/<pid>-<start ticks>.worker``: what the control plane reads of this stub's preforked worker
    (its pid, how it ended; ``preforked.py``). Absent while no worker lives (a doze)."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}

    def start(self, **fields: Any) -> None:
        """A new worker: its note replaces the last one's."""
        self.fields = dict(fields)
        self.write()

    def write(self, **fields: Any) -> None:
        """Add ``fields`` to the note of the worker started last (none started: nothing to say)."""
        directory = os.environ.get(JOURNAL_ENV)
        if not directory or not self.fields:
            return
        self.fields.update(fields)
        path = own_file(directory, WORKER_SUFFIX)
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.fields, f)
            os.replace(tmp, path)
        except OSError:
            pass

    def remove(self) -> None:
        directory = os.environ.get(JOURNAL_ENV)
        if directory:
            try:
                os.unlink(own_file(directory, WORKER_SUFFIX))
            except OSError:
                pass


def note_phase(phase: str, *, stub: tuple[int, int] | None = None, **fields: Any) -> None:
    """Say which part of a load this model process is in (import, load, warm-up; "ready" once done), in
    ``<journal dir>/<stub pid>-<start ticks>.phase``: a load the control plane abandons at its timeout is
    reported with the phase it hung in. ``stub``: (pid, start ticks) of the stub, when a preforked worker
    writes it for its stub."""
    directory = os.environ.get(JOURNAL_ENV)
    if not directory:
        return
    try:
        pid, ticks = stub if stub is not None else (os.getpid(), start_ticks())
        path = os.path.join(directory, f"{pid}-{ticks}{PHASE_SUFFIX}")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"phase": phase, "since": time.time(), "pid": os.getpid(), **fields}, f)
        os.replace(tmp, path)
    except OSError:
        pass


def clear_batch() -> None:
    """Empty this process's journal: the batch in it never reached a model process (its preforked
    worker was already gone), so the control plane may send those requests again after recovery."""
    directory = os.environ.get(JOURNAL_ENV)
    if not directory:
        return
    try:
        fd = os.open(own_file(directory, JOURNAL_SUFFIX), os.O_WRONLY)
    except OSError:
        return
    try:
        os.pwrite(fd, LENGTH.pack(0), 0)  # the same page the journal's map writes: seen at once
    finally:
        os.close(fd)


class RequestJournal:
    def __init__(self, directory: str) -> None:
        self.path = own_file(directory, JOURNAL_SUFFIX)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o660)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)

    @classmethod
    def from_environment(cls) -> RequestJournal | None:
        """A journal in $SNOOZE_JOURNAL_DIR, or None when it is unset or unusable (then nothing is written)."""
        directory = os.environ.get(JOURNAL_ENV)
        if not directory:
            return None
        try:
            return cls(directory)
        except OSError:
            return None

    def record(self, requests: list[Any]) -> None:
        if len(requests) == 1:  # the common case at low load: no join
            data = request_id(requests[0].parameters()).encode()
        else:
            data = "\n".join([request_id(r.parameters()) for r in requests]).encode()
        self._map[_BUSY_AT] = 1  # before the ids: a batch is running from here on
        if len(data) > SIZE - 4 - TRAILER:
            data = data[: SIZE - 4 - TRAILER]
        self._map[4 : 4 + len(data)] = data
        LENGTH.pack_into(self._map, 0, len(data))

    def batch_done(self) -> None:
        """The batch ``record`` announced has its results: the process is idle again."""
        _IDLE.pack_into(self._map, _TRAILER_AT, time.monotonic_ns(), 0)

    def declare(self, *, unload: bool) -> None:
        """What the model declares: an ``unload()`` whose clean-up must run at the end (no early end)."""
        self._map[SIZE - 4] = FLAG_DECLARES_UNLOAD if unload else 0

    def close(self) -> None:
        """A clean end (unload): the journal goes with the process."""
        self._map.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
