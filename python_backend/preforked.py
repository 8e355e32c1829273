"""The stub's side of a preforked model: ``PreforkedModel``, what ``build_model`` returns for a spec
with ``worker: "preforked"``.

It has the user model's duck type (``load``, ``predict``, ``unload``) and runs on the stub's thread
like one (``request_timeout_secs`` is enforced by the stub's watchdog, as for any model), but the model lives
in a worker process forked from a preloaded parent (prefork_parent.py): ``load`` finds or starts the
parent (prefork_connect.py), asks it for a worker and waits for READY; ``predict`` hands the collated batch over shared
memory and returns the outputs (prefork_protocol.py); ``unload`` ends the worker and waits until it
is gone, so its memory leaves with the unload.

When the worker dies, this stub process exits too, so the control plane's dead-stub recovery and
request journal apply unchanged: a batch that reached the worker ran (at most once, never again); a
batch that could not reach it (the worker was already gone) is cleared from the journal first, so
those requests are served after recovery. Before exiting, the stub writes the worker's pid and exit
status to ``<journal dir>/<stub pid>-<start ticks>.worker``, where the control plane reads it (it
also reads the worker's pid there, to measure the memory it adds).

If no parent can be had (no interpreter found, the parent cannot start or died before forking), the
model is loaded in the stub instead, with a warning in Triton's log.

Dozing (doze.py): ``doze`` ends the worker as ``unload`` does but keeps this stand-in, and ``wake`` forks a fresh
worker from the parent and loads the model in it again, within the spec's ``load_timeout_secs``. While dozing there
is no ``.worker`` note: no worker lives.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any, NoReturn

from .errors import INTERNAL, TIMEOUT, RemoteFailure, describe_failure, without_prefix
from .exits import describe_wait_status
from .journal import WorkerNote, clear_batch, start_ticks
from .prefork_connect import (
    ParentIdentity,
    PreforkUnavailable,
    ask_exit_status,
    connect_parent,
    find_interpreter,
    parent_identity,
)
from .prefork_protocol import (
    CANCEL,
    END,
    ERROR,
    FORKED,
    INFER,
    ITEM,
    NEXT,
    READY,
    REFUSED,
    RESULT,
    SHUTDOWN,
    SPAWN,
    STREAM,
    PeerClosed,
    PeerRegion,
    ProtocolError,
    Region,
    parse_json,
    read_tensors,
    recv_frame,
    send_frame,
    send_json,
    send_tensors,
)
from .runners import build_model
from .spec import SPEC_FILE, RuntimeSpec

WORKER_EXIT_SECS = 10.0  # after SHUTDOWN, how long the worker gets to exit before it is killed
# A doze runs the model's unload() in its worker: it gets this long to answer before the worker is killed.
DOZE_UNLOAD_SECS = 10.0
# After handing a batch to its worker, the stub's thread polls for the answer this long (yielding the CPU
# to anything runnable) before it blocks in recv. Measured on this 2-core VM: waking a blocked process
# costs about 75 µs, so a torch MLP's round trip took 163 µs blocking and 88 µs polling. Not when recent
# answers took more than SPIN_UNTIL_ANSWER_SECS: there a wake-up is a small part of the wait.
# SNOOZE_PREFORK_SPIN_US overrides the budget; 0 always blocks.
ANSWER_SPIN_SECS = float(os.environ.get("SNOOZE_PREFORK_SPIN_US", "200")) * 1e-6
SPIN_UNTIL_ANSWER_SECS = 0.001


def _log(model_id: str, message: str) -> None:
    print(f"snooze model '{model_id}': {message}", file=sys.stderr, flush=True)


def exit_code_for(status: int | None) -> int:
    """The stub's own exit code when its worker ended with ``status`` (the shell's 128 + signal)."""
    if status is not None and os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    if status is not None and os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return 1


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class PreforkedModel:
    """The user model's stand-in in the stub: the model itself runs in a preforked worker."""

    def __init__(self, spec: RuntimeSpec, package_dir: str, *, server_pid: int | None = None) -> None:
        """``server_pid``: the tritonserver whose life bounds the parent's (default: this stub's parent)."""
        self.spec = spec
        self.package_dir = package_dir
        self.server_pid = server_pid
        self.worker_pid: int | None = None
        self._identity: ParentIdentity | None = None
        self._conn: socket.socket | None = None
        self._pidfd: int | None = None
        self._watched = False  # a watch thread waits on the pidfd (and closes it)
        self._region = Region(f"snooze-in-{spec.model_id}")
        self._peer = PeerRegion()
        self._lock = threading.Lock()  # one conversation with the worker at a time, and the death watch
        self._answer_secs = 0.0  # recent time from INFER to the worker's answer (moving average)
        self._closing = False
        self._note = WorkerNote()
        self.in_stub: Any = None  # the model, when no parent could be had
        self._worker_unload = True  # whether the user's model (in the worker) has an unload(): its READY says
        self._dozing = False  # the worker was ended by a doze: its end is no death
        self.wakes = 0
        self._model_dir, self._device = package_dir, "cpu"

    # --- load

    def load(self, model_dir: str, device: str) -> None:
        self._model_dir, self._device = model_dir, device
        try:
            conn = self._spawn(model_dir, device)
        except PreforkUnavailable as e:
            _log(self.spec.model_id, f"no preloaded parent ({e}); loading in the stub instead (a slower cold start)")
            self._load_in_stub(model_dir, device)
            return
        self._conn = conn
        self._await_ready(conn, timeout=None)

    def _await_ready(self, conn: socket.socket, *, timeout: float | None) -> None:
        """Wait for the worker's READY (``timeout``: a wake's bound; a load's is the control plane's)."""
        if timeout is not None and not select.select([conn], [], [], timeout)[0]:
            self._conn = None
            conn.close()
            self._end_worker(0.0)
            self._note.remove()
            raise RemoteFailure(
                TIMEOUT,
                f"waking from doze: load did not finish within load_timeout_secs={timeout:g}; its worker was ended "
                "and the next request tries again (make load() faster, or raise load_timeout_secs)",
            )
        try:
            kind, body, fd = recv_frame(conn)
        except PeerClosed:
            if timeout is not None:  # a wake: the batch never reached a worker, the stub goes and recovery resends it
                self._die(ran=False, when="waking from doze")
            status = ask_exit_status(self._identity, self.worker_pid) if self._identity and self.worker_pid else None
            self._note.write(exit_status=status, ended="load")
            raise RemoteFailure(
                INTERNAL,
                f"its worker process (pid {self.worker_pid}) died during load ({describe_wait_status(status)}); "
                "look at the model's log for the cause (a SIGKILL is often the kernel's OOM killer)",
            ) from None
        if fd is not None:
            os.close(fd)
        payload = parse_json(kind, body)
        if kind == ERROR:  # the worker ends after saying why
            self._conn = None
            conn.close()
            self._end_worker(WORKER_EXIT_SECS)
            self._note.remove()
            raise RemoteFailure(str(payload.get("kind", INTERNAL)), str(payload.get("message", "")))
        if kind != READY:
            raise ProtocolError(f"expected READY from the worker, got frame type {kind}")
        self._worker_unload = payload.get("unload") is not False  # an older worker that does not say: assume one
        _log(
            self.spec.model_id,
            f"preforked worker pid {self.worker_pid} ready (import {payload.get('import_secs', 0):.3f} s, "
            f"load {payload.get('load_secs', 0):.3f} s)",
        )
        if self._pidfd is not None:
            self._watched = True
            threading.Thread(
                target=self._watch, args=(self._pidfd, self.worker_pid), name="snooze-worker-watch", daemon=True
            ).start()

    def _spawn(self, model_dir: str, device: str) -> socket.socket:
        identity = self._identity
        if identity is None:  # a wake reuses it: the runtime's digest reads every runtime file
            interpreter = find_interpreter()
            if interpreter is None:
                raise PreforkUnavailable("no Python interpreter to run it: sys.executable is not set")
            self._identity = identity = parent_identity(self.spec, interpreter, self.server_pid)
        conn = connect_parent(identity)
        request = {
            # <version>/package is the package, <version>/snooze_runtime.json its spec (docs/internals.md)
            "spec_path": os.path.join(os.path.dirname(os.path.abspath(model_dir)), SPEC_FILE),
            "package_dir": model_dir,
            "device": device,
            "stub_pid": os.getpid(),
            "stub_start_ticks": start_ticks(),
        }
        try:
            send_json(conn, SPAWN, request)
            kind, body, fd = recv_frame(conn)  # waits while the parent imports its preload set
        except (OSError, PeerClosed) as e:
            conn.close()
            raise PreforkUnavailable(f"the parent closed the connection before forking ({type(e).__name__})") from e
        if fd is not None:
            os.close(fd)
        if kind == ERROR:  # the parent refused to fork (threads that do not survive one): it said why
            conn.close()
            payload = parse_json(kind, body)
            if payload.get("kind") == REFUSED:
                raise PreforkUnavailable(str(payload.get("message", "the parent refused to fork")))
            raise ProtocolError(f"the parent answered SPAWN with an error: {payload.get('message')}")
        if kind != FORKED:
            conn.close()
            raise ProtocolError(f"expected FORKED from the worker, got frame type {kind}")
        payload = parse_json(kind, body)
        self.worker_pid = int(payload["pid"])
        # a new worker (a wake) has mapped neither side's region yet: both are sent again with the first frames
        self._region, self._peer = Region(f"snooze-in-{self.spec.model_id}"), PeerRegion()
        self._pidfd, self._watched = _pidfd(self.worker_pid), False
        self._note.start(
            model=self.spec.model_id,
            pid=self.worker_pid,
            start_ticks=int(payload.get("start_ticks", 0)),
            parent_key=identity.key,
            wakes=self.wakes,
        )
        return conn

    def _load_in_stub(self, model_dir: str, device: str) -> None:
        try:
            model = build_model(self.spec, model_dir)
        except Exception as e:  # reads as the stub's own import failure would
            kind, message = describe_failure(e, self.spec.model_id, "import", None)
            raise RemoteFailure(kind, without_prefix(kind, self.spec.model_id, message)) from None
        model.load(model_dir, device)
        self.in_stub = model

    # --- predict

    def predict(self, inputs: dict[str, Any]) -> Any:
        if self.in_stub is not None:
            return self.in_stub.predict(inputs)
        return self.predict_in_worker(inputs)

    @property
    def direct_predict(self) -> Any:
        """``predict_in_worker`` when a worker serves, else None: the stub calls it straight from its thread."""
        return self.predict_in_worker if self.in_stub is None and self._conn is not None else None

    def predict_in_worker(self, inputs: dict[str, Any]) -> Any:
        """``predict`` in the worker: the batch goes over shared memory, the stub's thread waits for the
        answer. ``request_timeout_secs`` is the stub's watchdog's to enforce (triton_model.py): it answers
        an overrunning batch and ends the stub process, which takes the worker with it."""
        if self.in_stub is not None:  # a wake from doze found no parent and loaded the model here
            return self.in_stub.predict(inputs)
        with self._lock:
            conn = self._conn
            if conn is None:
                self._die(ran=False, when="before a batch")
            sent = time.perf_counter()
            try:
                send_tensors(conn, INFER, self._region, inputs)
            except OSError:  # EPIPE: the worker had closed its end, it ended before this batch
                self._die(ran=False, when="before a batch")
            if ANSWER_SPIN_SECS and self._answer_secs < SPIN_UNTIL_ANSWER_SECS:
                _poll_briefly(conn, sent + ANSWER_SPIN_SECS)
            try:
                return self._answer(conn)
            finally:
                self._answer_secs += (time.perf_counter() - sent - self._answer_secs) * 0.25

    @property
    def direct_stream(self) -> Any:
        """``stream_in_worker`` when a worker serves, else None (a decoupled model's ``direct_predict``)."""
        return self.stream_in_worker if self.in_stub is None and self._conn is not None else None

    def stream_in_worker(self, inputs: dict[str, Any]) -> Any:
        """A decoupled model's ``predict`` in the worker, as a generator: each ITEM the worker sends is one
        result; closing this generator early (a cancelled request) sends CANCEL and waits for the END."""
        if self.in_stub is not None:  # a wake from doze found no parent and loaded the model here
            yield from self.in_stub.predict(inputs)
            return
        with self._lock:
            conn = self._conn
            if conn is None:
                self._die(ran=False, when="before a stream")
            try:
                send_tensors(conn, STREAM, self._region, inputs)
            except OSError:
                self._die(ran=False, when="before a stream")
            over = False
            try:
                while True:
                    kind, body, fd = self._stream_frame(conn)
                    if kind == ITEM:
                        item = read_tensors(body, fd, self._peer, copy=True)
                        yield item
                        send_frame(conn, NEXT)
                        continue
                    over = True
                    self._stream_end(kind, body, fd)
                    return
            finally:
                if not over:
                    send_frame(conn, CANCEL)
                    while True:
                        kind, body, fd = self._stream_frame(conn)
                        if kind != ITEM:
                            self._stream_end(kind, body, fd, raise_error=False)
                            break
                        if fd is not None:
                            os.close(fd)

    def _stream_frame(self, conn: socket.socket) -> tuple[int, bytes, int | None]:
        try:
            return recv_frame(conn)
        except (PeerClosed, OSError):
            ran = self._region.taken()
            self._die(ran=ran, when="while streaming" if ran else "before it took the request")

    def _stream_end(self, kind: int, body: bytes, fd: int | None, *, raise_error: bool = True) -> None:
        if fd is not None:
            os.close(fd)
        if kind == END:
            return
        if kind == ERROR:
            payload = parse_json(kind, body)
            if raise_error:
                raise RemoteFailure(str(payload.get("kind", INTERNAL)), str(payload.get("message", "")))
            return
        raise ProtocolError(f"expected ITEM, END or ERROR from a streaming worker, got frame type {kind}")

    def _answer(self, conn: socket.socket) -> Any:
        try:
            kind, body, fd = recv_frame(conn)
        except (PeerClosed, OSError):
            # ran only if the worker took the batch (it marks our region) before it died
            ran = self._region.taken()
            self._die(ran=ran, when="while running a batch" if ran else "before it took the batch")
        if kind == RESULT:
            return read_tensors(body, fd, self._peer, copy=True)
        if fd is not None:
            os.close(fd)
        if kind == ERROR:
            payload = parse_json(kind, body)
            raise RemoteFailure(str(payload.get("kind", INTERNAL)), str(payload.get("message", "")))
        raise ProtocolError(f"expected RESULT or ERROR from the worker, got frame type {kind}")

    # --- unload

    @property
    def declares_unload(self) -> bool:
        """Whether the user's model has an ``unload()`` (run in its worker, or in the stub without one)."""
        if self.in_stub is not None:
            return callable(getattr(self.in_stub, "unload", None))
        return self._worker_unload

    def unload(self) -> None:
        if self.in_stub is not None:
            unload = getattr(self.in_stub, "unload", None)
            if callable(unload):
                unload()
            return
        with self._lock:
            self._closing = True
            payload = self._shutdown(None)
        if payload:
            raise RemoteFailure(str(payload.get("kind", INTERNAL)), str(payload.get("message", "")))

    def _shutdown(self, answer_within: float | None) -> dict[str, Any]:
        """Under ``_lock``: SHUTDOWN to the worker (its model's ``unload()`` runs) and wait until it is gone; the
        payload of an ERROR it answered with (its unload() raised), else {}. ``answer_within``: how long its
        unload() may take before the worker is killed (None: ``unload``'s own bound is the stub's finalize's)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return {}
        payload: dict[str, Any] = {}
        grace = WORKER_EXIT_SECS
        try:
            send_frame(conn, SHUTDOWN)
            if answer_within is None or select.select([conn], [], [], answer_within)[0]:
                kind, body, fd = recv_frame(conn)
                if fd is not None:
                    os.close(fd)
                if kind == ERROR:
                    payload = parse_json(kind, body)
            else:
                grace = 0.0  # its unload() overran: killed now
        except (OSError, PeerClosed):
            pass  # it is ending anyway
        finally:
            conn.close()
            self._end_worker(grace)
            self._note.remove()
        return payload

    def _end_worker(self, grace: float) -> None:
        """Return once the worker is gone, killing it after ``grace`` seconds; its pidfd then closes (the watch's
        closes it where a watch was started)."""
        self._wait_for_worker(grace)
        if self._pidfd is not None and not self._watched:
            os.close(self._pidfd)
        self._pidfd = None

    def _wait_for_worker(self, grace: float = WORKER_EXIT_SECS) -> None:
        """Return once the worker process is gone (its memory with it), killing it after ``grace`` seconds."""
        if self._pidfd is None:
            return
        ready, _, _ = select.select([self._pidfd], [], [], grace)
        if not ready:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            select.select([self._pidfd], [], [], WORKER_EXIT_SECS)

    # --- doze

    @property
    def can_doze(self) -> bool:
        """A worker serves the model (not the stub itself): ending it gives all of its memory back."""
        return self.in_stub is None and (self._conn is not None or self._dozing)

    def doze(self) -> dict[str, Any]:
        """End the worker (its model's ``unload()`` runs, within ``DOZE_UNLOAD_SECS``) and keep the stub; what ended.
        The caller holds the batch lock (doze.py): no batch runs."""
        with self._lock:
            worker = self.worker_pid
            self._dozing = True
            self._worker_unload = False  # nothing of the model is left to clean up
            payload = self._shutdown(DOZE_UNLOAD_SECS)
            self.worker_pid = None
        if payload:
            raise RemoteFailure(str(payload.get("kind", INTERNAL)), str(payload.get("message", "")))
        return {"worker": worker}

    def wake(self) -> None:
        """Fork a fresh worker and load the model in it, within ``load_timeout_secs`` (its failure is raised and the
        stand-in stays dozing; a worker that dies loading ends the stub). The caller holds the batch lock."""
        started = time.perf_counter()
        with self._lock:
            self.wakes += 1
            try:
                conn = self._spawn(self._model_dir, self._device)
            except PreforkUnavailable as e:
                _log(self.spec.model_id, f"no preloaded parent to wake in ({e}); loading in the stub instead")
                self._load_in_stub(self._model_dir, self._device)
                self._dozing = False
                return
            self._conn = conn
            self._await_ready(conn, timeout=self.spec.load_timeout_secs)
            self._dozing = False
            # the control plane reads the wake in the note: a worker lives again, and how long the wake took
            self._note.write(wake_secs=round(time.perf_counter() - started, 4))

    # --- the worker's death

    def _watch(self, pidfd: int, worker: int | None) -> None:
        """While idle, a worker that ends takes the stub with it (the control plane then recovers); a worker ended
        by an unload or a doze does not, nor one a wake has replaced since."""
        select.select([pidfd], [], [])
        with self._lock:
            if not self._closing and not self._dozing and self.worker_pid == worker:
                self._die(ran=False, when="while idle")
        os.close(pidfd)

    def _die(self, *, ran: bool, when: str) -> NoReturn:
        """End this stub because its worker ended; ``ran``: the current batch reached the worker."""
        status = ask_exit_status(self._identity, self.worker_pid) if self._identity and self.worker_pid else None
        if not ran:
            clear_batch()  # it never reached a live model process: the control plane may send it again
        self._note.write(exit_status=status, ended=when, ran=ran)
        _log(
            self.spec.model_id,
            f"preforked worker pid {self.worker_pid} died {when} ({describe_wait_status(status)}); "
            "this model process exits so that the model is recovered",
        )
        sys.stderr.flush()
        os._exit(exit_code_for(status))


def _poll_briefly(conn: socket.socket, until: float) -> None:
    """Return once ``conn`` is readable (an answer, or the worker's end) or at ``until`` (perf_counter)."""
    clock, ready, yield_cpu = time.perf_counter, select.select, os.sched_yield
    while clock() < until:
        if ready([conn], [], [], 0)[0]:
            return
        yield_cpu()
