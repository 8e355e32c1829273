"""Preforked workers and their preloaded parents, as the control plane sees them.

A preforked model's code runs in a worker process forked from a parent that has already imported
the model's framework (``python_backend/prefork_parent.py``). Neither is a child of tritonserver, so
they are found through files in the request journal folder (``python_backend/preforked.py`` and
``prefork_parent.py`` write them; both sides agree on the names and fields below):

- ``<stub pid>-<stub start ticks>.worker``: the stub's worker: ``{"model", "pid", "start_ticks",
  "parent_key"}``, plus ``"exit_status"`` (a wait status), ``"ended"`` and ``"ran"`` once the worker
  died and took its stub with it;
- ``prefork-<key>.parent``: one parent: ``{"pid", "start_ticks", "preload", "import_secs", "warm_secs", "failed",
  "python", "triton_pid", ...}``.

Memory: a worker shares its parent's pages copy-on-write, so a model is charged its worker's Pss (each shared
page split among the processes that map it), and the parent's own memory is a line of its own in status and in
the memory budget: pages shared with the parent are counted once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from controlplane.triton.journal import PARENT_PREFIX, PARENT_SUFFIX, WORKER_SUFFIX
from controlplane.triton.processes import StubProcess, TritonProcesses, held_bytes, held_split, read_stat
from python_backend.exits import describe_wait_status


@dataclass(frozen=True)
class WorkerProcess:
    """A stub's preforked worker, as its note says."""

    pid: int
    start_ticks: int
    model: str
    stub_pid: int
    exit_status: int | None = None
    ended: str | None = None  # when it died: "while running a batch", "while idle", ...
    ran: bool | None = None  # whether the batch its stub journaled had reached it

    def describe(self) -> str:
        return describe_wait_status(self.exit_status)


@dataclass(frozen=True)
class PreloadedParent:
    pid: int
    start_ticks: int
    key: str
    preload: tuple[str, ...]
    failed: dict[str, str]
    python: str
    import_secs: dict[str, float]
    warm_secs: dict[str, float] = field(default_factory=dict)
    spare_imports: tuple[str, ...] = ()  # modules its spare worker imports after the fork (onnxruntime)
    spare: tuple[int, int] | None = None  # (pid, start ticks) of the spare waiting to be a worker

    def pids(self, proc_root: Path = Path("/proc")) -> list[int]:
        """The parent and its live spare: what is charged as the parent's memory."""
        spare = self.spare
        return [self.pid] + ([spare[0]] if spare is not None and alive(spare[0], spare[1], proc_root) else [])


def worker_note_path(journal_dir: Path, stub: StubProcess) -> Path:
    return journal_dir / f"{stub.pid}-{stub.start_ticks}{WORKER_SUFFIX}"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def worker_of(journal_dir: Path | None, stub: StubProcess) -> WorkerProcess | None:
    """The preforked worker of ``stub`` (alive or not), or None for an in-stub model."""
    if journal_dir is None:
        return None
    raw = _read_json(worker_note_path(journal_dir, stub))
    if raw is None:
        return None
    try:
        status = raw.get("exit_status")
        return WorkerProcess(
            int(raw["pid"]),
            int(raw.get("start_ticks") or 0),
            str(raw.get("model") or stub.model),
            stub.pid,
            int(status) if isinstance(status, int) else None,
            raw.get("ended"),
            raw.get("ran"),
        )
    except (KeyError, TypeError, ValueError):
        return None


def workers_of(journal_dir: Path | None, stubs: Iterable[StubProcess]) -> list[WorkerProcess]:
    return [w for w in (worker_of(journal_dir, s) for s in stubs) if w is not None]


def alive(pid: int, start_ticks: int, proc_root: Path = Path("/proc")) -> bool:
    stat = read_stat(pid, proc_root)
    return stat is not None and stat.state != "Z" and (not start_ticks or stat.start_ticks == start_ticks)


def worker_bytes(
    workers: Iterable[WorkerProcess], proc_root: Path = Path("/proc"), *, max_age: float = 0.0
) -> tuple[int, int]:
    """What the workers hold, (Pss, private bytes): a page shared with their parent is split between them, so the
    parents' Pss and the workers' add up to what the machine holds."""
    live = (w.pid for w in workers if alive(w.pid, w.start_ticks, proc_root))
    return held_split(live, proc_root, max_age=max_age)


def kill_workers(workers: Iterable[WorkerProcess], proc_root: Path = Path("/proc")) -> list[int]:
    """SIGKILL these workers (those still alive); their pids."""
    killed = []
    for worker in workers:
        if alive(worker.pid, worker.start_ticks, proc_root):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(worker.pid, signal.SIGKILL)
                killed.append(worker.pid)
    return killed


def none_alive(processes: TritonProcesses, model_id: str) -> bool:
    """The server is in sight and none of this model's processes lives: a python model then holds no memory,
    whatever Triton's index says of it (an unload Triton has not finished, its processes ended or dead). Blocking."""
    return processes.can_observe and processes.visible and not processes.stubs(model_id)


def end_model_processes(processes: TritonProcesses, journal_dir: Path | None, stubs: list[StubProcess]) -> list[int]:
    """SIGKILL a model's stubs and their preforked workers (named first: their notes go with their stubs);
    the pids ended."""
    workers = workers_of(journal_dir, stubs)
    return processes.kill(stubs) + kill_workers(workers, processes.proc_root)


def parents(journal_dir: Path | None, proc_root: Path = Path("/proc")) -> list[PreloadedParent]:
    """The live preloaded parents that write their records to ``journal_dir``."""
    if journal_dir is None:
        return []
    found = []
    with contextlib.suppress(OSError):
        for path in sorted(journal_dir.glob(f"{PARENT_PREFIX}*{PARENT_SUFFIX}")):
            raw = _read_json(path)
            if raw is None:
                continue
            try:
                parent = PreloadedParent(
                    int(raw["pid"]),
                    int(raw["start_ticks"]),
                    str(raw.get("key") or path.stem),
                    tuple(raw.get("preload") or ()),
                    dict(raw.get("failed") or {}),
                    str(raw.get("python") or ""),
                    dict(raw.get("import_secs") or {}),
                    dict(raw.get("warm_secs") or {}),
                    tuple(raw.get("spare_imports") or ()),
                    (int(raw["spare_pid"]), int(raw["spare_start_ticks"])) if raw.get("spare_pid") else None,
                )
            except (KeyError, TypeError, ValueError):
                continue
            if alive(parent.pid, parent.start_ticks, proc_root):
                found.append(parent)
    return found


def parent_status(parent: PreloadedParent) -> dict[str, Any]:
    """One parent's line in status: its own memory (Pss: its share of the pages its workers share with it), and its
    spare worker's, which is the parent's until a stub is handed it."""
    pss = uss = None
    workers = 0
    spare = None
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(parent.pid)
        pids = parent.pids()
        pss, uss = held_split(pids)
        spare = pids[1] if len(pids) > 1 else None
        workers = sum(1 for c in proc.children() if c.pid != spare)
    return {
        "pid": parent.pid,
        "preload": list(parent.preload),
        "failed": parent.failed,
        "python": parent.python,
        "import_secs": parent.import_secs,
        "warm_secs": parent.warm_secs,
        "spare_imports": list(parent.spare_imports),
        "spare_pid": spare,
        "memory_bytes": pss,
        "unique_bytes": uss,
        "workers": workers,
    }


def parents_bytes(journal_dir: Path | None, proc_root: Path = Path("/proc"), *, max_age: float = 0.0) -> int:
    """What the live preloaded parents hold, with their spare workers (Pss, as their workers)."""
    pids = [pid for p in parents(journal_dir, proc_root) for pid in p.pids(proc_root)]
    return held_bytes(pids, proc_root, max_age=max_age)
