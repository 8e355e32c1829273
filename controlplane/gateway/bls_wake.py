"""Models called through BLS, woken by the control plane: the wake route and the declared pre-wakes.

A python model's BLS call (``pb_utils.InferenceRequest(model_name=...).exec()``) reaches its callee inside
Triton, never through the gateway; the callee's name may come from the request. The stub's side
(``python_backend/bls_wake.py``) meets Triton's "not ready" answer and calls ``POST /v1/bls/wake/<callee>``
here, which wakes the callee through the lifecycle (``serving``: single flight, the wake queue) and answers
once it is READY: 200; 404 when the callee is not published; 503 with Retry-After when it cannot load in
the call's bound. The stub then sends the same request again.

The route listens on a unix socket, ``wake.sock`` in the request journal folder, and nowhere else: that
folder is shared by Triton and the control plane in every topology that has one (the embedded child, the
two processes, compose's and Kubernetes' ``/run/snooze`` volume) and is theirs alone (mode 0770, and the
socket 0600: only their uid connects). It is not on the activator's TCP port: in compose the control plane
and Triton do not share a network namespace, and a loopback port is open to every user of the machine.

The same socket takes a dozing stub's ask for room before it forks its worker (``POST /v1/doze/wake/<model>``, JSON
``{"stub": [pid, start ticks], "timeout_secs": float}``, ``python_backend/doze.py``): the lifecycle counts the wake
and evicts idle models for it (``LifecyclePort.admit_doze_wake``), and answers 200 ``{"admitted": bool, "why": ...}``
either way: the wake is never refused.

``DeclaredWakes`` wakes the models a deployment lists in ``wakes`` when a load of that model starts, for
callees known in advance (their cold start then overlaps the caller's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from controlplane.errors import NotFoundError, SnoozeError
from controlplane.gateway.http_adapter import error_response
from controlplane.lifecycle.state import ModelState
from controlplane.servers import EmbeddedUvicorn, wait_started
from controlplane.store import ModelStore
from python_backend.bls_wake import WAKE_PATH, WAKE_SOCKET, unix_address
from python_backend.doze import ADMIT_PATH

if TYPE_CHECKING:
    from controlplane.lifecycle.port import LifecyclePort

log = logging.getLogger("snoozeml.gateway")

# A stub that sends no bound (or a wrong one) waits at most this long.
MAX_WAKE_SECS = 3600.0
# A stub's wake from doze waits for room at most this long (its own bound is 15 s by default).
MAX_DOZE_ROOM_SECS = 60.0
STOP_GRACE_SECS = 2

__all__ = ["WAKE_SOCKET", "BlsWakeServer", "DeclaredWakes", "create_wake_app", "wake_socket_path"]


def wake_socket_path(journal_dir: Path) -> Path:
    """Where the wake route listens: the stubs find it from their ``SNOOZE_JOURNAL_DIR``."""
    return journal_dir / WAKE_SOCKET


class CalleeNotPublishedError(NotFoundError):
    code = "bls_callee_not_published"


def create_wake_app(lifecycle: LifecyclePort, store: ModelStore) -> Starlette:
    """The wake route (``POST /v1/bls/wake/<callee>``, JSON ``{"caller": str, "timeout_secs": float}``)."""

    async def wake(request: Request) -> Response:
        callee = request.path_params["model"]
        caller, bound = _call(await request.body())
        try:
            if not store.exists(callee):
                raise CalleeNotPublishedError(
                    f"model '{callee}' is not published",
                    hint=f"publish '{callee}', or correct the model name '{caller}' passes to its BLS call",
                )
            started = time.monotonic()
            async with lifecycle.serving(callee, timeout=bound):
                pass
        except SnoozeError as e:
            log.warning("model '%s': a BLS call from '%s' could not wake it: %s", callee, caller, e)
            return error_response(e)
        log.info("model '%s': woken for a BLS call from '%s' (%.2f s)", callee, caller, time.monotonic() - started)
        return JSONResponse({"model": callee, "state": ModelState.READY.value})

    async def doze_wake(request: Request) -> Response:
        model = request.path_params["model"]
        stub, bound = _doze_call(await request.body())
        answer = await lifecycle.admit_doze_wake(model, stub, timeout=bound)
        return JSONResponse({"model": model, **answer})

    return Starlette(
        routes=[
            Route(WAKE_PATH + "{model}", wake, methods=["POST"]),
            Route(ADMIT_PATH + "{model}", doze_wake, methods=["POST"]),
        ]
    )


def _call(body: bytes) -> tuple[str, float]:
    """The caller's name and the wait's bound from the stub's JSON (a missing or broken one: unnamed, the most)."""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        raw: Any = json.loads(body or b"{}")
        bound = float(raw.get("timeout_secs", MAX_WAKE_SECS))
        if bound != bound:  # NaN
            bound = MAX_WAKE_SECS
        return str(raw.get("caller") or "a python model"), min(max(bound, 0.0), MAX_WAKE_SECS)
    return "a python model", MAX_WAKE_SECS


def _doze_call(body: bytes) -> tuple[tuple[int, int] | None, float]:
    """The asking stub (pid, start ticks; None when unsaid) and its wait's bound (the lifecycle caps it at the wake
    queue's, ``SNOOZE_WAKE_QUEUE_TIMEOUT_SECS``: a wake from doze waits for memory no longer than one from unloaded)."""
    stub: tuple[int, int] | None = None
    bound = MAX_DOZE_ROOM_SECS
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        raw: Any = json.loads(body or b"{}")
        said = raw.get("stub")
        if isinstance(said, list) and len(said) == 2 and all(isinstance(n, int) for n in said):
            stub = (said[0], said[1])
        sent = float(raw.get("timeout_secs", MAX_DOZE_ROOM_SECS))
        bound = sent if sent == sent else MAX_DOZE_ROOM_SECS  # not NaN
    return stub, min(max(bound, 0.0), MAX_DOZE_ROOM_SECS)


class BlsWakeServer:
    """The wake route's HTTP server on its unix socket (uvicorn, in the control plane's event loop)."""

    def __init__(self, lifecycle: LifecyclePort, store: ModelStore, path: Path) -> None:
        self.path = path
        self.app = create_wake_app(lifecycle, store)
        self._server: EmbeddedUvicorn | None = None
        self._task: asyncio.Task[None] | None = None
        self._inode: int | None = None

    async def start(self) -> None:
        sock = self._bind()
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            access_log=False,
            log_level="warning",
            # a wake still waiting at stop (its load was cancelled: it answers at once) ends with the stop
            timeout_graceful_shutdown=STOP_GRACE_SECS,
        )
        self._server = EmbeddedUvicorn(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        await wait_started(self._server, self._task, f"the BLS wake route on {self.path} stopped during start-up")

    def _bind(self) -> socket.socket:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Left by a control plane that did not stop cleanly (this journal folder is this stack's alone).
        self.path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with unix_address(str(self.path)) as address:
                sock.bind(address)
            os.chmod(self.path, 0o600)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._inode = self.path.stat().st_ino
        return sock

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        self._server = self._task = None
        with contextlib.suppress(OSError):
            if self._inode is not None and self.path.stat().st_ino == self._inode:  # not a newer server's
                self.path.unlink()
        self._inode = None


class DeclaredWakes:
    """Wakes a model's declared callees (its deployment's ``wakes``) when a load of it starts from sleep.

    A lifecycle state listener (called inside the transition, so it only starts tasks): a model that goes
    to LOADING from anything but READY starts one wake-up per declared callee, each a wake-up like a
    request's (single flight, the wake queue, its bound). A callee that is not published, or fails to load,
    is logged; the caller's own load goes on.
    """

    def __init__(self, lifecycle: LifecyclePort, store: ModelStore) -> None:
        self.lifecycle = lifecycle
        self.store = store
        self._states: dict[str, ModelState] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.started = 0  # wake-ups started (status and tests)

    def on_state(self, model: str, state: ModelState | None) -> None:
        before = self._states.get(model)
        if state is None:
            self._states.pop(model, None)
            return
        self._states[model] = state
        if state != ModelState.LOADING or before == ModelState.READY:
            return
        for callee in self._declared(model):
            task = asyncio.get_running_loop().create_task(self._wake(model, callee))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            self.started += 1

    def _declared(self, model: str) -> list[str]:
        try:
            wakes = self.store.get(model).deployment.wakes
        except SnoozeError:
            return []
        return [callee for callee in wakes if callee != model]

    async def _wake(self, caller: str, callee: str) -> None:
        if not self.store.exists(callee):
            log.warning("model '%s': declares wakes = ['%s'], which is not published: not woken", caller, callee)
            return
        try:
            async with self.lifecycle.serving(callee):
                pass
        except SnoozeError as e:
            log.warning("model '%s': woken with '%s' (its wakes), but it did not load: %s", callee, caller, e)
        else:
            log.info("model '%s': woken with '%s' (its wakes)", callee, caller)

    async def aclose(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
