"""The activator: the gateway's cold path, inside the control-plane process.

Envoy sends it (see ``envoy.yaml.j2``):

- inference requests that Triton answered "not found" (a sleeping model), "unavailable" or "Stub
  process '<instance>' is not healthy." (a dead model process, ``controlplane.triton.dead_stub``):
  the activator wakes the model
  (``lifecycle.serving``: the lifecycle's single-flight ``ensure_ready``, then the model is held loaded
  until the forward is done), forwards the request to Triton unchanged and returns Triton's answer
  unchanged. A request never runs twice: one that was running in a model process when it died
  (the lifecycle reads that from the request journal, by Envoy's ``x-request-id``) is
  refused with an error that says so, and one that only met the dead process is sent after the
  model is recovered (``lifecycle.recovery``);
- model readiness, metadata and config, answered for a published model as if it were loaded (a
  request would succeed), and the repository API (index; load/unload with the admin scope).

Beside them, not reached through Envoy: the wake route of BLS calls into sleeping models, on a unix socket in
the request journal folder, and the wake-ups of the models a deployment declares in ``wakes`` (``bls_wake``).

HTTP is an ASGI app (Starlette, served by uvicorn on a loopback port); gRPC is a grpc.aio server with
a generic handler and identity serializers, so inference messages are forwarded as raw bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import httpx
import uvicorn

from controlplane.gateway.bls_wake import BlsWakeServer, DeclaredWakes
from controlplane.gateway.grpc_adapter import GRPC_OPTIONS, GrpcActivator
from controlplane.gateway.handlers import HoldRegistry, ModelAnswers, ReadyFlags, input_names_hint
from controlplane.gateway.http_adapter import HttpForwarder, create_http_app
from controlplane.gateway.wake_lua import held_log_path, ready_dir_path
from controlplane.publishing import Publishing
from controlplane.servers import EmbeddedUvicorn, wait_started
from controlplane.settings import Settings
from controlplane.store import ModelStore

if TYPE_CHECKING:
    from controlplane.lifecycle.port import LifecyclePort

# Imported from here by the stack and the tests: the servers, and the handlers they are built on.
__all__ = ["Activator", "HoldRegistry", "ModelAnswers", "ReadyFlags"]


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class Activator:
    """The HTTP (uvicorn) and gRPC (grpc.aio) activator servers on loopback; start/stop in one event loop.

    Ports come from ``settings.activator_http_port`` / ``activator_grpc_port`` (0 = a free port);
    after ``start()``, ``http_address`` and ``grpc_address`` are what the Envoy bootstrap needs.
    ``wake_socket``: where the BLS wake route listens (None: Triton's stubs share no folder with this process).
    """

    def __init__(
        self,
        lifecycle: LifecyclePort,
        store: ModelStore,
        settings: Settings,
        *,
        triton_http_url: str,
        triton_grpc_url: str,
        host: str = "127.0.0.1",
        wake_socket: Path | None = None,
        publishing: Publishing | None = None,
    ) -> None:
        self.settings = settings
        self.host = host
        self.answers = ModelAnswers(lifecycle, store, settings, publishing=publishing)
        self.triton_http_url = triton_http_url
        self.triton_grpc_url = triton_grpc_url
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self._client: httpx.AsyncClient | None = None
        self._grpc: GrpcActivator | None = None
        self._grpc_server: grpc.aio.Server | None = None
        self._uvicorn: EmbeddedUvicorn | None = None
        self._uvicorn_task: asyncio.Task[None] | None = None
        self.holds = HoldRegistry(self.answers, held_log_path(settings))
        self.ready_flags = ReadyFlags(ready_dir_path(settings), lambda m: input_names_hint(store.get(m)))
        self._tail_task: asyncio.Task[None] | None = None
        self.bls_wake = BlsWakeServer(lifecycle, store, wake_socket) if wake_socket is not None else None
        self.declared_wakes = DeclaredWakes(lifecycle, store)

    @property
    def http_address(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    async def start(self) -> None:
        self.ready_flags.open()
        self.answers.lifecycle.add_state_listener(self.ready_flags.update)
        self.answers.lifecycle.add_state_listener(self.answers.on_state)
        self.answers.lifecycle.add_state_listener(self.declared_wakes.on_state)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        app = create_http_app(self.answers, HttpForwarder(self.triton_http_url, self._client), self.holds)
        self._tail_task = asyncio.create_task(self.holds.tail())
        sock = _bind(self.host, self.settings.activator_http_port)
        self.http_port = sock.getsockname()[1]
        self._uvicorn = EmbeddedUvicorn(
            uvicorn.Config(app, lifespan="off", access_log=False, log_level="warning", timeout_keep_alive=300)
        )
        self._uvicorn_task = asyncio.create_task(self._uvicorn.serve(sockets=[sock]))
        await wait_started(
            self._uvicorn,
            self._uvicorn_task,
            f"the activator's HTTP server on {self.http_address} stopped during start-up",
        )

        self._grpc = GrpcActivator(self.answers, self.triton_grpc_url)
        self._grpc_server = grpc.aio.server(options=GRPC_OPTIONS)
        self._grpc_server.add_generic_rpc_handlers((self._grpc.handler(),))
        self.grpc_port = self._grpc_server.add_insecure_port(f"{self.host}:{self.settings.activator_grpc_port}")
        await self._grpc_server.start()
        if self.bls_wake is not None:
            await self.bls_wake.start()

    async def stop(self, grace: float = 5.0) -> None:
        self.answers.lifecycle.remove_state_listener(self.ready_flags.update)
        self.answers.lifecycle.remove_state_listener(self.answers.on_state)
        self.answers.lifecycle.remove_state_listener(self.declared_wakes.on_state)
        await self.declared_wakes.aclose()
        if self.bls_wake is not None:
            await self.bls_wake.stop()
        self.ready_flags.close()
        if self._tail_task is not None:
            self._tail_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tail_task
            self._tail_task = None
        await self.holds.aclose()
        if self._grpc_server is not None:
            await self._grpc_server.stop(grace)
        if self._grpc is not None:
            await self._grpc.aclose()
        if self._uvicorn is not None and self._uvicorn_task is not None:
            self._uvicorn.should_exit = True
            await self._uvicorn_task
        if self._client is not None:
            await self._client.aclose()
        self._grpc_server = self._grpc = self._uvicorn = self._uvicorn_task = self._client = None
