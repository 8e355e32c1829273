"""Triton's processes as the control plane sees them: the tritonserver process and its python-backend stubs.

One observer for every topology where the processes can be seen: tritonserver as this process's
child (embedded), or in a PID namespace shared with it (``snoozectl triton`` beside ``snoozectl
serve``, docker compose ``pid: "service:triton"``, a Kubernetes pod with ``shareProcessNamespace``).
Where it cannot find the server (a remote Triton), ``visible`` is False and nothing is measured.

A stub is named by its pid *and* its start time (``/proc/<pid>/stat`` field 22): pids are reused, the
pair is not. Triton 2.51 does not reap a stub that died (measured: it stays a zombie until the model
is unloaded), so the zombie's ``exit_code`` field (52) tells how it ended.

Stub command line (tritonserver 2.51)::

    <backend-dir>/python/triton_python_backend_stub <repo>/<model>/<version>/model.py <shm-region>
        <shm-default-bytes> <shm-growth-bytes> <tritonserver-pid> <backend-dir>/python <ipc-handle>
        <model>_<group>_<instance> DEFAULT

The model is the model file's grandparent folder (an instance group may rename the instance).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

from python_backend.exits import describe_wait_status

log = logging.getLogger("snoozeml.processes")

STUB_NAME = "triton_python_backend_stub"
# System calls a thread at rest waits in (x86_64 numbers): read, poll, select, pause, nanosleep, accept,
# recvfrom, recvmsg, wait4, rt_sigtimedwait, futex, restart_syscall (a wait a SIGSTOP/SIGCONT interrupted goes
# on in it), clock_nanosleep, epoll_wait, waitid, pselect6, ppoll, epoll_pwait, accept4. On another
# architecture any system call counts as at rest.
_WAITING_SYSCALLS: frozenset[int] | None = (
    frozenset({0, 7, 23, 34, 35, 43, 45, 47, 61, 128, 202, 219, 230, 232, 247, 270, 271, 281, 288})
    if platform.machine() in ("x86_64", "AMD64")
    else None
)
SERVER_NAME = "tritonserver"
# How many stubs ended by the control plane are remembered (their deaths are told from crashes by it).
ENDED_KEPT = 4096


@dataclass(frozen=True)
class ProcStat:
    state: str  # R, S, D, Z (zombie), ...
    start_ticks: int
    exit_status: int | None  # the wait status a zombie will be reaped with (Linux >= 3.5)


def read_stat(pid: int, proc_root: Path = Path("/proc")) -> ProcStat | None:
    """Fields of ``/proc/<pid>/stat``; None when the process is gone (or never was)."""
    try:
        raw = (proc_root / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        state, start = fields[0].decode(), int(fields[19])
        exit_status = int(fields[49]) if len(fields) > 49 else None
    except (IndexError, ValueError):
        return None
    return ProcStat(state, start, exit_status if state == "Z" else None)


@dataclass(frozen=True)
class StubProcess:
    """One python-backend stub: one instance of one model."""

    pid: int
    start_ticks: int
    model: str
    instance: str


@dataclass(frozen=True)
class StubDeath:
    stub: StubProcess
    exit_status: int | None  # None: already reaped or pid reused, so unknown
    # Triton reaps the stubs it ends itself (unload, fewer instances) and leaves a crashed one a
    # zombie (measured), so a reaped stub was most likely ended on purpose.
    reaped: bool = False
    # The control plane ended it (``TritonProcesses.kill``: an unload, a cancel, a load timeout): not a crash.
    ended: bool = False
    # A preforked model's stub exits when its worker dies: the worker (workers.WorkerProcess) and how it ended.
    worker: Any = None

    def describe(self) -> str:
        if self.worker is not None and self.worker.exit_status is not None:
            return f"its worker pid {self.worker.pid} {self.worker.describe()}"
        return describe_wait_status(self.exit_status)


def _stub_of(p: psutil.Process, proc_root: Path) -> StubProcess | None:
    try:
        argv = p.cmdline()
    except psutil.Error:
        return None
    if len(argv) < 2 or not argv[0].endswith(STUB_NAME):
        return None
    stat = read_stat(p.pid, proc_root)
    if stat is None or stat.state == "Z":
        return None
    instance = argv[8] if len(argv) > 8 else ""
    return StubProcess(p.pid, stat.start_ticks, Path(argv[1]).parent.parent.name, instance)


def listening_ports(pid: int, proc_root: Path = Path("/proc")) -> set[int]:
    """TCP ports process ``pid`` listens on, read in *its* network namespace (``/proc/<pid>/net``).

    psutil reads the caller's namespace, which is not Triton's in docker compose. Needs the same uid
    (or CAP_SYS_PTRACE) to list the process's sockets; an empty set when it cannot.
    """
    base = proc_root / str(pid)
    inodes = set()
    try:
        fds = list((base / "fd").iterdir())
    except OSError:
        return set()
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile
            if (link := os.readlink(fd)).startswith("socket:["):
                inodes.add(link[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (base / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            # local_address is HEXIP:HEXPORT, st 0A is LISTEN, field 9 the socket inode.
            if len(f) > 9 and f[3] == "0A" and f[9] in inodes:
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def _port_of(url: str) -> int | None:
    parts = urlsplit(url if "//" in url else f"//{url}")
    try:
        return parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE")
_rss_fallback_said = False
# A sweep's Pss of a process is read again when its RSS moved by more than this, or its reading is older than
# SWEEP_PSS_MAX_AGE_SECS: smaps_rollup walks every mapped page (measured about 0.6 ms a stub, 120 ms for 200 on
# 2 loaded cores; statm 36 us), while a process's share of pages shared with others changes only as they come
# and go (``bench/pss_sweep.py``).
PSS_REREAD_RSS_BYTES = 1 << 20
SWEEP_PSS_MAX_AGE_SECS = 10.0
# (proc root, pid) -> (rss, pss, private, read at)
_pss_cache: dict[tuple[Path, int], tuple[int, int, int, float]] = {}


def proportional_bytes(pid: int, proc_root: Path = Path("/proc")) -> int | None:
    """The process's Pss (``/proc/<pid>/smaps_rollup``): its private pages plus each shared page divided by the
    number of processes mapping it, so that a sum over processes counts a shared page once; None where it cannot
    be read (gone, no smaps_rollup before Linux 4.14, or another uid without ptrace access)."""
    found = _rollup(pid, proc_root)
    return found[0] if found is not None else None


def _rollup(pid: int, proc_root: Path) -> tuple[int, int] | None:
    """(Pss, private bytes) from one read of smaps_rollup; None where it cannot be read."""
    try:
        raw = (proc_root / str(pid) / "smaps_rollup").read_bytes()
    except OSError:
        return None
    fields = {}
    for line in raw.splitlines()[1:]:
        name, _, rest = line.partition(b":")
        if name in (b"Pss", b"Private_Clean", b"Private_Dirty"):
            try:
                fields[name] = int(rest.split()[0]) * 1024
            except (IndexError, ValueError):
                return None
    if b"Pss" not in fields:
        return None
    return fields[b"Pss"], fields.get(b"Private_Clean", 0) + fields.get(b"Private_Dirty", 0)


def resident_bytes(pid: int, proc_root: Path = Path("/proc")) -> int | None:
    """The process's RSS (``/proc/<pid>/statm``, readable for any uid); None when it is gone."""
    try:
        return int((proc_root / str(pid) / "statm").read_bytes().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def held_bytes(
    pids: Iterable[int],
    proc_root: Path = Path("/proc"),
    *,
    max_age: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """What these processes hold of the machine's memory: the sum of their Pss (``held_split``)."""
    return held_split(pids, proc_root, max_age=max_age, clock=clock)[0]


def held_split(
    pids: Iterable[int],
    proc_root: Path = Path("/proc"),
    *,
    max_age: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[int, int]:
    """(Pss, private bytes) summed over these processes: Pss counts each shared page split among its mappers
    (one read of smaps_rollup each), private what would leave with them. A process whose Pss cannot be read is
    counted at its RSS, all of it private (said once in the log: its shared pages then count once per process);
    a process gone counts 0.

    ``max_age`` (a sweep's): a process's reading within that many seconds is used again while its RSS moved by
    less than ``PSS_REREAD_RSS_BYTES`` (one statm read instead of a walk of its pages)."""
    global _rss_fallback_said
    pss_total = private_total = 0
    now = clock()
    for pid in pids:
        rss = None
        if max_age > 0:
            cached = _pss_cache.get((proc_root, pid))
            rss = resident_bytes(pid, proc_root)
            if rss is None:
                _pss_cache.pop((proc_root, pid), None)
                continue
            if cached is not None and now - cached[3] < max_age and abs(rss - cached[0]) < PSS_REREAD_RSS_BYTES:
                pss_total, private_total = pss_total + cached[1], private_total + cached[2]
                continue
        found = _rollup(pid, proc_root)
        if found is not None:
            if len(_pss_cache) > 4096:  # pids of processes long gone
                _pss_cache.clear()
            rss = rss if rss is not None else resident_bytes(pid, proc_root) or 0
            _pss_cache[(proc_root, pid)] = (rss, found[0], found[1], now)
        elif rss := resident_bytes(pid, proc_root):  # 0: a zombie (it exited after it was listed): nothing held
            found = (rss, rss)
            if not _rss_fallback_said:
                _rss_fallback_said = True
                log.warning(
                    "cannot read %s/%d/smaps_rollup (Linux before 4.14, or another uid without ptrace access): the "
                    "memory budget counts RSS for such processes, so their shared pages count once per process; "
                    "run the control plane as Triton's uid (or with CAP_SYS_PTRACE) to count proportional memory",
                    proc_root,
                    pid,
                )
        if found is not None:
            pss_total, private_total = pss_total + found[0], private_total + found[1]
    return pss_total, private_total


class TritonProcesses:
    """Finds tritonserver (``server_pid`` for a child, else by the port it listens on) and its stubs.

    The server is looked up again whenever the one found before is gone (Triton restarted, by the
    embedded launcher or by its container runtime).
    """

    def __init__(
        self,
        *,
        server_pid: Callable[[], int | None] | None = None,
        http_url: str | None = None,
        proc_root: Path = Path("/proc"),
    ) -> None:
        self._server_pid = server_pid
        self._port = _port_of(http_url) if http_url else None
        self.proc_root = proc_root
        self._server: psutil.Process | None = None
        self._server_start: int | None = None
        # the stubs this observer ended (``kill``), newest last: their deaths are not crashes
        self._ended: dict[StubProcess, None] = {}

    @classmethod
    def unseen(cls) -> TritonProcesses:
        """An observer that sees nothing (a remote Triton, or observation turned off)."""
        return cls()

    # --- the server

    def server(self) -> psutil.Process | None:
        """The tritonserver process, or None when it cannot be seen (not running, or elsewhere)."""
        if self._server is not None:
            stat = read_stat(self._server.pid, self.proc_root)
            if stat is not None and stat.state != "Z" and stat.start_ticks == self._server_start:
                return self._server
            self._server = self._server_start = None
        found = self._find_server()
        if found is not None:
            stat = read_stat(found.pid, self.proc_root)
            if stat is not None and stat.state != "Z":
                self._server, self._server_start = found, stat.start_ticks
        return self._server

    @property
    def visible(self) -> bool:
        return self.server() is not None

    @property
    def can_observe(self) -> bool:
        """Whether this observer has a way to find the server at all (a child pid or a port)."""
        return self._server_pid is not None or self._port is not None

    def _find_server(self) -> psutil.Process | None:
        if self._server_pid is not None:
            pid = self._server_pid()
            if pid is None:
                return None
            with contextlib.suppress(psutil.Error):
                return psutil.Process(pid)
            return None
        if self._port is None:
            return None
        for p in psutil.process_iter(["name"]):
            if p.info.get("name") == SERVER_NAME and self._port in listening_ports(p.pid, self.proc_root):
                return p
        return None

    def environment(self, name: str) -> str | None:
        """A variable of the server's environment (its stubs inherit it); None when unseen or unset."""
        server = self.server()
        if server is None:
            return None
        try:
            raw = (self.proc_root / str(server.pid) / "environ").read_bytes()
        except OSError:
            return None
        prefix = f"{name}=".encode()
        for entry in raw.split(b"\0"):
            if entry.startswith(prefix):
                return entry[len(prefix) :].decode("utf-8", "replace")
        return None

    # --- stubs

    def stubs(self, model: str | None = None) -> list[StubProcess]:
        """Live stubs of the server, all or one model's, by pid."""
        server = self.server()
        if server is None:
            return []
        try:
            children = server.children()
        except psutil.Error:
            return []
        found = [s for s in (_stub_of(p, self.proc_root) for p in children) if s is not None]
        return sorted((s for s in found if model is None or s.model == model), key=lambda s: s.pid)

    def alive(self, stub: StubProcess) -> bool:
        stat = read_stat(stub.pid, self.proc_root)
        return stat is not None and stat.state != "Z" and stat.start_ticks == stub.start_ticks

    def death(self, stub: StubProcess) -> StubDeath | None:
        """None while the stub lives; else how it ended (when still knowable)."""
        stat = read_stat(stub.pid, self.proc_root)
        ended = stub in self._ended
        if stat is not None and stat.start_ticks == stub.start_ticks:
            if stat.state != "Z":
                return None
            return StubDeath(stub, stat.exit_status, ended=ended)
        return StubDeath(stub, None, reaped=True, ended=ended)

    def deaths(self, stubs: Iterable[StubProcess]) -> list[StubDeath]:
        return [d for d in (self.death(s) for s in stubs) if d is not None]

    def at_rest(self, stub: StubProcess) -> bool | None:
        """Whether every thread of the stub is stopped, waiting in a system call that waits (futex, sleep, poll,
        read, ...): none is inside the process's own code, where it might hold a lock in the memory it shares
        with tritonserver. None when its threads cannot be read here (another uid, no ptrace access)."""
        task = self.proc_root / str(stub.pid) / "task"
        try:
            tids = [t.name for t in task.iterdir()]
        except OSError:
            return None
        for tid in tids:
            try:
                state = (task / tid / "stat").read_bytes()
                if state[state.rfind(b")") + 2 : state.rfind(b")") + 3] not in (b"T", b"t"):
                    return False  # not stopped (yet): it may still enter anything
                raw = (task / tid / "syscall").read_text().split()
            except FileNotFoundError:
                continue  # the thread ended meanwhile
            except OSError:
                return None
            if not raw or raw[0] in ("-1", "running"):
                return False  # in user code (or its syscall unknown)
            if _WAITING_SYSCALLS is not None and int(raw[0]) not in _WAITING_SYSCALLS:
                return False  # inside a system call that does work (it may hold a lock meanwhile)
        return True

    def rss(self, stubs: Iterable[StubProcess]) -> int:
        total = 0
        for stub in stubs:
            with contextlib.suppress(psutil.Error):
                total += psutil.Process(stub.pid).memory_info().rss
        return total

    def memory(self, stubs: Iterable[StubProcess], *, max_age: float = 0.0) -> int:
        """What these stubs hold of the machine's memory: their proportional bytes (``held_bytes``)."""
        return held_bytes((s.pid for s in stubs), self.proc_root, max_age=max_age)

    def memory_split(self, stubs: Iterable[StubProcess], *, max_age: float = 0.0) -> tuple[int, int]:
        """(Pss, private bytes) of these stubs (``held_split``)."""
        return held_split((s.pid for s in stubs), self.proc_root, max_age=max_age)

    def kill(self, stubs: Iterable[StubProcess]) -> list[int]:
        """SIGKILL these stubs (those still alive); their pids. Their deaths say ``ended``: not crashes."""
        stubs = list(stubs)
        for stub in stubs:
            self._ended[stub] = None
        while len(self._ended) > ENDED_KEPT:
            del self._ended[next(iter(self._ended))]
        return self.signal(stubs, signal.SIGKILL)

    def signal(self, stubs: Iterable[StubProcess], signum: int) -> list[int]:
        """Send ``signum`` to these stubs (those still alive); the pids it reached."""
        sent = []
        for stub in stubs:
            if self.alive(stub):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(stub.pid, signum)
                    sent.append(stub.pid)
        return sent

    def server_memory(self) -> int | None:
        """tritonserver's own proportional bytes (``held_bytes``; not its model processes'); None when unseen."""
        server = self.server()
        if server is None:
            return None
        return held_bytes([server.pid], self.proc_root)

    def tree_memory(self) -> int:
        """Proportional bytes of tritonserver and all its descendants (what the tree holds); 0 when not visible."""
        server = self.server()
        if server is None:
            return 0
        pids = [server.pid]
        with contextlib.suppress(psutil.Error):
            pids += [p.pid for p in server.children(recursive=True)]
        return held_bytes(pids, self.proc_root)

    def server_rss(self) -> int | None:
        """Resident bytes of tritonserver itself (not its model processes); None when it cannot be seen."""
        server = self.server()
        if server is None:
            return None
        try:
            return server.memory_info().rss
        except psutil.Error:
            return None

    def tree_rss(self) -> int:
        """Resident bytes of tritonserver and all its descendants; 0 when not visible."""
        server = self.server()
        if server is None:
            return 0
        total = 0
        with contextlib.suppress(psutil.Error):
            for p in [server, *server.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    total += p.memory_info().rss
        return total
