"""`snoozectl fleet up`: N nodes and the fleet gateway on one machine (development, demos, tests).

Each node is a `snoozectl serve` process (its own embedded tritonserver, lifecycle, activator and node
gateway) over one shared model store folder; the first node publishes ``--models`` into it (validated
once), the others serve what is in the store. The fleet gateway (Envoy) routes every model to its
owner node; the fleet API merges the nodes' control APIs (both: controlplane.fleet.frontend, shared with
`snoozectl fleet gateway`). A node that dies is started again on the
same ports (as Kubernetes restarts a pod), and rejoins the ring under its name. Ctrl-C stops them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console

from controlplane.child_processes import spawn, stop_group
from controlplane.errors import SnoozeError
from controlplane.fleet.frontend import FleetFrontend
from controlplane.fleet.gateway import NodeAddress
from controlplane.modes import AuthMode
from controlplane.settings import Settings
from controlplane.triton.launcher import free_port

log = logging.getLogger("snoozeml.fleet")
SNOOZECTL = str(Path(sys.executable).parent / "snoozectl")
NODE_START_SECS = 120.0
RESTART_DELAY_SECS = 1.0


class NodeProcess:
    """One node: `snoozectl serve` over the shared store, on fixed ports (kept across restarts).
    ``env``: SNOOZE_* settings for this node on top of the inherited environment (keys, timings)."""

    def __init__(
        self, address: NodeAddress, work_dir: Path, store: Path, *, models: Path | None, no_auth: bool,
        env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.address = address
        self.env = env
        self.work_dir = work_dir
        self.store = store
        self.models = models
        self.no_auth = no_auth
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = work_dir.parent / f"{address.name}.log"
        self.starts = 0

    def command(self) -> list[str]:
        a = self.address
        cmd = [
            SNOOZECTL, "serve", "--work-dir", str(self.work_dir), "--model-repository", str(self.store),
            "--host", a.host, "--http-port", str(a.http_port), "--grpc-port", str(a.grpc_port),
            "--api-port", str(a.api_port),
        ]  # fmt: skip
        if self.models is not None:
            cmd += ["--models", str(self.models)]
        if self.no_auth:
            cmd.append("--no-auth")
        return cmd

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = spawn(
                self.command(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **self.env} if self.env else None,
            )  # fmt: skip
        self.starts += 1

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def wait_ready(self, timeout: float = NODE_START_SECS) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                if not self.running():
                    raise SnoozeError(
                        f"fleet node {self.address.name} exited during start-up; last lines of {self.log}:\n"
                        + "\n".join(self.log.read_text(errors="replace").splitlines()[-30:]),
                        hint="read the node's log; a busy port or a broken package are the usual causes",
                    )
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(f"{self.address.api_url}/health/ready")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise SnoozeError(f"fleet node {self.address.name} not ready within {timeout:g}s (log {self.log})")
                await asyncio.sleep(0.2)

    def stop(self, grace: float = 30) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace)


class Fleet:
    def __init__(
        self, settings: Settings, *, nodes: int, models: Path | None, work_dir: Path, console: Console | None = None
    ) -> None:  # fmt: skip
        if nodes < 1:
            raise SnoozeError(f"a fleet needs at least one node, got --nodes {nodes}", hint="pass --nodes 3")
        self.settings = settings
        self.work_dir = work_dir.resolve()
        self.store = self.work_dir / "store"
        self.console = console or Console(stderr=True)
        no_auth = settings.auth == AuthMode.OFF
        self.nodes = [
            NodeProcess(
                NodeAddress(f"node-{i}", "127.0.0.1", free_port(), free_port(), free_port()),
                self.work_dir / f"node-{i}",
                self.store,
                models=models if i == 1 else None,
                no_auth=no_auth,
            )
            for i in range(1, nodes + 1)
        ]
        self.frontend: FleetFrontend | None = None
        self._supervisor: asyncio.Task[None] | None = None

    @property
    def addresses(self) -> list[NodeAddress]:
        return [n.address for n in self.nodes]

    async def start(self) -> None:
        self.store.mkdir(parents=True, exist_ok=True)
        first, rest = self.nodes[0], self.nodes[1:]
        first.start()  # it publishes --models into the store: once, before the others read it
        await first.wait_ready()
        for node in rest:
            node.start()
        await asyncio.gather(*(n.wait_ready() for n in rest))
        self.frontend = FleetFrontend(self.settings, self.addresses, self.work_dir / "gateway")
        await self.frontend.start()
        self._supervisor = asyncio.create_task(self._supervise())

    async def _supervise(self) -> None:
        """Start a node that died again, on its ports and under its name (it rejoins the ring)."""
        while True:
            await asyncio.sleep(RESTART_DELAY_SECS)
            for node in self.nodes:
                if node.proc is not None and not node.running():
                    self.console.print(f"[yellow]{node.address.name} exited ({node.proc.returncode}); restarting[/]")
                    node.start()

    async def stop(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        if self.frontend is not None:
            await self.frontend.stop()
        await asyncio.gather(*(asyncio.to_thread(n.stop) for n in self.nodes))

    def failure(self) -> str | None:
        """The front's failure (a dead node is restarted by the supervisor instead)."""
        return self.frontend.failure() if self.frontend is not None else None

    def banner(self) -> str:
        lines = [*(self.frontend.banner_lines() if self.frontend else []), f"store: {self.store}"]
        for n in self.nodes:
            lines.append(f"  {n.address.name}: gateway {n.address.http_url}, API {n.address.api_url}, log {n.log}")
        return "\n".join(lines)
