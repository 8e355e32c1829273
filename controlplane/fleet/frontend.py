"""The front of a fleet: the fleet gateway's Envoy and the fleet API, over one list of nodes.

`snoozectl fleet up` starts it in front of the nodes it runs itself; `snoozectl fleet gateway` runs it
alone, in front of nodes that run elsewhere (a Kubernetes StatefulSet's pods, or any static list).
Both run until SIGINT/SIGTERM, or until the gateway's Envoy dies (the process then exits non-zero,
so a supervisor such as the kubelet starts it again).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import uvicorn
from rich.console import Console

from controlplane.fleet.api import create_fleet_app
from controlplane.fleet.gateway import FleetGateway, NodeAddress
from controlplane.gateway.envoy import gateway_keys
from controlplane.servers import EmbeddedUvicorn, wait_started
from controlplane.settings import Settings

HEALTH_CHECK_SECS = 1.0


class FleetFrontend:
    """Envoy on ``settings.http_port``/``grpc_port`` (routing each model to its owner node) and the fleet
    API on ``settings.api_port``. ``dns``: node hosts are DNS names, resolved by Envoy (STRICT_DNS, so
    a rescheduled pod's new address is followed) and by the fleet API on every call."""

    def __init__(self, settings: Settings, nodes: Sequence[NodeAddress], work_dir: Path, *, dns: bool = False) -> None:
        self.settings = settings
        self.nodes = list(nodes)
        self.work_dir = work_dir
        self.dns = dns
        self.gateway: FleetGateway | None = None
        self._api: uvicorn.Server | None = None
        self._api_task: asyncio.Task[None] | None = None

    @property
    def connect_host(self) -> str:
        s = self.settings
        return "127.0.0.1" if s.host in ("0.0.0.0", "::") else s.host

    async def start(self) -> None:
        s = self.settings
        self.gateway = FleetGateway(
            self.nodes, self.work_dir, host=s.host, http_port=s.http_port, grpc_port=s.grpc_port,
            api_keys=gateway_keys(s), dns=self.dns,
        )  # fmt: skip
        await asyncio.to_thread(self.gateway.start)
        nodes = self.nodes
        app = create_fleet_app(s, lambda: nodes, gateway_http_url=f"http://{self.connect_host}:{s.http_port}")
        self._api = EmbeddedUvicorn(
            uvicorn.Config(app, host=s.host, port=s.api_port, log_level="warning", access_log=False, lifespan="on")
        )
        self._api_task = asyncio.create_task(self._api.serve())
        await wait_started(
            self._api,
            self._api_task,
            f"the fleet API could not listen on {s.host}:{s.api_port}",
            hint="pass --api-port",
        )

    def failure(self) -> str | None:
        """Why this front stopped serving on its own, or None."""
        if self.gateway is not None and not self.gateway.running():
            return f"the fleet gateway's Envoy exited (log {self.gateway.process.log_file})"
        if self._api_task is not None and self._api_task.done():
            return "the fleet API stopped"
        return None

    async def stop(self) -> None:
        if self._api is not None and self._api_task is not None:
            self._api.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._api_task, 10)
        if self.gateway is not None:
            await asyncio.to_thread(self.gateway.stop)

    def banner_lines(self) -> list[str]:
        s = self.settings
        return [
            f"fleet gateway: http://{s.host}:{s.http_port} (HTTP)  {s.host}:{s.grpc_port} (gRPC)",
            f"fleet API: http://{s.host}:{s.api_port}  (snoozectl status --url http://{self.connect_host}:{s.api_port})",
        ]

    def banner(self) -> str:
        """What `snoozectl fleet gateway` prints once serving: its ports and the nodes it routes to."""
        resolution = "DNS names, resolved by Envoy and the fleet API" if self.dns else "addresses"
        nodes = [f"  {n.name}: gateway {n.http_url}, API {n.api_url}" for n in self.nodes]
        return "\n".join([*self.banner_lines(), f"nodes ({resolution}):", *nodes])


class FleetService(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def failure(self) -> str | None: ...

    def banner(self) -> str: ...


async def run_until_signal(service: FleetService, console: Console) -> int:
    """Start ``service``, serve until SIGINT/SIGTERM (0) or until it fails on its own (1), stop it."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    def on_signal() -> None:
        if stopping.is_set():  # a second Ctrl-C, or SIGTERM during the stop: its children die with it (PDEATHSIG)
            console.print("stopping: forced", highlight=False)
            os._exit(130)
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    code = 0
    try:
        await service.start()
        console.print(service.banner(), highlight=False)
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), HEALTH_CHECK_SECS)
            problem = service.failure()
            if problem:
                console.print(f"[bold red]{problem}; stopping[/]", highlight=False)
                code = 1
                break
        console.print("stopping")
    finally:
        await service.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return code
