"""The preloaded parent: one single-threaded process per (interpreter, runtime, preload set, env, Triton)
that has imported the modules its models declare and forks one worker per model instance on request.

A stub that needs it starts it (preforked.py) as ``python -c <boot> snooze-prefork <config JSON>``;
the boot code forks once more, so the parent is nobody's child but stays in Triton's process group
(stopping the stack's group stops it too). It binds its abstract socket before importing anything:
a second parent started in a race finds the name taken and exits at once, and stubs that connect
meanwhile wait in the listen queue until the imports are done. It never initialises CUDA (a CUDA
context does not survive a fork): workers do, in ``load``.

Supervision, all on one thread (``selectors``): the tritonserver it serves (a pidfd) — when it is
gone, so is the parent, killing any worker left; each worker's stub (a pidfd) — when a stub is gone,
its worker is killed (a worker stuck in C code holding the GIL cannot watch for itself); SIGCHLD —
workers are reaped here, and their wait status is kept for the STATUS question a stub asks when its
worker died under it. Only processes of the same uid may connect (SO_PEERCRED).

Modules whose import starts threads no fork survives (``FORK_UNSAFE_IMPORTS``: onnxruntime) are never imported
here. Where the preload set names one, the parent keeps one *spare*: a child forked ahead of need that imports them
after its fork and waits. A SPAWN is handed to the spare (the stub's connection travels with it) and a new spare is
forked a moment later, so a worker finds its framework imported without the parent ever running its threads. The
spare (``snooze-spare``) is counted with the parent's memory.

Where ``$SNOOZE_JOURNAL_DIR`` is set, ``prefork-<key>.parent`` (JSON) in it says the parent exists:
the control plane shows its memory in status and counts it in the memory budget.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import gc
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from typing import Any

from . import prefork_worker
from .journal import PARENT_PREFIX, PARENT_SUFFIX, start_ticks
from .prefork_preload import (
    ThreadPools,
    cuda_initialised,
    describe_threads,
    fork_safe_threads,
    log,
    native_threads,
    preload,
    set_process_name,
    split_preload,
    thread_ids,
    unsafe_threads,
    warm_kernels,
)
from .prefork_protocol import (
    ERROR,
    EXITED,
    REFUSED,
    SPAWN,
    STATUS,
    PeerClosed,
    ProtocolError,
    abstract_name,
    parse_json,
    recv_frame,
    send_frame,
    send_json,
)

STATUS_WAIT_SECS = 2.0  # a STATUS question about a live worker waits this long for it to be reaped
REAPED_KEPT = 1024
SPARE_AFTER_SECS = 0.5  # a new spare is forked this long after the last one was handed a worker (off the wake's path)
SPARE_BACKOFF_MAX_SECS = 60.0  # a spare that dies unused is forked again after 1, 2, 4 ... s, up to this
POLL_SECS = 1.0  # without pidfds: how often Triton is looked at


@dataclasses.dataclass(frozen=True)
class ParentConfig:
    key: str
    preload: tuple[str, ...]
    env: dict[str, str]
    triton_pid: int
    triton_start_ticks: int
    journal_dir: str | None

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ParentConfig:
        return cls(
            str(raw["key"]),
            tuple(raw.get("preload") or ()),
            {str(k): str(v) for k, v in (raw.get("env") or {}).items()},
            int(raw["triton_pid"]),
            int(raw["triton_start_ticks"]),
            raw.get("journal_dir") or None,
        )

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "preload": list(self.preload)}


def record_path(journal_dir: str, key: str) -> str:
    return os.path.join(journal_dir, f"{PARENT_PREFIX}{key}{PARENT_SUFFIX}")


def _pidfd(pid: int, ticks: int) -> int | None:
    """A pidfd for ``pid`` if it is still the process started at ``ticks``; -1 when it is gone;
    None when this kernel has no pidfd_open (then it is polled)."""
    try:
        fd = os.pidfd_open(pid)
    except AttributeError:
        return None
    except OSError as e:
        return None if e.errno == errno.ENOSYS else -1
    try:
        if start_ticks(pid) == ticks:
            return fd
    except (OSError, ValueError, IndexError):
        pass
    os.close(fd)
    return -1


def _alive(pid: int, ticks: int) -> bool:
    try:
        return start_ticks(pid) == ticks
    except (OSError, ValueError, IndexError):
        return False


@dataclasses.dataclass
class _Worker:
    pid: int
    stub_pid: int
    stub_fd: int | None  # pidfd of its stub (None: polled)
    stub_ticks: int


@dataclasses.dataclass
class _Spare:
    pid: int
    sock: socket.socket  # the parent's end: a SPAWN frame with the stub's connection makes it a worker


class PreloadedParent:
    def __init__(self, config: ParentConfig) -> None:
        self.config = config
        self.selector = selectors.DefaultSelector()
        self.listener: socket.socket | None = None
        self.triton_fd: int | None = None
        self.wake_r = self.wake_w = -1
        self.workers: dict[int, _Worker] = {}
        self.clients: set[socket.socket] = set()
        self.reaped: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.questions: dict[socket.socket, tuple[int, float]] = {}  # STATUS asked about a live worker
        self.pools = ThreadPools()
        self.fork_safe: dict[int, str] = {}
        self.spare_imports: tuple[str, ...] = ()
        self.spare: _Spare | None = None
        self.spare_due: float | None = None  # when to fork the next spare (monotonic)
        self.spare_failures = 0  # spares in a row that died unused
        self.record: dict[str, Any] | None = None  # what the journal's record says (rewritten as the spare changes)
        self.record_file: str | None = None

    def run(self) -> int:
        set_process_name("snooze-prefork")
        os.environ.update(self.config.env)  # libraries read some settings at import (OMP_NUM_THREADS, ...)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            listener.bind(abstract_name(self.config.key))
        except OSError:
            listener.close()
            return 0  # another parent for the same key won the race: it serves
        listener.listen(128)
        self.listener = listener
        triton = _pidfd(self.config.triton_pid, self.config.triton_start_ticks)
        if triton == -1:
            return 0
        self.triton_fd = triton
        # the runtime's own imports (standard library and numpy) came first: threads running now are numpy's
        early = thread_ids() - {os.getpid()}
        started: dict[str, set[int]] = {}
        in_parent, self.spare_imports = split_preload(self.config.preload)
        imported, failed = preload(in_parent, started)
        started["numpy"] = started.get("numpy", set()) | early
        self.pools.limit()
        # SNOOZE_PREFORK_WARM_KERNELS=0 in Triton's environment skips it (to measure what it saves)
        warmed = warm_kernels(imported, failed) if os.environ.get("SNOOZE_PREFORK_WARM_KERNELS", "1") != "0" else {}
        threads = native_threads()
        self.fork_safe = fork_safe_threads(started)
        unsafe = unsafe_threads(self.fork_safe)
        log(
            f"preloaded {imported}, warmed {warmed} for Triton pid {self.config.triton_pid}; "
            f"{threads} native thread(s), {len(self.fork_safe)} of them fork-safe "
            f"({', '.join(sorted(set(self.fork_safe.values()))) or 'none'}); thread pools held at one thread "
            f"for the fork: {self.pools.describe() or 'none found'}"
        )
        if unsafe:
            log(
                f"other native threads are running ({describe_threads(unsafe, started)}): a fork now could "
                "deadlock its worker, so models of this preload set load in their stubs instead"
            )
        if cuda_initialised():
            log(
                "a preloaded module initialised CUDA: a CUDA context does not survive a fork, so GPU models "
                "forked from this parent will fail; preload only modules that leave CUDA alone at import"
            )
        gc.collect()
        gc.freeze()  # the imported objects stay out of the collector's way: fewer pages copied per worker
        record = self._write_record(imported, failed, threads, warmed, len(unsafe))
        if self.spare_imports and not unsafe:
            self.spare_due = time.monotonic()
        try:
            self._setup_signals()
            self._fork_spare_when_due()
            self._loop()
        finally:
            if record:
                with contextlib.suppress(OSError):
                    os.unlink(record)
        return 0

    # --- setup

    def _write_record(
        self, imported: dict[str, float], failed: dict[str, str], threads: int, warmed: dict[str, float], unsafe: int
    ) -> str | None:
        directory = self.config.journal_dir
        if not directory or not os.path.isdir(directory):
            return None
        self.record_file = record_path(directory, self.config.key)
        self.record = {
            "pid": os.getpid(),
            "start_ticks": start_ticks(),
            "key": self.config.key,
            "python": sys.executable,
            "python_version": ".".join(map(str, sys.version_info[:3])),
            "preload": list(imported),
            "import_secs": imported,
            "failed": failed,
            "warm_secs": warmed,
            "threads": threads,
            "fork_safe_threads": len(self.fork_safe),
            "unsafe_threads": unsafe,  # > 0: it refuses to fork (its models load in their stubs)
            "spare_imports": list(self.spare_imports),  # imported by its spare worker, after the fork
            "spare_pid": None,  # the spare waiting now (its memory is the parent's, in status and the budget)
            "spare_start_ticks": None,
            "thread_pools": self.pools.describe(),
            "triton_pid": self.config.triton_pid,
            "started_at": time.time(),
        }
        return self.record_file if self._save_record() else None

    def _save_record(self, **changes: Any) -> bool:
        if self.record is None or self.record_file is None:
            return False
        self.record.update(changes)
        tmp = f"{self.record_file}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.record, f)
            os.replace(tmp, self.record_file)
        except OSError:
            return False
        return True

    def _setup_signals(self) -> None:
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wake-up fd hears it
        signal.signal(signal.SIGTERM, _exit_on_signal)
        assert self.listener is not None
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        if self.triton_fd is not None:
            self.selector.register(self.triton_fd, selectors.EVENT_READ, "triton")

    # --- the loop

    def _loop(self) -> None:
        while True:
            for key, _ in self.selector.select(self._timeout()):
                tag = key.data
                if tag == "accept":
                    self._accept()
                elif tag == "triton":
                    self._stop()
                    return
                elif tag == "wake":
                    with contextlib.suppress(OSError):
                        os.read(self.wake_r, 512)
                elif isinstance(tag, _Worker):
                    self._stub_gone(tag)
                else:
                    self._request(tag)
            self._reap()
            self._fork_spare_when_due()
            self._answer_questions()
            if self.triton_fd is None and not _alive(self.config.triton_pid, self.config.triton_start_ticks):
                self._stop()
                return
            self._poll_stubs()

    def _timeout(self) -> float:
        deadlines = [deadline for _, deadline in self.questions.values()]
        if self.spare_due is not None:
            deadlines.append(self.spare_due)
        if deadlines:
            return max(0.0, min(deadlines) - time.monotonic())
        polled = self.triton_fd is None or any(w.stub_fd is None for w in self.workers.values())
        return POLL_SECS if polled else 60.0

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if uid != os.getuid():  # the abstract namespace has no permissions: only our own user may ask
            conn.close()
            return
        conn.setblocking(True)
        self.clients.add(conn)
        self.selector.register(conn, selectors.EVENT_READ, conn)

    def _request(self, conn: socket.socket) -> None:
        self.selector.unregister(conn)
        try:
            kind, body, fd = recv_frame(conn)
            if fd is not None:
                os.close(fd)
            payload = parse_json(kind, body)
            if kind == SPAWN:
                self._spawn(conn, prefork_worker.SpawnRequest.from_json(payload))
                return
            if kind == STATUS:
                self._status(conn, int(payload.get("pid", 0)))
                return
            raise ProtocolError(f"the parent answers SPAWN and STATUS, got frame type {kind}")
        except (PeerClosed, ProtocolError, OSError, ValueError) as e:
            if not isinstance(e, PeerClosed):
                log(f"dropped a request: {e}")
            self._close(conn)

    def _spawn(self, conn: socket.socket, request: prefork_worker.SpawnRequest) -> None:
        unsafe = unsafe_threads(self.fork_safe)
        if unsafe:  # a forked child would inherit locks those threads hold, and none of the threads
            reason = (
                f"the preloaded parent (pid {os.getpid()}) runs {len(unsafe)} native thread(s) that do not "
                f"survive a fork ({describe_threads(unsafe, {})}); it does not fork a worker that could "
                "deadlock. Preload fewer modules (the spec's preload) or none to use a worker again"
            )
            log(f"refused to fork for the stub pid {request.stub_pid}: {reason}")
            with contextlib.suppress(OSError):
                send_json(conn, ERROR, {"kind": REFUSED, "message": reason})
            self._close(conn)
            return
        if self._hand_to_spare(conn, request):
            return
        pid = os.fork()
        if pid == 0:
            try:
                self._forget_in_child(conn)
                prefork_worker.reset_signals()
                set_process_name("snooze-worker")
                self.pools.restore()
            except BaseException:
                os._exit(prefork_worker.EXIT_CRASHED)
            prefork_worker.serve(conn, request)  # never returns
        self._close(conn)
        self._track(pid, request)

    def _track(self, pid: int, request: prefork_worker.SpawnRequest) -> None:
        stub_fd = _pidfd(request.stub_pid, request.stub_start_ticks)
        worker = _Worker(pid, request.stub_pid, stub_fd if stub_fd != -1 else None, request.stub_start_ticks)
        self.workers[pid] = worker
        if stub_fd == -1:
            self._stub_gone(worker)
        elif stub_fd is not None:
            self.selector.register(stub_fd, selectors.EVENT_READ, worker)

    # --- the spare

    def _fork_spare_when_due(self) -> None:
        if self.spare is not None or self.spare_due is None or time.monotonic() < self.spare_due:
            return
        self.spare_due = None
        if unsafe_threads(self.fork_safe):  # the same rule as a worker's fork (_spawn): never with such a thread
            return
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            mine.close()
            self._spare_child(theirs)  # never returns
        theirs.close()
        self.spare = _Spare(pid, mine)
        with contextlib.suppress(OSError, ValueError, IndexError):
            self._save_record(spare_pid=pid, spare_start_ticks=start_ticks(pid))

    def _spare_child(self, sock: socket.socket) -> None:
        """In the spare: import what the parent cannot, wait to be handed a worker's SPAWN, then serve it."""
        try:
            self._forget_in_child(None)
            prefork_worker.reset_signals()
            set_process_name("snooze-spare")
            self.pools.restore()
            preload(self.spare_imports)  # a failure is logged: the model's own import fails with its name on it
            kind, body, fd = recv_frame(sock)
            if kind != SPAWN or fd is None:
                raise ProtocolError(f"a spare expects SPAWN with the stub's connection, got frame type {kind}")
            request = prefork_worker.SpawnRequest.from_json(parse_json(kind, body))
            sock.close()
            conn = socket.socket(fileno=fd)
            conn.setblocking(True)
            set_process_name("snooze-worker")
        except PeerClosed:
            os._exit(0)  # the parent is gone (or ended its spare)
        except BaseException:
            os._exit(prefork_worker.EXIT_CRASHED)
        prefork_worker.serve(conn, request)  # never returns

    def _hand_to_spare(self, conn: socket.socket, request: prefork_worker.SpawnRequest) -> bool:
        """Make the spare this request's worker; False when there is none (or it is gone): fork one instead."""
        spare, self.spare = self.spare, None
        if spare is None:
            return False
        try:
            send_frame(spare.sock, SPAWN, json.dumps(dataclasses.asdict(request)).encode(), conn.fileno())
        except OSError:
            spare.sock.close()
            with contextlib.suppress(ProcessLookupError):
                os.kill(spare.pid, signal.SIGKILL)
            self._schedule_spare(failed=True)
            return False
        spare.sock.close()
        self._close(conn)
        self._save_record(spare_pid=None, spare_start_ticks=None)  # a worker now: its stub's model is charged
        self.spare_failures = 0
        self._schedule_spare(failed=False)
        self._track(spare.pid, request)
        return True

    def _schedule_spare(self, *, failed: bool) -> None:
        if failed:
            self.spare_failures += 1
            delay = min(SPARE_BACKOFF_MAX_SECS, 2.0 ** (self.spare_failures - 1))
        else:
            delay = SPARE_AFTER_SECS
        self.spare_due = time.monotonic() + delay

    def _forget_in_child(self, keep: socket.socket | None) -> None:
        """In a fresh worker or spare: close everything of the parent's but the worker's own connection."""
        self.selector.close()
        self.record = self.record_file = None  # the parent's to write
        if self.spare is not None:
            self.spare.sock.close()
            self.spare = None
        self.spare_due = None
        if self.listener is not None:
            self.listener.close()
        for conn in list(self.clients):
            if conn is not keep:
                conn.close()
        for fd in (self.triton_fd, self.wake_r, self.wake_w, *(w.stub_fd for w in self.workers.values())):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.workers.clear()

    def _status(self, conn: socket.socket, pid: int) -> None:
        if pid in self.reaped or pid not in self.workers:
            self._answer(conn, pid)
        else:
            self.questions[conn] = (pid, time.monotonic() + STATUS_WAIT_SECS)

    def _answer(self, conn: socket.socket, pid: int) -> None:
        with contextlib.suppress(OSError):
            send_json(conn, EXITED, {"pid": pid, "status": self.reaped.get(pid)})
        self._close(conn)

    def _answer_questions(self) -> None:
        now = time.monotonic()
        for conn, (pid, deadline) in list(self.questions.items()):
            if pid in self.reaped or now >= deadline:
                del self.questions[conn]
                self._answer(conn, pid)

    def _close(self, conn: socket.socket) -> None:
        self.clients.discard(conn)
        conn.close()

    # --- workers

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.reaped[pid] = status
            while len(self.reaped) > REAPED_KEPT:
                self.reaped.popitem(last=False)
            if self.spare is not None and pid == self.spare.pid:  # died unused: its imports failed hard, or killed
                log(f"the spare worker {pid} ended unused ({status:#x}); another one is forked later")
                self.spare.sock.close()
                self.spare = None
                self._save_record(spare_pid=None, spare_start_ticks=None)
                self._schedule_spare(failed=True)
            worker = self.workers.pop(pid, None)
            if worker is not None and worker.stub_fd is not None:
                self.selector.unregister(worker.stub_fd)
                os.close(worker.stub_fd)

    def _stub_gone(self, worker: _Worker) -> None:
        """The worker's stub ended: end the worker (reaped with the next SIGCHLD)."""
        if worker.stub_fd is not None:
            self.selector.unregister(worker.stub_fd)
            os.close(worker.stub_fd)
            worker.stub_fd = None
        worker.stub_ticks = -1  # never polled again
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signal.SIGKILL)

    def _poll_stubs(self) -> None:
        for worker in list(self.workers.values()):
            if worker.stub_fd is None and worker.stub_ticks >= 0 and not _alive(worker.stub_pid, worker.stub_ticks):
                self._stub_gone(worker)

    def _stop(self) -> None:
        """Triton is gone: so is everything this parent started."""
        if self.spare is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.spare.pid, signal.SIGKILL)
        for worker in list(self.workers.values()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    """``argv``: the parent's config as one JSON argument (see ParentConfig)."""
    try:
        config = ParentConfig.from_json(json.loads(argv[-1]))
    except (IndexError, KeyError, TypeError, ValueError) as e:
        log(f"bad configuration {argv!r}: {e!r}")
        return 2
    return PreloadedParent(config).run()
