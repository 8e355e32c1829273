"""The fleet the fleet bench measures: N `snoozectl serve` nodes over one model store, each with its own embedded
Triton, control plane and node gateway (auth on, autoscaling off), and a fleet gateway (Envoy) per routing policy in
front of them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common import ADMIN_KEY, API_KEY, echo_package, models_toml
from controlplane.fleet.gateway import FleetGateway, NodeAddress
from controlplane.fleet.up import NodeProcess
from controlplane.gateway.envoy import ApiKey
from controlplane.triton.launcher import free_port

POLICIES = {"affine": "ring_hash", "round_robin": "round_robin"}
HELD = ("ready", "unloading")  # states in which a model's processes hold memory
NODE_ENV = {
    "SNOOZE_API_KEYS": json.dumps([API_KEY]),
    "SNOOZE_ADMIN_KEYS": json.dumps([ADMIN_KEY]),
    "SNOOZE_AUTOSCALE": "false",  # instance counts move by loads and unloads only
    "SNOOZE_LOG_LEVEL": "warning",
    "SNOOZE_SHUTDOWN_GRACE_SECS": "1",
    "SNOOZE_STORE_POLL_SECS": "0.5",
}


_COUNTERS = {
    "snooze_wake_waits_total": "wake_waits",
    "snooze_idle_unloads_total": "idle_unloads",
    "snooze_wake_timeouts_total": "wake_timeouts",
    "snooze_cold_start_seconds_sum": "load_secs",
}


def _counters(metrics_text: str) -> dict[str, float]:
    """One node's counters, summed over models, from its /metrics."""
    out = dict.fromkeys(("wake_waits", "request_loads", "idle_unloads", "wake_timeouts", "load_secs"), 0.0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in _COUNTERS:
                out[_COUNTERS[sample.name]] += sample.value
            elif sample.name == "snooze_cold_starts_total" and sample.labels.get("trigger") == "request":
                out["request_loads"] += sample.value
    return out


class Nodes:
    """N `snoozectl serve` nodes over one store (the first publishes the models), and their control APIs."""

    def __init__(self, root: Path, count: int, models_dir: Path) -> None:
        store = root / "store"
        self.nodes = [
            NodeProcess(
                NodeAddress(f"node-{i}", "127.0.0.1", free_port(), free_port(), free_port()),
                root / f"node-{i}",
                store,
                models=models_dir if i == 1 else None,
                no_auth=False,
                env=NODE_ENV,
            )
            for i in range(1, count + 1)
        ]
        self.http = httpx.AsyncClient(headers={"X-API-Key": ADMIN_KEY}, timeout=60)

    @property
    def addresses(self) -> list[NodeAddress]:
        return [n.address for n in self.nodes]

    async def start(self, models: Sequence[str]) -> None:
        self.nodes[0].store.mkdir(parents=True, exist_ok=True)
        first, rest = self.nodes[0], self.nodes[1:]
        first.start()  # it publishes the models into the store, before the others read it
        await first.wait_ready()
        for node in rest:
            node.start()
        await asyncio.gather(*(n.wait_ready() for n in rest))
        deadline = time.monotonic() + 60
        while not all(set(models) <= {m["id"] for m in ms} for ms in (await self.statuses()).values()):
            if time.monotonic() > deadline:
                raise TimeoutError("not every node lists every model of the store after 60 s")
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        await self.http.aclose()
        await asyncio.gather(*(asyncio.to_thread(n.stop, 10) for n in self.nodes))

    async def statuses(self) -> dict[str, list[dict[str, Any]]]:
        answers = await asyncio.gather(*(self.http.get(f"{a.api_url}/v1/models") for a in self.addresses))
        for r in answers:
            r.raise_for_status()
        return {a.name: r.json() for a, r in zip(self.addresses, answers, strict=True)}

    async def holders(self, model: str) -> list[str]:
        return sorted(
            node for node, ms in (await self.statuses()).items() for m in ms
            if m["id"] == model and m["status"]["state"] in HELD
        )  # fmt: skip

    async def counters(self) -> dict[str, dict[str, float]]:
        """Per node: requests that waited for a wake, loads caused by traffic, idle unloads, wake timeouts, and
        the seconds those loads took."""
        answers = await asyncio.gather(*(self.http.get(f"{a.api_url}/metrics") for a in self.addresses))
        return {a.name: _counters(r.text) for a, r in zip(self.addresses, answers, strict=True)}

    async def unload_all(self, timeout: float = 120) -> None:
        """Every node lets every model go (its control API); returns once none holds one."""
        deadline = time.monotonic() + timeout
        by_name = {a.name: a for a in self.addresses}
        while True:
            held = [
                (node, m["id"], m["status"]["state"])
                for node, ms in (await self.statuses()).items()
                for m in ms
                if m["status"]["state"] not in ("unloaded", "failed")
            ]
            if not held:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"models still loaded after {timeout:g}s: {held[:5]}")
            await asyncio.gather(
                *(
                    self.http.post(f"{by_name[node].api_url}/v1/models/{model}/unload")
                    for node, model, state in held
                    if state == "ready"
                )
            )
            await asyncio.sleep(0.2)


@dataclass
class Gateway:
    name: str
    envoy: FleetGateway
    http_port: int
    grpc_port: int

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


async def _start_gateway(root: Path, name: str, nodes: Sequence[NodeAddress]) -> Gateway:
    http_port, grpc_port = free_port(), free_port()
    keys = [ApiKey(API_KEY, "api-0"), ApiKey(ADMIN_KEY, "admin-0")]
    envoy = FleetGateway(
        nodes, root / f"gateway-{name}", host="127.0.0.1", http_port=http_port, grpc_port=grpc_port,
        api_keys=keys, lb_policy=POLICIES[name],
    )  # fmt: skip
    await asyncio.to_thread(envoy.start)
    deadline = time.monotonic() + 30
    wanted = {f"cluster.{c}.membership_healthy" for c in ("nodes_http", "nodes_grpc")}
    while not all(envoy.stats().get(k) == len(nodes) for k in wanted):  # health checks passed: it routes
        if time.monotonic() > deadline:
            raise TimeoutError(f"fleet gateway {name}: the nodes are not all healthy after 30 s")
        await asyncio.sleep(0.2)
    return Gateway(name, envoy, http_port, grpc_port)


@contextlib.asynccontextmanager
async def fleet(
    root: Path, nodes: int, models: Sequence[str], idle_timeout: float
) -> AsyncIterator[tuple[Nodes, dict[str, Gateway]]]:
    package = echo_package(root / "pkg")
    models_dir = root / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    entries = [{"id": m, "path": package, "idle_timeout_secs": idle_timeout} for m in models]
    (models_dir / "models.toml").write_text(models_toml(entries))
    fleet_nodes = Nodes(root, nodes, models_dir)
    gateways: dict[str, Gateway] = {}
    try:
        await fleet_nodes.start(models)
        for name in POLICIES:
            gateways[name] = await _start_gateway(root, name, fleet_nodes.addresses)
        yield fleet_nodes, gateways
    finally:
        for g in gateways.values():
            await asyncio.to_thread(g.envoy.stop)
        await fleet_nodes.stop()
