"""Fleet: model-affine routing against round robin over the same nodes, same run; and the price of the fleet hop.

One set of nodes (each `snoozectl serve`: its own embedded Triton, control plane and node gateway, auth on,
autoscaling off) over one shared model store of M tiny numpy models with a short ``idle_timeout_secs``, so that
scale to zero acts within a phase; two fleet gateways (Envoy) in front of the same nodes: ``affine`` (ring hash
on the model name with bounded load: the fleet's own routing) and ``round_robin`` (every node in turn, whatever
the model).

Traffic: one seeded trace, replayed through each gateway in turn, phases in the order A B B A (A B for one
cycle): Poisson arrivals at a fixed total rate, the model of each request drawn from a Zipf law (s = 1.1) over
the models. Open loop: every request is sent at its time whether or not the ones before it were answered, so
both policies get exactly the same arrivals, and a cold start (which would stall a closed-loop client) cannot
thin out the traffic of the policy that causes more of them. Before each phase every node unloads every model.

Measured per phase: every ``sample_secs``, the loaded model instances and their measured memory (each node's
``/v1/models``: ``instances`` and ``memory_bytes``, the RSS of the model's processes) summed over the nodes;
per request its latency; per node, before and after, ``snooze_wake_waits_total`` (requests that waited for a
model to wake: the cold starts clients see) and ``snooze_cold_starts_total{trigger="request"}`` (loads caused
by traffic).

The hop: one warm model, gRPC and HTTP at concurrency 1 and 8, closed loop, through the affine fleet gateway
vs straight to the gateway of the node that owns the model; cells interleaved and repeated, medians.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench._load import Job, LoadWorker, ReplayJob, percentile
from bench.common import ADMIN_KEY, API_KEY, echo_package, models_toml
from bench.zipf import Zipf
from controlplane.fleet.gateway import FleetGateway, NodeAddress
from controlplane.fleet.up import NodeProcess
from controlplane.gateway.envoy import ApiKey
from controlplane.triton.launcher import free_port

POLICIES = {"affine": "ring_hash", "round_robin": "round_robin"}
ZIPF_S = 1.1
SEED = 10
HELD = ("ready", "unloading")  # states in which a model's processes hold memory
COLD_FLOOR_MS = 100.0  # a request slower than this and than 10x the run's median latency met a cold start
HOP_CONCURRENCY = (1, 8)
NODE_ENV = {
    "SNOOZE_API_KEYS": json.dumps([API_KEY]),
    "SNOOZE_ADMIN_KEYS": json.dumps([ADMIN_KEY]),
    "SNOOZE_AUTOSCALE": "false",  # instance counts move by loads and unloads only
    "SNOOZE_LOG_LEVEL": "warning",
    "SNOOZE_SHUTDOWN_GRACE_SECS": "1",
    "SNOOZE_STORE_POLL_SECS": "0.5",
}


def model_names(count: int) -> list[str]:
    return [f"m{i:02d}" for i in range(count)]


def zipf_trace(
    models: int, rate: float, seconds: float, *, s: float = ZIPF_S, seed: int = SEED
) -> list[tuple[float, int]]:
    """Poisson arrivals at ``rate`` per second for ``seconds``; model i (0: the most requested) drawn with
    probability proportional to 1 / (i + 1)^s."""
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1 / rate, int(rate * seconds * 2) + 20))
    times = times[times < seconds]
    picks = Zipf(models, s).draw(rng, len(times))
    return [(round(float(t), 4), int(m)) for t, m in zip(times, picks, strict=True)]


# ------------------------------------------------------------------------------ the nodes

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


# ------------------------------------------------------------------------------ the phases


async def _sample(nodes: Nodes, start: float, every: float, done: asyncio.Event, out: list[Any], seen: set) -> None:
    """Every ``every`` s: [t, instances, MiB, models held per node]."""
    while not done.is_set():
        t = time.perf_counter() - start
        instances, memory, per_node = 0, 0, []
        for node, ms in (await nodes.statuses()).items():
            held = [m for m in ms if m["status"]["state"] in HELD]
            per_node.append(len(held))
            seen.update((node, m["id"]) for m in held)
            for m in held:
                instances += int(m["status"].get("instances") or 0)
                memory += int(m["status"].get("memory_bytes") or 0)
        out.append([round(t, 2), instances, round(memory / 2**20, 1), per_node])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), max(0.0, every - (time.perf_counter() - start - t)))


async def _phase(
    nodes: Nodes, gateway: Gateway, worker: LoadWorker, models: list[str], trace: list[tuple[float, int]],
    seconds: float, sample_secs: float,
) -> dict[str, Any]:  # fmt: skip
    """One replay of the trace through ``gateway``, sampled until the trace's end or its last answer."""
    await nodes.unload_all()
    before = await nodes.counters()
    samples: list[Any] = []
    seen: set[tuple[str, str]] = set()
    done = asyncio.Event()
    start = time.perf_counter()
    sampler = asyncio.create_task(_sample(nodes, start, sample_secs, done, samples, seen))
    try:
        replay = await worker.replay(
            ReplayJob(target=gateway.grpc, models=models, trace=trace, headers={"x-api-key": API_KEY})
        )
        await asyncio.sleep(max(0.0, seconds - (time.perf_counter() - start)))
    finally:
        done.set()
        await sampler
    after = await nodes.counters()
    return {
        "policy": gateway.name,
        "records": replay["records"],
        "max_late_ms": replay["max_late_ms"],
        "samples": samples,
        "placements": len(seen),
        "counters": {k: round(sum(after[n][k] - before[n][k] for n in after), 3) for k in next(iter(after.values()))},
        "loads_per_node": [int(after[n]["request_loads"] - before[n]["request_loads"]) for n in after],
        "load_average_1m": round(os.getloadavg()[0], 2),  # the machine is shared: other work shows here
    }


def _phase_summary(phase: dict[str, Any], seconds: float, cold_ms: float) -> dict[str, Any]:
    records = phase["records"]
    latencies = sorted(r[2] for r in records if r[2] is not None)
    errors = [r[3] for r in records if r[3] is not None]
    slow = [v for v in latencies if v > cold_ms]  # sorted: the requests that met a cold start
    window = [s for s in phase["samples"] if s[0] <= seconds] or phase["samples"]
    steady = [s for s in window if s[0] >= seconds / 2] or window  # every phase starts empty: the ramp left out
    c = phase["counters"]
    return {
        "policy": phase["policy"],
        "requests": len(records),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "p50_ms": round(percentile(latencies, 50), 2),
        "p99_ms": round(percentile(latencies, 99), 2),
        "max_ms": round(latencies[-1], 1) if latencies else None,
        "client_cold_starts": int(c["wake_waits"]),
        "slow_requests": len(slow),
        "slow_median_ms": round(statistics.median(slow), 1) if slow else None,
        "slow_max_ms": round(slow[-1], 1) if slow else None,
        "loads_per_node": phase["loads_per_node"],
        "request_loads": int(c["request_loads"]),
        "idle_unloads": int(c["idle_unloads"]),
        "wake_timeouts": int(c["wake_timeouts"]),
        "mean_load_s": round(c["load_secs"] / c["request_loads"], 3) if c["request_loads"] else None,
        "placements": phase["placements"],
        "mean_instances": round(statistics.fmean(s[1] for s in window), 2),
        "peak_instances": max(s[1] for s in window),
        "mean_memory_mib": round(statistics.fmean(s[2] for s in window), 1),
        "second_half_mean_instances": round(statistics.fmean(s[1] for s in steady), 2),
        "second_half_mean_memory_mib": round(statistics.fmean(s[2] for s in steady), 1),
        "peak_memory_mib": max(s[2] for s in window),
        "max_client_late_ms": phase["max_late_ms"],
        "load_average_1m": phase["load_average_1m"],
        "samples": [s[:3] for s in phase["samples"]],
        "models_per_node_end": window[-1][3],
    }


def _policy_summary(phases: list[dict[str, Any]], summaries: list[dict[str, Any]], cold_ms: float) -> dict[str, Any]:
    latencies = sorted(r[2] for p in phases for r in p["records"] if r[2] is not None)
    slow = [v for v in latencies if v > cold_ms]
    total = {
        k: sum(s[k] for s in summaries)
        for k in (
            "requests",
            "errors",
            "client_cold_starts",
            "slow_requests",
            "request_loads",
            "idle_unloads",
            "wake_timeouts",
        )
    }
    return {
        "phases": len(summaries),
        **total,
        "p50_ms": round(percentile(latencies, 50), 2),
        "p99_ms": round(percentile(latencies, 99), 2),
        "slow_median_ms": round(statistics.median(slow), 1) if slow else None,
        "slow_max_ms": round(slow[-1], 1) if slow else None,
        "loads_per_node": [sum(col) for col in zip(*(s["loads_per_node"] for s in summaries), strict=True)],
        "mean_instances": round(statistics.fmean(s["mean_instances"] for s in summaries), 2),
        "peak_instances": max(s["peak_instances"] for s in summaries),
        "mean_memory_mib": round(statistics.fmean(s["mean_memory_mib"] for s in summaries), 1),
        "second_half_mean_instances": round(statistics.fmean(s["second_half_mean_instances"] for s in summaries), 2),
        "second_half_mean_memory_mib": round(statistics.fmean(s["second_half_mean_memory_mib"] for s in summaries), 1),
        "peak_memory_mib": max(s["peak_memory_mib"] for s in summaries),
        "placements": max(s["placements"] for s in summaries),
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


# ------------------------------------------------------------------------------ the hop


async def _hop(
    nodes: Nodes, gateway: Gateway, worker: LoadWorker, model: str, *, seconds: float, warmup: float, repeats: int
) -> dict[str, Any]:
    """The same warm model through the fleet gateway and straight to its owner node's gateway."""
    await nodes.unload_all()
    headers = {"x-api-key": API_KEY}
    first = await worker.run(Job("grpc", gateway.grpc, model, 1, 60, max_requests=1, headers=headers))
    if first.errors:
        raise RuntimeError(f"hop: the first request for {model} through the fleet gateway failed: {first.first_error}")
    [owner] = await nodes.holders(model)
    address = next(a for a in nodes.addresses if a.name == owner)
    targets = {
        "fleet": {"grpc": gateway.grpc, "http": gateway.http},
        "node": {"grpc": f"127.0.0.1:{address.grpc_port}", "http": address.http_url},
    }
    for target in targets.values():  # at c=8 the fleet gateway may spill the model onto a second node: loaded here
        await worker.run(Job("grpc", target["grpc"], model, max(HOP_CONCURRENCY), warmup, headers=headers))
    cells: dict[tuple[str, int, str], list[Any]] = {}
    for rep in range(repeats):
        for protocol in ("grpc", "http"):
            for concurrency in HOP_CONCURRENCY:
                order = ("fleet", "node") if rep % 2 == 0 else ("node", "fleet")  # interleaved, alternating
                for name in order:
                    job = Job(protocol, targets[name][protocol], model, concurrency, seconds, headers=headers)
                    cells.setdefault((protocol, concurrency, name), []).append(await worker.run(job))
    holders = await nodes.holders(model)
    rows = []
    for (protocol, concurrency, name), results in cells.items():
        rows.append({
            "protocol": protocol,
            "concurrency": concurrency,
            "target": name,
            "rps": round(statistics.median(r.rps for r in results), 1),
            "p50_ms": round(statistics.median(r.p50_ms for r in results), 3),
            "p99_ms": round(statistics.median(r.p99_ms for r in results), 3),
            "errors": sum(r.errors for r in results),
            "first_error": next((r.first_error for r in results if r.first_error), None),
        })  # fmt: skip
    by = {(r["protocol"], r["concurrency"], r["target"]): r for r in rows}
    ratios = {}
    for protocol in ("grpc", "http"):
        for c in HOP_CONCURRENCY:
            f, n = by[(protocol, c, "fleet")], by[(protocol, c, "node")]
            ratios[f"{protocol}_c{c}"] = {
                "added_p50_ms": round(f["p50_ms"] - n["p50_ms"], 3),
                "added_p99_ms": round(f["p99_ms"] - n["p99_ms"], 3),
                "throughput_fleet_vs_node": _ratio(f["rps"], n["rps"]),
            }
    return {
        "model": model,
        "owner": owner,
        "holders_after": holders,
        "settings": {
            "seconds": seconds,
            "warmup_secs": warmup,
            "repeats": repeats,
            "concurrency": list(HOP_CONCURRENCY),
        },
        "rows": rows,
        "ratios": ratios,
    }


# ------------------------------------------------------------------------------ the section


def _order(cycles: int) -> list[str]:
    """A B, B A, A B, ...: each policy as often first as second (drift in the machine's load cancels)."""
    a, b = list(POLICIES)
    return [p for c in range(cycles) for p in ((a, b) if c % 2 == 0 else (b, a))]


async def run(
    root: Path, *, nodes: int, models: int, idle_timeout: float, rate: float, seconds: float, cycles: int,
    sample_secs: float, hop_seconds: float, hop_warmup: float, hop_repeats: int,
) -> dict[str, Any]:  # fmt: skip
    names = model_names(models)
    trace = zipf_trace(models, rate, seconds)
    load_start = [round(v, 2) for v in os.getloadavg()]
    phases: list[dict[str, Any]] = []
    started = time.perf_counter()
    async with fleet(root, nodes, names, idle_timeout) as (fleet_nodes, gateways), LoadWorker() as worker:
        startup_s = time.perf_counter() - started
        for policy in _order(cycles):
            phases.append(await _phase(fleet_nodes, gateways[policy], worker, names, trace, seconds, sample_secs))
        hop = await _hop(
            fleet_nodes, gateways["affine"], worker, names[0], seconds=hop_seconds, warmup=hop_warmup,
            repeats=hop_repeats,
        )  # fmt: skip
    warm = sorted(r[2] for p in phases for r in p["records"] if r[2] is not None)
    cold_ms = max(COLD_FLOOR_MS, 10 * percentile(warm, 50)) if warm else COLD_FLOOR_MS
    summaries = [_phase_summary(p, seconds, cold_ms) for p in phases]
    policies = {
        name: _policy_summary(
            [p for p in phases if p["policy"] == name], [s for s in summaries if s["policy"] == name], cold_ms
        )
        for name in POLICIES
    }
    a, r = policies["affine"], policies["round_robin"]
    per_model = [sum(1 for _, m in trace if m == i) for i in range(models)]
    return {
        "settings": {
            "nodes": nodes,
            "models": models,
            "model": "numpy y = 2x, one 1x4 FP32 row per request (bench echo package), 1 instance",
            "idle_timeout_secs": idle_timeout,
            "zipf_s": ZIPF_S,
            "rate_rps": rate,
            "seconds": seconds,
            "cycles": cycles,
            "order": _order(cycles),
            "seed": SEED,
            "sample_interval_secs": sample_secs,
            "traffic": "open loop, Poisson arrivals, gRPC, load generator in its own process",
            "trace_requests": len(trace),
            "requests_per_model": per_model,
            "cold_threshold_ms": round(cold_ms, 1),
            "hash_balance_factor": 150,
            "startup_s": round(startup_s, 1),
        },
        "load_average_start": load_start,
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "phases": summaries,
        "policies": policies,
        "ratios": {
            "mean_memory_affine_vs_rr": _ratio(a["mean_memory_mib"], r["mean_memory_mib"]),
            "peak_memory_affine_vs_rr": _ratio(a["peak_memory_mib"], r["peak_memory_mib"]),
            "mean_instances_affine_vs_rr": _ratio(a["mean_instances"], r["mean_instances"]),
            "second_half_memory_affine_vs_rr": _ratio(
                a["second_half_mean_memory_mib"], r["second_half_mean_memory_mib"]
            ),
            "client_cold_starts_affine_vs_rr": _ratio(a["client_cold_starts"], r["client_cold_starts"]),
            "p99_affine_vs_rr": _ratio(a["p99_ms"], r["p99_ms"]),
        },
        "hop": hop,
    }
