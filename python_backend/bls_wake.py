"""A BLS call into a sleeping model wakes it: the stub's side.

Inside Triton's python backend a model calls another with ``pb_utils.InferenceRequest(model_name=...).exec()``
(or ``async_exec``, or either with ``decoupled=True``). Triton 2.51 answers a call into a model it has not
loaded with an error response (measured on the embedded tritonserver; docs/packages.md, "BLS"), and the model
never ran. ``install(model_id)`` patches ``InferenceRequest`` in this stub so that such an answer is not the
caller's: the callee is woken through the control plane (``wake``) and the same request is sent again, within
the call's bound (``InferenceRequest(timeout=...)`` in microseconds when set, else ``$SNOOZE_BLS_WAKE_TIMEOUT_SECS``).
Every other answer, the callee's own errors included, is returned unchanged; a wake that cannot happen is an
error response naming the callee and why, after Triton's own words.

The control plane listens on a unix socket in the request journal folder (``$SNOOZE_JOURNAL_DIR/wake.sock``,
``controlplane/gateway/bls_wake.py``): the one folder Triton and the control plane share in every topology, where
only their uid may connect.

Standard library only, Python 3.10, no ``controlplane`` import (this runs in the stub).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import importlib
import json
import os
import re
import socket
import sys
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

from .journal import JOURNAL_ENV, WAKE_SOCKET, unreachable

WAKE_PATH = "/v1/bls/wake/"  # + the callee's name, quoted
TIMEOUT_ENV = "SNOOZE_BLS_WAKE_TIMEOUT_SECS"
DEFAULT_TIMEOUT_SECS = 60.0
# Of the bound, what the wake itself may use: the rest carries the answer back and the request again.
_WAKE_SHARE = 0.9
# Less of the bound than this left after a wake that did not hold: the call ends (another would only time out).
MIN_WAKE_SECS = 0.05
# Wakes per call: a callee evicted between its wake and the call is woken again, not without end (a call naming a
# version the model lacks gets Triton's "not ready" however often the model is woken).
WAKE_ROUNDS = 3
# sockaddr_un holds 108 bytes; a longer path is reached through the folder's descriptor.
_UNIX_PATH_MAX = 100

# Triton 2.51's answers to a BLS call into a model it cannot run now; the python backend puts
# "Model <callee> - Error when running inference: " before the server's words. The model ran nothing.
_NOT_RUNNABLE = re.compile(
    r"Model (?P<name>.+) - Error when running inference: (?:"
    # python_backend request_executor.cc: TRITONSERVER_ServerModelIsReady said no (never loaded, or unloaded)
    r"Failed for execute the inference request\. Model '(?P=name)' is not ready\."
    # the server's GetModel, when the model left between that check and the request's creation
    r"|Request for unknown model: '(?P=name)' (?:is not found|has no available versions|version \d+ is not found)"
    r")",
    re.DOTALL,
)


def not_ready_callee(message: str) -> str | None:
    """The callee's name when ``message`` is Triton's answer to a BLS call into a model it has not loaded."""
    match = _NOT_RUNNABLE.fullmatch(message)
    return match.group("name") if match else None


class WakeFailed(Exception):
    """The callee could not be woken: the message says why."""


def socket_path() -> str | None:
    """Where the control plane's wake route listens, or None when this Triton has no journal folder."""
    folder = os.environ.get(JOURNAL_ENV)
    return os.path.join(folder, WAKE_SOCKET) if folder else None


@contextlib.contextmanager
def unix_address(path: str) -> Iterator[str]:
    """``path`` as an AF_UNIX address: itself, or when too long, the same file through its folder's descriptor."""
    if len(os.fsencode(path)) < _UNIX_PATH_MAX:
        yield path
        return
    folder, name = os.path.split(path)
    fd = os.open(folder or ".", os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            with unix_address(self._path) as address:
                sock.connect(address)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def post(route: str, payload: dict[str, Any], bound_secs: float, path: str | None = None) -> tuple[int, bytes]:
    """POST ``payload`` (JSON) to the control plane's ``route`` on its unix socket: the answer's status and body.
    ``WakeFailed`` when it cannot be reached or does not answer within ``bound_secs``."""
    path = path or socket_path()
    if path is None:
        raise WakeFailed(f"this Triton has no {JOURNAL_ENV}, so snoozeml's control plane cannot be asked")
    conn = _UnixConnection(path, timeout=bound_secs)
    try:
        conn.request("POST", route, body=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    except OSError as e:
        raise WakeFailed(unreachable(e, path, bound_secs)) from None
    finally:
        conn.close()


def wake(callee: str, caller: str, bound_secs: float, path: str | None = None) -> None:
    """Ask the control plane to wake ``callee`` and return once it is READY; ``WakeFailed`` says why not."""
    bound_secs = max(bound_secs, MIN_WAKE_SECS)
    payload = {"caller": caller, "timeout_secs": bound_secs * _WAKE_SHARE}
    status, raw = post(WAKE_PATH + urllib.parse.quote(callee, safe=""), payload, bound_secs, path)
    if status != 200:
        raise WakeFailed(_reason(status, raw))


def _reason(status: int, raw: bytes) -> str:
    try:
        answer = json.loads(raw)
        text = str(answer["error"])
        hint = answer.get("hint")
    except (ValueError, KeyError, TypeError):
        return f"the control plane answered HTTP {status}: {raw[:200].decode('utf-8', 'replace')}"
    return f"{text} ({hint})" if hint and hint not in text else text


class _Installed:
    """What ``install`` put in place: the caller's name, its bound, and the methods it wraps."""

    def __init__(self, pb: Any, caller: str, timeout_secs: float | None) -> None:
        self.pb = pb
        self.caller = caller
        self.timeout_secs = timeout_secs
        cls = pb.InferenceRequest
        self.exec = cls.exec
        self.async_exec: Any = getattr(cls, "async_exec", None)  # absent from stubs older than Triton 23.04

    def bound(self, request: Any) -> float:
        """The request's own timeout (microseconds) when it sets one, else the caller's, else the environment's."""
        with contextlib.suppress(Exception):
            micros = int(request.timeout())
            if micros > 0:
                return micros / 1e6
        if self.timeout_secs is not None:
            return self.timeout_secs
        try:
            return float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_SECS)
        except ValueError:
            return DEFAULT_TIMEOUT_SECS

    def failed(self, head: Any, callee: str, why: str, decoupled: bool) -> Any:
        """An error response for the caller: Triton's words for the call, then why snoozeml could not wake it."""
        message = f"{head.error().message()} snoozeml could not wake model '{callee}' for '{self.caller}': {why}"
        error_cls = self.pb.TritonError
        try:
            error = error_cls(message, head.error().code())
        except TypeError:
            error = error_cls(message)
        response = self.pb.InferenceResponse(error=error)
        return _Replayable(response, None) if decoupled else response

    def log(self, text: str) -> None:
        logger = getattr(self.pb, "Logger", None)
        if logger is not None:
            with contextlib.suppress(Exception):
                logger.log_info(f"snoozeml: {text}")


def _not_ready(response: Any) -> str | None:
    try:
        if not response.has_error():
            return None
        return not_ready_callee(response.error().message())
    except Exception:  # not a response this module knows: the caller's, unchanged
        return None


def _first(answer: Any, decoupled: bool) -> tuple[Any, Any]:
    """The first response of an answer, and the answer to give back (a stream keeps its first response)."""
    if not decoupled:
        return answer, answer
    try:
        head = next(answer)  # exec(decoupled=True) returns once the first response is there: no wait
    except StopIteration:
        return None, answer
    return head, _Replayable(head, answer)


class _Replayable:
    """A decoupled call's responses with the first (read to check it) given first again.

    Like Triton's ``ResponseIterator``: a loop over it after the stream ended starts from the first response."""

    def __init__(self, head: Any, rest: Any) -> None:
        self._head = head
        self._rest = rest
        self._head_due = True

    def __iter__(self) -> _Replayable:
        if not self._head_due and self._rest is not None:
            iter(self._rest)  # an ended stream replays all of its responses, the first one included
        elif not self._head_due:
            self._head_due = True
        return self

    def __next__(self) -> Any:
        if self._head_due:
            self._head_due = False
            return self._head
        if self._rest is None:
            raise StopIteration
        return next(self._rest)


# On the patched class: what install put there (so a second copy of this module, loaded from another model
# folder into the same stub, finds it and does not wrap the methods twice).
_MARK = "_snoozeml_bls_wake"


def _request_class() -> tuple[Any, Any]:
    pb = sys.modules.get("triton_python_backend_utils") or importlib.import_module("triton_python_backend_utils")
    return pb, pb.InferenceRequest


def install(model_id: str, *, timeout_secs: float | None = None) -> None:
    """Make this stub's BLS calls wake a sleeping callee (call once, from ``initialize``; again replaces the
    caller's name and bound). ``timeout_secs``: the caller's bound where a request sets no timeout of its own
    (default ``$SNOOZE_BLS_WAKE_TIMEOUT_SECS``, else 60 s)."""
    pb, cls = _request_class()
    installed = getattr(cls, _MARK, None)
    if installed is not None:
        installed.caller, installed.timeout_secs = model_id, timeout_secs
        return
    installed = _Installed(pb, model_id, timeout_secs)
    cls.exec = _patched_exec(installed)
    if installed.async_exec is not None:
        cls.async_exec = _patched_async_exec(installed)
    setattr(cls, _MARK, installed)


def uninstall() -> None:
    """Put the stub's own ``exec`` and ``async_exec`` back (tests)."""
    _, cls = _request_class()
    installed = getattr(cls, _MARK, None)
    if installed is None:
        return
    cls.exec = installed.exec
    if installed.async_exec is not None:
        cls.async_exec = installed.async_exec
    delattr(cls, _MARK)


def _patched_exec(installed: _Installed) -> Any:
    original = installed.exec

    def bls_exec(self: Any, decoupled: bool = False) -> Any:
        head, answer = _first(original(self, decoupled=decoupled), decoupled)
        callee = _not_ready(head)
        if callee is None:
            return answer
        started = time.monotonic()
        deadline = started + installed.bound(self)
        for _ in range(WAKE_ROUNDS):
            try:
                wake(callee, installed.caller, deadline - time.monotonic())
            except WakeFailed as e:
                return installed.failed(head, callee, str(e), decoupled)
            head, answer = _first(original(self, decoupled=decoupled), decoupled)
            if _not_ready(head) != callee:
                installed.log(f"woke model '{callee}' for a BLS call from '{installed.caller}' in {_since(started)}")
                return answer
            if deadline - time.monotonic() < MIN_WAKE_SECS:
                break
        return installed.failed(head, callee, _still_not_ready(started), decoupled)

    return bls_exec


def _patched_async_exec(installed: _Installed) -> Any:
    original = installed.async_exec

    async def settle(request: Any, future: Any, decoupled: bool) -> Any:
        head, answer = _first(await future, decoupled)
        callee = _not_ready(head)
        if callee is None:
            return answer
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        deadline = started + installed.bound(request)
        for _ in range(WAKE_ROUNDS):
            try:
                await loop.run_in_executor(None, wake, callee, installed.caller, deadline - time.monotonic())
            except WakeFailed as e:
                return installed.failed(head, callee, str(e), decoupled)
            head, answer = _first(await original(request, decoupled=decoupled), decoupled)
            if _not_ready(head) != callee:
                installed.log(f"woke model '{callee}' for a BLS call from '{installed.caller}' in {_since(started)}")
                return answer
            if deadline - time.monotonic() < MIN_WAKE_SECS:
                break
        return installed.failed(head, callee, _still_not_ready(started), decoupled)

    def bls_async_exec(self: Any, decoupled: bool = False) -> Any:
        # A future, as the stub's own: the call is under way before it is awaited.
        return asyncio.ensure_future(settle(self, original(self, decoupled=decoupled), decoupled))

    return bls_async_exec


def _since(started: float) -> str:
    return f"{time.monotonic() - started:.2f} s"


def _still_not_ready(started: float) -> str:
    """Woken each time, and Triton still would not run the call: evicted again each time, or it lacks the version."""
    return (
        f"the control plane had it loaded, yet Triton still answered that it is not ready ({_since(started)}); "
        "if the call names a model_version, check that the published model has that version"
    )
