"""Dozing: a preforked model's worker ends (its memory and VRAM back with the OS) while its stub lives on and Triton
keeps the model READY; the next batch forks a fresh worker inside the stub and runs on it.

The control plane asks through a unix socket the stub listens on, ``<journal dir>/<pid>-<start ticks>.doze``
(``DOZE_SUFFIX``; one ``SOCK_SEQPACKET`` message each way). Why a socket and not a signal or a polled file
(docs/measurements.md): it answers (dozed, busy, or why not), it reaches a stub in another container through the
journal folder both mount, a stub whose runtime predates dozing just refuses the connection (a signal it does not
handle would kill it), and it costs nothing while idle.

=========  ==========================================================================================
ask        answer (JSON)
=========  ==========================================================================================
``doze``   ``{"dozed": true, "worker": pid, "secs": s}``; ``{"dozed": false, "why": ...}`` when a batch is running
           (``busy``: asked again later), it dozes already, or its model runs in the stub
``state``  ``{"dozing": bool, "wakes": n, "last_wake_secs": s | null, "last_ask_secs": s | null}`` (the wake's
           time includes its ask for room)
=========  ==========================================================================================

A batch and a doze never overlap: each batch runs under ``DozeControl.lock`` (``TritonPythonModel.execute``), and
a doze only takes it when it is free. A dozing instance wakes at the start of its next batch, before the batch is
journaled: a wake that ends the stub (its worker died loading) took no request with it, so recovery sends them
again; a wake whose ``load()`` fails or outlives ``load_timeout_secs`` answers the batch with that failure and the
instance stays dozing. Standard library only, Python 3.10 syntax (python_backend rule).

Before it forks, a wake asks the control plane for room (``ask_room``: ``POST /v1/doze/wake/<model>`` on the wake
route's socket, ``controlplane/gateway/bls_wake.py``), which counts the model at its awake size from then on and
evicts idle models first, as it would for a load (several requests straight to dozing models would otherwise wake
them all beside a full budget). The ask is bounded (``$SNOOZE_DOZE_ADMIT_TIMEOUT_SECS``) and never refuses: with no
control plane to ask, or no answer in time, the wake goes ahead, and the control plane's next sweep measures it;
after an ask left unanswered, the stub's wakes go ahead without asking for ``ASK_BACKOFF_SECS``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Protocol

from .errors import Failure, describe_failure
from .journal import JOURNAL_ENV, WAKE_SOCKET, RequestJournal, note_phase, own_file, start_ticks, unreachable

DOZE_SUFFIX = ".doze"
DOZE = b"doze"
STATE = b"state"
BUSY = "busy"  # a batch runs: the control plane asks again later
MAX_MESSAGE = 4096
SUN_PATH_MAX = 107  # sockaddr_un's path, less its terminating NUL
ADMIT_PATH = "/v1/doze/wake/"  # + the model's name, quoted: the control plane's room for a wake
ADMIT_TIMEOUT_ENV = "SNOOZE_DOZE_ADMIT_TIMEOUT_SECS"
# Past the control plane's own wait for memory (its wake queue's bound, 10 s by default): it answers first.
DEFAULT_ADMIT_TIMEOUT_SECS = 15.0
_ADMIT_SHARE = 0.9  # of the bound, what the control plane may use: the rest carries its answer back
# After an ask the control plane left unanswered (frozen, or its loop held), wakes go ahead without asking this long:
# one slow wake per stub in that time, not one each.
ASK_BACKOFF_SECS = 30.0


class Dozable(Protocol):
    """What a model offers to doze (``preforked.PreforkedModel``)."""

    @property
    def can_doze(self) -> bool: ...

    @property
    def declares_unload(self) -> bool: ...

    def doze(self) -> dict[str, Any]: ...

    def wake(self) -> None: ...


def socket_address(path: str) -> tuple[str, int | None]:
    """``path`` as a unix socket address, and a directory descriptor to close after binding or connecting: a path
    longer than sockaddr_un holds goes through ``/proc/self/fd/<dir>/<name>``."""
    if len(path.encode()) <= SUN_PATH_MAX:
        return path, None
    fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY)
    return f"/proc/self/fd/{fd}/{os.path.basename(path)}", fd


def _log(model_id: str, message: str) -> None:
    print(f"snooze model '{model_id}': {message}", file=sys.stderr, flush=True)


def admit_timeout() -> float:
    """How long a wake waits for the control plane's room (``$SNOOZE_DOZE_ADMIT_TIMEOUT_SECS``, else 15 s)."""
    try:
        bound = float(os.environ.get(ADMIT_TIMEOUT_ENV) or DEFAULT_ADMIT_TIMEOUT_SECS)
    except ValueError:
        return DEFAULT_ADMIT_TIMEOUT_SECS
    return bound if bound == bound and bound > 0 else DEFAULT_ADMIT_TIMEOUT_SECS  # not NaN, not <= 0


class AskFailed(Exception):
    """The control plane could not be asked for room, or gave no answer in time (``timed_out``): the message says
    which."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def ask_room(model_id: str, stub: tuple[int, int], bound_secs: float, path: str) -> dict[str, Any]:
    """Ask the control plane to make room for this stub's wake (``stub``: its pid and start ticks) through its wake
    route's socket (``path``), and wait for its answer at most ``bound_secs``: what it did (``{"admitted": bool,
    "why": ...}``). ``AskFailed`` when it cannot be asked or did not answer; the wake goes ahead all the same.

    One HTTP/1.1 request on a unix socket, by hand: ``http.client`` (and the ``email`` package it imports) would
    add 1.7 MiB to every stub that can doze, measured, for one request a wake."""
    body = json.dumps({"stub": list(stub), "timeout_secs": bound_secs * _ADMIT_SHARE}).encode()
    route = ADMIT_PATH + "".join(c if (c.isascii() and c.isalnum()) or c in "-_.~" else _quote(c) for c in model_id)
    head = (
        f"POST {route} HTTP/1.1\r\nHost: snoozeml\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    deadline = time.monotonic() + bound_secs
    chunks: list[bytes] = []
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(bound_secs)
        address, dir_fd = socket_address(path)
        try:
            sock.connect(address)
        finally:
            if dir_fd is not None:
                os.close(dir_fd)
        sock.sendall(head + body)
        while chunk := sock.recv(MAX_MESSAGE):  # the route closes the connection after its answer
            chunks.append(chunk)
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    except OSError as e:
        raise AskFailed(unreachable(e, path, bound_secs), timed_out=isinstance(e, TimeoutError)) from None
    finally:
        sock.close()
    status_line, _, rest = b"".join(chunks).partition(b"\r\n")
    content = rest.partition(b"\r\n\r\n")[2]
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or parts[1] != b"200":
        raise AskFailed(f"the control plane answered {status_line[:80].decode('utf-8', 'replace')!r}")
    try:
        answer = json.loads(content)
    except ValueError:
        answer = None
    return answer if isinstance(answer, dict) else {}


def _quote(char: str) -> str:
    return "".join(f"%{b:02X}" for b in char.encode())


class DozeControl:
    """One model instance's doze state, the lock its batches run under, and the socket the control plane asks."""

    def __init__(self, model: Dozable, model_id: str, directory: str, journal: RequestJournal | None = None) -> None:
        self.model = model
        self.model_id = model_id
        self.journal = journal  # its unload() flag: a dozing instance has no clean-up left (a fast unload may end it)
        self.lock = threading.Lock()  # held by every batch, and by a doze
        self.dozing = False
        self.wakes = 0
        self.last_wake_secs: float | None = None
        self.last_ask_secs: float | None = None  # the control plane's room for the last wake: how long it took
        self._said_unasked = False  # a wake that could not ask the control plane was logged (once)
        self._ask_again_at = 0.0  # monotonic seconds: asks skipped until then (the last one was not answered)
        self.path = own_file(directory, DOZE_SUFFIX)
        self.wake_socket = os.path.join(directory, WAKE_SOCKET)  # the control plane's wake route: asked for room
        self.stub = (os.getpid(), start_ticks())
        self._closed = False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        address, dir_fd = socket_address(self.path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._listener.bind(address)
        finally:
            if dir_fd is not None:
                os.close(dir_fd)
        self._listener.listen(8)
        self._thread = threading.Thread(target=self._serve, name=f"snooze-doze-{model_id}", daemon=True)
        self._thread.start()

    @classmethod
    def for_model(cls, model: Any, model_id: str, journal: RequestJournal | None = None) -> DozeControl | None:
        """A control for ``model`` when it can doze (a preforked worker serves it) and ``$SNOOZE_JOURNAL_DIR`` is
        set; None otherwise (it never dozes, and its batches take no lock)."""
        directory = os.environ.get(JOURNAL_ENV)
        if not directory or not getattr(model, "can_doze", False):
            return None
        try:
            return cls(model, model_id, directory, journal)
        except OSError as e:
            _log(model_id, f"cannot doze: no socket at {own_file(directory, DOZE_SUFFIX)} ({e})")
            return None

    # --- the batch's side

    def wake_for_batch(self) -> Failure | None:
        """Under ``lock``, at a batch's start: wake a dozing instance; the failure to answer the batch with when its
        wake failed (it stays dozing), else None."""
        if not self.dozing:
            return None
        try:
            self.wake()
        except Exception as e:
            return Failure(*describe_failure(e, self.model_id, "load", None))
        note_phase("ready")
        return None

    def wake(self) -> None:
        """Under ``lock``, at a batch's start: fork a worker and load the model in it (raises what the load
        raised, and the instance stays dozing)."""
        started = time.perf_counter()
        self._ask_room()
        self.model.wake()
        self.dozing = False
        if self.journal is not None:
            self.journal.declare(unload=self.model.declares_unload)
        self.wakes += 1
        self.last_wake_secs = time.perf_counter() - started
        _log(self.model_id, f"woke from doze in {self.last_wake_secs * 1000:.1f} ms")

    def _ask_room(self) -> None:
        """The control plane's room for this wake, asked before the fork; any failure: the wake goes ahead."""
        started = time.perf_counter()
        if time.monotonic() < self._ask_again_at:
            self.last_ask_secs = None  # not asked: the last ask went unanswered (ASK_BACKOFF_SECS)
            return
        try:
            answer = ask_room(self.model_id, self.stub, admit_timeout(), self.wake_socket)
        except AskFailed as e:
            if e.timed_out:  # a control plane that answers nothing: not asked again for a while, and said each time
                self._ask_again_at = time.monotonic() + ASK_BACKOFF_SECS
                _log(
                    self.model_id, f"waking without the control plane's room: {e}; not asked for {ASK_BACKOFF_SECS:g} s"
                )
            elif not self._said_unasked:  # a Triton without snoozeml's control plane: said once, not at every wake
                self._said_unasked = True
                _log(self.model_id, f"waking without the control plane's room: {e}")
            self.last_ask_secs = time.perf_counter() - started
            return
        self.last_ask_secs = time.perf_counter() - started
        if answer.get("why"):
            _log(self.model_id, f"waking: {answer['why']}")

    # --- the control plane's side

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(5.0)
                try:
                    ask = conn.recv(MAX_MESSAGE)
                    answer = self._answer(ask)
                    conn.send(json.dumps(answer).encode())
                except OSError:
                    continue  # the asker left

    def _answer(self, ask: bytes) -> dict[str, Any]:
        if ask == STATE:
            return {
                "dozing": self.dozing,
                "wakes": self.wakes,
                "last_wake_secs": self.last_wake_secs,
                "last_ask_secs": self.last_ask_secs,
            }
        if ask != DOZE:
            return {"dozed": False, "why": f"unknown request {ask[:32]!r}"}
        if not self.lock.acquire(blocking=False):
            return {"dozed": False, "why": BUSY}
        try:
            if self.dozing:
                return {"dozed": False, "why": "dozing already"}
            if not self.model.can_doze:
                return {"dozed": False, "why": "its model runs in the stub"}
            started = time.perf_counter()
            try:
                info = self.model.doze()
            except Exception as e:  # the worker went anyway (it was ended): the instance dozes
                _log(self.model_id, f"the model's unload() failed while dozing: {e}")
                info = {}
            self.dozing = True
            if self.journal is not None:
                self.journal.declare(unload=False)
            secs = time.perf_counter() - started
            _log(self.model_id, f"dozing: worker ended in {secs * 1000:.1f} ms")
            return {"dozed": True, "secs": secs, **info}
        finally:
            self.lock.release()

    def close(self) -> None:
        """At finalize: no more asks (a thread blocked in accept ends with the process)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
