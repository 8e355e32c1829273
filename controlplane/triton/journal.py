"""Which requests a model process had received when it died: the request journal, read side.

Every inference request through the gateway carries an ``x-request-id`` header (Envoy's own: a UUID for a
request that comes without one; a client that sends its own should keep it unique, see below), which Triton
forwards to the python backend as a request parameter (``--http-header-forward-pattern`` /
``--grpc-header-forward-pattern``). Before each batch runs, the runtime in the stub writes the ids of
that batch to its journal, ``<journal dir>/<pid>-<start ticks>.journal`` (``python_backend/journal.py``
writes it and defines the names and the layout below; this side imports them). When a stub dies, its journal holds the
batch it was running: those requests reached a live model process and must not be run again; any
other request that failed on the dead stub never reached it and is served after recovery. An id that two
requests share can only make that more careful: a request whose id is in the journal is never run again,
whichever of the two reached the process.

Layout: a little-endian u32 byte count, then the ids joined by newlines (UTF-8). The file is ``SIZE``
bytes; its last ``TRAILER`` bytes say whether the process is idle (``read_activity``): a u64 with the
CLOCK_MONOTONIC nanoseconds at which its last batch ended, a u32 that is 1 while a batch runs, and a u32
of flags (bit 0: the model declares ``unload()``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from controlplane.triton.processes import StubProcess, read_stat
from python_backend.journal import (
    FLAG_DECLARES_UNLOAD,
    JOURNAL_ENV,
    JOURNAL_SUFFIX,
    LENGTH,
    PARENT_PREFIX,
    PARENT_SUFFIX,
    PHASE_SUFFIX,
    REQUEST_ID_PARAMETER,
    SEQUENCES_SUFFIX,
    SIZE,
    TRAILER,
    TRAILER_LAYOUT,
    WARMUP_SUFFIX,
    WORKER_SUFFIX,
)

__all__ = [
    "HEADER_FORWARD_ARGS",
    "JOURNAL_ENV",
    "PARENT_PREFIX",
    "PARENT_SUFFIX",
    "PHASE_SUFFIX",
    "REQUEST_ID_HEADER",
    "SEQUENCES_SUFFIX",
    "SIZE",
    "TRAILER",
    "WARMUP_SUFFIX",
    "WORKER_SUFFIX",
    "Activity",
    "hung_phase",
    "has_journal",
    "journal_path",
    "prepare_journal_dir",
    "read_activity",
    "read_journal",
    "remove_journal",
    "remove_stale",
    "sequences_note",
    "sequences_until",
]

REQUEST_ID_HEADER = REQUEST_ID_PARAMETER  # what Envoy sets; Triton forwards it under the same name
# Triton's flags that hand the header to the python backend as a request parameter.
HEADER_FORWARD_ARGS = (
    f"--http-header-forward-pattern=^{REQUEST_ID_HEADER}$",
    f"--grpc-header-forward-pattern=^{REQUEST_ID_HEADER}$",
)


def journal_path(journal_dir: Path, pid: int, start_ticks: int) -> Path:
    return journal_dir / f"{pid}-{start_ticks}{JOURNAL_SUFFIX}"


def has_journal(journal_dir: Path, stub: StubProcess) -> bool:
    """The stub's journal is still there: it has not ended cleanly (its runtime removes it then)."""
    return journal_path(journal_dir, stub.pid, stub.start_ticks).exists()


def read_journal(journal_dir: Path, stub: StubProcess) -> set[str] | None:
    """The request ids of the last batch the stub received; None when it kept no journal."""
    try:
        raw = journal_path(journal_dir, stub.pid, stub.start_ticks).read_bytes()
    except OSError:
        return None
    if len(raw) < 4:
        return set()
    (size,) = LENGTH.unpack_from(raw)
    return {i for i in raw[4 : 4 + size].decode("utf-8", "replace").split("\n") if i}


@dataclass(frozen=True)
class Activity:
    """What a model process's journal says about it now."""

    busy: bool  # a batch is running (between the journal's record and the batch's results)
    last_end_ns: int  # CLOCK_MONOTONIC nanoseconds when its last batch ended (0: none yet)
    declares_unload: bool  # the model has an unload() that must run at the end


def read_activity(journal_dir: Path, stub: StubProcess) -> Activity | None:
    """The trailer of the stub's journal; None when it keeps none (no journal folder, an older runtime)."""
    try:
        fd = os.open(journal_path(journal_dir, stub.pid, stub.start_ticks), os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, TRAILER, SIZE - TRAILER)
    finally:
        os.close(fd)
    if len(raw) != TRAILER:
        return None
    end_ns, busy, flags = TRAILER_LAYOUT.unpack(raw)
    return Activity(busy != 0, end_ns, bool(flags & FLAG_DECLARES_UNLOAD))


def remove_journal(journal_dir: Path, stub: StubProcess) -> None:
    """The dead stub's journal and, for a preforked model, its worker note (``workers.py``)."""
    journal_path(journal_dir, stub.pid, stub.start_ticks).unlink(missing_ok=True)
    (journal_dir / f"{stub.pid}-{stub.start_ticks}{WORKER_SUFFIX}").unlink(missing_ok=True)
    (journal_dir / f"{stub.pid}-{stub.start_ticks}{PHASE_SUFFIX}").unlink(missing_ok=True)


def initialize_started(journal_dir: Path, stub: StubProcess) -> bool:
    """The stub has reached the model's ``initialize`` (it wrote a phase note). Before that, Triton 2.51
    waits for the stub's first message with no time limit: a stub killed there leaves the load, and
    Triton's stop, waiting for ever (measured under churn: a cancel's SIGKILL 0.1 s into a stub's start).
    From ``initialize`` on, Triton checks the stub's health every second and fails the load once it died."""
    return (journal_dir / f"{stub.pid}-{stub.start_ticks}{PHASE_SUFFIX}").exists()


def hung_phase(journal_dir: Path | None, stubs: list[StubProcess], now: float | None = None) -> str | None:
    """Where a load of ``stubs`` is stuck, from their phase notes: "its warm-up (for 12 s, in model process
    pid 7)"; None when no stub said (no journal folder, a remote Triton, a stub that never started)."""
    if journal_dir is None:
        return None
    now = time.time() if now is None else now
    for stub in stubs:
        try:
            raw = json.loads((journal_dir / f"{stub.pid}-{stub.start_ticks}{PHASE_SUFFIX}").read_text("utf-8"))
            phase, since, pid = str(raw["phase"]), float(raw["since"]), int(raw.get("pid") or stub.pid)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if phase == "ready":
            continue
        where = f"its preforked worker pid {pid}" if pid != stub.pid else f"model process pid {stub.pid}"
        return f"its {phase} (for {max(0.0, now - since):.1f} s, in {where})"
    return None


def sequences_until(journal_dir: Path, stub: StubProcess) -> float:
    """Until when (epoch seconds) one of the stub's sequences may be live; 0.0 when none is, or it wrote
    no note (not a stateful model, no journal folder)."""
    return sequences_note(journal_dir, stub)[1]


def sequences_note(journal_dir: Path, stub: StubProcess) -> tuple[int, float]:
    """(how many sequences the stub noted live, until when one may be live); (0, 0.0) without a note."""
    try:
        raw = json.loads((journal_dir / f"{stub.pid}-{stub.start_ticks}{SEQUENCES_SUFFIX}").read_text("utf-8"))
        return int(raw.get("live", 0)), float(raw["until"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0, 0.0


def _owner(path: Path) -> tuple[int, int] | None:
    """(pid, start ticks) of the process a file of the journal folder is about; None: not ours."""
    name = path.name
    for suffix in (JOURNAL_SUFFIX, WORKER_SUFFIX, SEQUENCES_SUFFIX, WARMUP_SUFFIX, PHASE_SUFFIX):
        if name.endswith(suffix):
            pid, _, ticks = name[: -len(suffix)].partition("-")
            with contextlib.suppress(ValueError):
                return int(pid), int(ticks)
            return None
    if name.startswith(PARENT_PREFIX) and name.endswith(PARENT_SUFFIX):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            raw = json.loads(path.read_text(encoding="utf-8"))
            return int(raw["pid"]), int(raw["start_ticks"])
    return None


def remove_stale(journal_dir: Path, proc_root: Path = Path("/proc")) -> int:
    """Remove the journals, worker notes and parent records of processes that are gone (dead, or the
    pid reused); how many."""
    removed = 0
    with contextlib.suppress(OSError):
        for path in journal_dir.iterdir():
            owner = _owner(path)
            if owner is None:
                continue
            stat = read_stat(owner[0], proc_root)
            if stat is None or stat.state == "Z" or stat.start_ticks != owner[1]:
                path.unlink(missing_ok=True)
                removed += 1
    return removed


def prepare_journal_dir(journal_dir: Path) -> Path:
    """Create the folder the stubs write to; world-writable with the sticky bit is not needed: the
    control plane and Triton run as the same uid in every topology that can use it."""
    journal_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(journal_dir, 0o770)
    return journal_dir
