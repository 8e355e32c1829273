"""What each gateway filter costs a warm unary request: the gateway as served, the gateway without each filter in
turn, a bare Envoy router (no filter but the router) and direct Triton, interleaved in one run.

For each (protocol, concurrency), every round measures every target for a short slice, the targets' order rotating
from round to round, so a burst of load from the machine's other users lands on different targets and the bare hop
is measured within seconds of each variant; the table takes medians over rounds of per-round numbers (throughput
over the bare hop of the same round, p50 over direct of the same round).
The variants are extra Envoy processes in front of the same Triton and activator, each the served gateway's
bootstrap less one part (``bench/gateway_variants.py``), with its keys (``no_auth``, ``no_filters``: without keys).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from bench._load import AlternatingJob, Job, LoadWorker
from bench.common import API_KEY, direct_urls, echo_package, fp32, gateway_urls, serving_stack, write_package
from bench.gateway_variants import (
    KEYLESS_VARIANTS,
    VARIANTS,
    Bootstrap,
    check_variants,
    variant_bootstraps,
    with_grpc_retry_buffer,
)
from bench.reference_envoys import bare_envoy_bootstrap
from controlplane.gateway.envoy import GRPC_RETRY_BUFFER_BYTES, Upstream, gateway_keys, render_bootstrap
from controlplane.gateway.envoy_process import EnvoyProcess
from controlplane.gateway.wake_lua import ready_dir_path
from controlplane.triton.journal import REQUEST_ID_HEADER
from controlplane.triton.launcher import free_port

MODEL = "bench-echo"
CONCURRENCY = (1, 32)
PROTOCOLS = ("grpc", "http")
# A warm large gRPC request: what the copy Envoy keeps for the retry costs it, against the same gateway whose gRPC
# retry buffer is HTTP's (a request over it is not kept, so not copied: no wake for it either) and direct Triton.
SINK = "bench-sink"
SINK_PY = """
import numpy as np


class Model:
    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        x = inputs["x"]
        return {"y": np.zeros((x.shape[0], 4), np.float32) + x[:, :1]}
"""
LARGE_FLOATS = 8 * 1024 * 1024  # 32 MiB of FP32
LARGE_TARGETS = ("direct", "gateway_large", "gateway_large_no_copy")


async def run(
    root: Path,
    *,
    seconds: float,
    warmup: float,
    rounds: int,
    variants: tuple[str, ...] = VARIANTS,
    twin: bool = False,
    large_requests: bool = True,
    direct_with_id: bool = False,
    bare_auth: bool = False,
    restart_every: int | None = None,
) -> dict[str, Any]:
    """``variants``: the filters left out in turn (``VARIANTS`` or a subset); ``twin``: a second Envoy with the
    served gateway's own bootstrap (its distance from the gateway is this run's noise); ``large_requests``: the
    warm 32 MiB gRPC comparison; ``direct_with_id``: direct Triton again, the client sending the gateway's
    request-id header itself (what Triton and the stub spend on it); ``bare_auth``: the bare hop with Envoy's API
    key check too (the reference for the gateway with keys, which the keyless bare hop is not); ``restart_every``:
    every Envoy of the run (the served gateway too) is restarted after that many cycles, so that what one process
    keeps for its life (its upstream connections, where its threads run) is one block's luck, not a target's.
    Each round is one cycle of ``seconds`` per target, in turn (``AlternatingJob``), ``warmup`` once per target
    first. ``python -m bench --only gateway_targets`` runs the issue's check alone (direct, the bare hops, the
    gateway with and without keys and its twin, over many rounds), ``--only gateway_routes`` the route variants."""
    check_variants(variants)
    pkg = echo_package(root / "pkg" / MODEL)
    sink = write_package(root / "pkg" / SINK, SINK_PY, [fp32("x", -1)], [fp32("y", 4)])
    entries = [
        {"id": MODEL, "path": pkg, "max_batch_size": 8, "idle_timeout_secs": 3600},
        {"id": SINK, "path": sink, "max_batch_size": 8, "idle_timeout_secs": 3600},
    ]
    load_start = [round(v, 2) for v in os.getloadavg()]
    async with serving_stack(root / "stack", entries) as stack:
        await stack.lifecycle.ensure_ready(MODEL)
        await stack.lifecycle.ensure_ready(SINK)
        triton = {p: Upstream.parse(u) for p, u in direct_urls(stack).items()}
        processes: dict[str, EnvoyProcess] = {}
        urls: dict[str, dict[str, str]] = {
            "direct": direct_urls(stack), "direct_with_id": direct_urls(stack), "gateway": gateway_urls(stack)
        }  # fmt: skip
        bootstrap_of = _served(stack, triton)
        envoys = {**_bare_bootstraps(triton, bare_auth), **variant_bootstraps(bootstrap_of, variants, twin=twin)}
        if large_requests:
            envoys.update(_large_bootstraps(bootstrap_of, stack.settings.wake_buffer_bytes))
        for name, bootstrap in envoys.items():
            ports = free_port(), free_port()
            processes[name] = EnvoyProcess(
                bootstrap(ports), root / name, listen=[("127.0.0.1", p) for p in ports], name=name
            )
            urls[name] = {"http": f"http://127.0.0.1:{ports[0]}", "grpc": f"127.0.0.1:{ports[1]}"}
        targets = [
            "direct",
            *(["direct_with_id"] if direct_with_id else []),
            "bare_envoy",
            *(["bare_envoy_auth"] if bare_auth else []),
            "gateway",
            *(["gateway_twin"] if twin else []),
            *(f"gateway_{v}" for v in variants),
        ]
        try:
            for process in processes.values():
                process.start()
            async with LoadWorker() as worker:
                runs, lua_during, restarts = await _rounds(
                    worker, stack, processes, urls, targets, rounds=rounds, block=restart_every or rounds,
                    seconds=seconds, warmup=warmup,
                )  # fmt: skip
                large = await _large(worker, urls, rounds if large_requests else 0, seconds, warmup)
        finally:
            for process in processes.values():
                process.stop()
    return {
        "model": f"{MODEL}: numpy y = 2x, one 1x4 FP32 row per request, max_batch_size 8, 1 instance",
        "settings": {
            "seconds": seconds,
            "warmup_secs": warmup,
            "rounds": rounds,
            "concurrency": list(CONCURRENCY),
            "envoy_concurrency": 2,
            "restart_every": restart_every,
            "envoy_restarts": restarts,
            "slice_warmup_secs": AlternatingJob.slice_warmup_secs,
            "client": "grpc.aio (raw ModelInferRequest bytes) / aiohttp, in a separate process",
        },
        "targets": targets,
        "load_average": {"start": load_start, "end": [round(v, 2) for v in os.getloadavg()]},
        "gateway_lua_executions": lua_during,  # the served gateway's Lua runs over all its warm requests
        "runs": runs,
        "table": _table(runs, targets, rounds),
        "large": _large_summary(large) if large_requests else None,
    }


def _served(stack: Any, triton: dict[str, Upstream]) -> Callable[..., str]:
    """The served gateway's bootstrap for other ports (``keys``: with the stack's API keys), as production renders."""

    def bootstrap_of(ports: tuple[int, int], *, keys: bool = True) -> str:
        return render_bootstrap(
            host="127.0.0.1",
            http_port=ports[0],
            grpc_port=ports[1],
            admin_port=0,
            triton_http=triton["http"],
            triton_grpc=triton["grpc"],
            activator_http=Upstream.parse(stack.activator.http_address),
            activator_grpc=Upstream.parse(stack.activator.grpc_address),
            wake_buffer_bytes=stack.settings.wake_buffer_bytes,
            api_keys=gateway_keys(stack.settings) if keys else [],
            ready_dir=ready_dir_path(stack.settings),
        )

    return bootstrap_of


async def _rounds(
    worker: LoadWorker,
    stack: Any,
    processes: dict[str, EnvoyProcess],
    urls: dict[str, dict[str, str]],
    targets: list[str],
    *,
    rounds: int,
    block: int,
    seconds: float,
    warmup: float,
) -> tuple[list[dict[str, Any]], int, int]:
    """Every (protocol, concurrency) over ``rounds`` cycles, every Envoy restarted after each ``block`` of them:
    the per-round records, the served gateway's Lua runs over them, and the restarts."""
    runs: list[dict[str, Any]] = []
    lua_before, lua_during, restarts = _lua_executions(stack.gateway.stats()), 0, 0
    for protocol in PROTOCOLS:
        for concurrency in CONCURRENCY:
            for first in range(0, rounds, block):
                if first:  # every Envoy of the run, the served gateway too, as a new process
                    lua_during += _lua_executions(stack.gateway.stats()) - lua_before
                    for process in (stack.gateway, *processes.values()):
                        process.stop()
                        process.start()
                    lua_before = _lua_executions(stack.gateway.stats())
                    restarts += 1
                runs += await _alternating(
                    worker, stack, processes, urls, targets, protocol, concurrency,
                    range(first, min(rounds, first + block)), seconds, warmup,
                )  # fmt: skip
    lua_during += _lua_executions(stack.gateway.stats()) - lua_before
    return runs, lua_during, restarts


async def _large(
    worker: LoadWorker, urls: dict[str, dict[str, str]], rounds: int, seconds: float, warmup: float
) -> list[dict[str, Any]]:
    """A warm 32 MiB gRPC request per round to each large target, the order rotating."""
    large = []
    for r in range(rounds):
        for name in LARGE_TARGETS[r % 3 :] + LARGE_TARGETS[: r % 3]:
            job = Job(
                "grpc",
                urls[name]["grpc"],
                SINK,
                1,
                seconds * 2,
                shape=[1, LARGE_FLOATS],
                headers={} if name == "direct" else {"x-api-key": API_KEY},
                warmup_secs=warmup,
            )
            result = await worker.run(job)
            large.append({"round": r, "target": name, "p50_ms": result.p50_ms, "errors": result.errors})
    return large


async def _alternating(
    worker: LoadWorker,
    stack: Any,
    processes: dict[str, EnvoyProcess],
    urls: dict[str, dict[str, str]],
    targets: list[str],
    protocol: str,
    concurrency: int,
    cycles: range,
    slice_secs: float,
    warmup: float,
) -> list[dict[str, Any]]:
    """One ``AlternatingJob`` over every target for ``cycles`` (the rounds' numbers); its slices as ``run``'s
    per-round records. CPU per request: the client's own count of successful requests in the slice."""
    triton = stack.triton_process.pid if stack.triton_process else None
    triton_pids = [triton, *(c.pid for c in psutil.Process(triton).children(recursive=True))] if triton else []
    cpu_pids: dict[str, dict[str, list[int]]] = {}
    for name in targets:
        envoy = stack.gateway if name == "gateway" else processes.get(name)
        cpu_pids[name] = {"triton": triton_pids, **({"envoy": [envoy.pid]} if envoy and envoy.pid else {})}
    job = AlternatingJob(
        protocol,
        {name: urls[name][protocol] for name in targets},
        MODEL,
        concurrency,
        slice_secs,
        len(cycles),
        headers={name: _headers(name) for name in targets},
        cpu_pids=cpu_pids,
        warmup_secs=warmup,
        first_cycle=cycles.start,
    )
    answer = await worker.alternate(job)
    out = [{"round": x.pop("cycle"), "protocol": protocol, "concurrency": concurrency, **x} for x in answer["slices"]]
    out[-1]["load_average"] = [round(v, 2) for v in os.getloadavg()]
    return out


def cpu_seconds(pid: int, *, tree: bool) -> float:
    """User and system CPU seconds of a process (and, with ``tree``, its live descendants)."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)] if tree else [proc]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def _bare_bootstraps(triton: dict[str, Upstream], with_key: bool) -> dict[str, Bootstrap]:
    """The bare hop, and with ``with_key`` the bare hop that checks the gateway's API key too."""

    def bare(ports: tuple[int, int], key: str | None = None) -> str:
        return bare_envoy_bootstrap(
            http_port=ports[0],
            grpc_port=ports[1],
            triton_http=(triton["http"].host, triton["http"].port),
            triton_grpc=(triton["grpc"].host, triton["grpc"].port),
            key=key,
        )

    out: dict[str, Bootstrap] = {"bare_envoy": bare}
    if with_key:
        out["bare_envoy_auth"] = lambda ports: bare(ports, API_KEY)
    return out


def _large_bootstraps(bootstrap_of: Callable[..., str], http_buffer: int) -> dict[str, Bootstrap]:
    """The served gateway (its gRPC retry keeps any message) and the same with HTTP's retry buffer for gRPC."""

    def no_copy(ports: tuple[int, int]) -> str:
        return with_grpc_retry_buffer(bootstrap_of(ports), http_buffer, served=GRPC_RETRY_BUFFER_BYTES)

    return {"gateway_large": bootstrap_of, "gateway_large_no_copy": no_copy}


# Rendered without keys (as ``make serve`` runs the gateway, --no-auth): their clients send none either.
KEYLESS = ("direct", "bare_envoy", *(f"gateway_{v}" for v in KEYLESS_VARIANTS))  # bare_envoy_auth: sent the key


def _headers(target: str) -> dict[str, str]:
    if target == "direct_with_id":
        return {REQUEST_ID_HEADER: "bench-request-id"}
    return {} if target in KEYLESS else {"x-api-key": API_KEY}


def _large_summary(large: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "request_mib": LARGE_FLOATS * 4 / 2**20,
        "runs": large,
        "p50_ms": {
            t: round(statistics.median(x["p50_ms"] for x in large if x["target"] == t), 2) for t in LARGE_TARGETS
        },
        "errors": {t: sum(x["errors"] for x in large if x["target"] == t) for t in LARGE_TARGETS},
    }


def _lua_executions(stats: dict[str, int]) -> int:
    return sum(v for k, v in stats.items() if k.endswith("lua.executions"))


def median_ci95(values: list[float]) -> list[float]:
    """A distribution-free 95 % confidence interval of the median: the order statistics n/2 -+ 0.98 sqrt(n)
    (the binomial's normal approximation); the whole range when there are too few values for one."""
    xs = sorted(values)
    n = len(xs)
    half = 0.98 * n**0.5
    lo, hi = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half))
    return [round(xs[lo], 3), round(xs[hi], 3)]


def _table(runs: list[dict[str, Any]], targets: list[str], rounds: int) -> list[dict[str, Any]]:
    """Per protocol and target: median c=32 rps, its median per-round ratio to the bare hop, and the median
    per-round c=1 p50 added over direct."""
    by = {(x["round"], x["protocol"], x["concurrency"], x["target"]): x for x in runs}
    rows = []
    for protocol in PROTOCOLS:
        for target in targets:
            c32 = [by[(r, protocol, 32, target)] for r in range(rounds)]
            ratio = [x["rps"] / by[(r, protocol, 32, "bare_envoy")]["rps"] for r, x in enumerate(c32)]
            # against the bare hop with the same key check, where the run has it (the gateway with keys)
            keyed = [x["rps"] / by[(r, protocol, 32, "bare_envoy_auth")]["rps"] for r, x in enumerate(c32)
                     if (r, protocol, 32, "bare_envoy_auth") in by]  # fmt: skip
            keyed_added = [
                by[(r, protocol, 1, target)]["p50_ms"] - by[(r, protocol, 1, "bare_envoy_auth")]["p50_ms"]
                for r in range(rounds)
                if (r, protocol, 1, "bare_envoy_auth") in by
            ]
            added = [
                by[(r, protocol, 1, target)]["p50_ms"] - by[(r, protocol, 1, "direct")]["p50_ms"] for r in range(rounds)
            ]
            quartiles = statistics.quantiles(ratio, n=4) if len(ratio) > 1 else [ratio[0]] * 3
            rows.append(
                {
                    "protocol": protocol,
                    "target": target,
                    "c32_rps": round(statistics.median(x["rps"] for x in c32), 1),
                    "c32_vs_bare_envoy": round(statistics.median(ratio), 3),
                    "c32_vs_bare_envoy_iqr": [round(quartiles[0], 3), round(quartiles[2], 3)],
                    "c32_vs_bare_envoy_ci95": median_ci95(ratio),
                    "c1_p50_ms": round(
                        statistics.median(by[(r, protocol, 1, target)]["p50_ms"] for r in range(rounds)), 3
                    ),
                    "c1_added_p50_ms": round(statistics.median(added), 3),
                    **(
                        {
                            "c32_vs_bare_envoy_auth": round(statistics.median(keyed), 3),
                            "c1_p50_over_bare_envoy_auth_ms": round(statistics.median(keyed_added), 3),
                        }
                        if keyed
                        else {}
                    ),
                    "errors": sum(by[(r, protocol, c, target)]["errors"] for r in range(rounds) for c in CONCURRENCY),
                    # CPU per request at c=32, by part (median over rounds): what the throughput is made of
                    "c32_cpu_us": {
                        part: round(statistics.median(x[f"{part}_cpu_us"] for x in c32 if f"{part}_cpu_us" in x), 1)
                        for part in ("envoy", "triton", "client")
                        if any(f"{part}_cpu_us" in x for x in c32)
                    },
                }
            )
    return rows
