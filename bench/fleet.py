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
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench._load import Job, LoadWorker, ReplayJob, percentile
from bench.common import API_KEY
from bench.fleet_nodes import HELD, POLICIES, Gateway, Nodes, fleet
from bench.zipf import Zipf

ZIPF_S = 1.1
SEED = 10
COLD_FLOOR_MS = 100.0  # a request slower than this and than 10x the run's median latency met a cold start
HOP_CONCURRENCY = (1, 8)


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
