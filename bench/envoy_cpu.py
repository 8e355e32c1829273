"""What each Envoy configuration costs a warm unary request in Envoy's own CPU, with Triton taken out.

The bare hop, the gateway as served, and the gateway less each filter (``gateway_filters.VARIANTS``) or each
part of its routes (``gateway_filters.ROUTE_EDITS``), all in front of one more Envoy that answers every request
itself (``ceiling_bootstrap``: no Triton, no model, an HTTP 200 or a trailers-only gRPC OK). Only the Envoy under
test differs between targets. The number is its CPU time (user + system, /proc) over its own count of downstream
requests, per round, median over interleaved rounds at one concurrency. No throughput: the CPU a request takes moves
far less with the machine's other work than what a slice of wall time serves. The activator is not reached (the
answer is never a 404), so no serving stack is started.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from bench._load import Job, LoadWorker, bare_envoy_bootstrap, ceiling_bootstrap
from bench.common import API_KEY
from bench.gateway_filters import (
    MODEL,
    PROTOCOLS,
    ROUTE_EDITS,
    VARIANTS,
    Bootstrap,
    cpu_seconds,
    variant_bootstraps,
)
from controlplane.gateway.envoy import ApiKey, EnvoyProcess, Upstream, render_bootstrap
from controlplane.triton.launcher import free_port

WAKE_BUFFER = 8 * 1024 * 1024  # the served default (SNOOZE_WAKE_BUFFER_BYTES)


async def run(
    root: Path, *, seconds: float, rounds: int, concurrency: int, variants: tuple[str, ...] = (*VARIANTS, *ROUTE_EDITS)
) -> dict[str, Any]:
    """``variants``: the filters or route parts left out in turn (``gateway_filters.VARIANTS``, ``ROUTE_EDITS``)."""
    ports = free_port(), free_port()
    upstream = EnvoyProcess(
        ceiling_bootstrap(http_port=ports[0], grpc_port=ports[1]),
        root / "upstream",
        listen=[("127.0.0.1", p) for p in ports],
        name="upstream",
    )
    http, grpc = Upstream("127.0.0.1", ports[0]), Upstream("127.0.0.1", ports[1])

    def bootstrap_of(ports: tuple[int, int], *, keys: bool = True, omit: Any = ()) -> str:
        return render_bootstrap(
            host="127.0.0.1", http_port=ports[0], grpc_port=ports[1], admin_port=0,
            triton_http=http, triton_grpc=grpc, activator_http=http, activator_grpc=grpc,
            wake_buffer_bytes=WAKE_BUFFER, api_keys=[ApiKey(API_KEY, "bench")] if keys else [], omit=omit,
        )  # fmt: skip

    def bare(ports: tuple[int, int]) -> str:
        return bare_envoy_bootstrap(
            http_port=ports[0],
            grpc_port=ports[1],
            triton_http=(http.host, http.port),
            triton_grpc=(grpc.host, grpc.port),
        )

    bootstraps: dict[str, Bootstrap] = {
        "bare_envoy": bare,
        "gateway": bootstrap_of,
        **variant_bootstraps(bootstrap_of, variants, twin=True),
    }
    processes: dict[str, EnvoyProcess] = {}
    urls: dict[str, dict[str, str]] = {}
    for name, bootstrap in bootstraps.items():
        p = free_port(), free_port()
        processes[name] = EnvoyProcess(bootstrap(p), root / name, listen=[("127.0.0.1", x) for x in p], name=name)
        urls[name] = {"http": f"http://127.0.0.1:{p[0]}", "grpc": f"127.0.0.1:{p[1]}"}
    targets = list(bootstraps)
    load_start = [round(v, 2) for v in os.getloadavg()]
    runs: list[dict[str, Any]] = []
    try:
        upstream.start()
        for process in processes.values():
            process.start()
        async with LoadWorker() as worker:
            for protocol in PROTOCOLS:
                for r in range(rounds):
                    for name in targets[r % len(targets) :] + targets[: r % len(targets)]:
                        envoy = processes[name]
                        assert envoy.pid is not None
                        before = cpu_seconds(envoy.pid, tree=False), _downstream_requests(envoy)
                        job = Job(protocol, urls[name][protocol], MODEL, concurrency, seconds, headers=_headers(name))
                        result = await worker.run(job)
                        cpu, requests = cpu_seconds(envoy.pid, tree=False), _downstream_requests(envoy)
                        served = requests - before[1]
                        runs.append(
                            {
                                "round": r,
                                "protocol": protocol,
                                "target": name,
                                "requests": served,
                                "envoy_cpu_us": round((cpu - before[0]) / served * 1e6, 2) if served else None,
                                "client_errors": result.errors,
                            }
                        )
    finally:
        for process in (*processes.values(), upstream):
            process.stop()
    return {
        "settings": {"seconds": seconds, "rounds": rounds, "concurrency": concurrency, "envoy_concurrency": 2},
        "targets": targets,
        "load_average": {"start": load_start, "end": [round(v, 2) for v in os.getloadavg()]},
        "runs": runs,
        "table": _table(runs, targets),
    }


def _headers(target: str) -> dict[str, str]:
    return {} if target == "bare_envoy" else {"x-api-key": API_KEY}


def _downstream_requests(envoy: EnvoyProcess) -> int:
    """Requests this Envoy's listeners took (every HTTP connection manager's ``downstream_rq_total``)."""
    return sum(v for k, v in envoy.stats().items() if k.startswith("http.") and k.endswith(".downstream_rq_total"))


def _table(runs: list[dict[str, Any]], targets: list[str]) -> list[dict[str, Any]]:
    """Per protocol and target: median Envoy CPU µs per request, and its median per-round excess over the bare hop
    of the same round."""
    by = {(x["round"], x["protocol"], x["target"]): x["envoy_cpu_us"] for x in runs}
    rows = []
    for protocol in PROTOCOLS:
        rounds = sorted({r for (r, p, _t) in by if p == protocol})
        for target in targets:
            own = [by[(r, protocol, target)] for r in rounds if by[(r, protocol, target)] is not None]
            over = [
                by[(r, protocol, target)] - by[(r, protocol, "bare_envoy")]
                for r in rounds
                if by[(r, protocol, target)] is not None and by[(r, protocol, "bare_envoy")] is not None
            ]
            rows.append(
                {
                    "protocol": protocol,
                    "target": target,
                    "envoy_cpu_us": round(statistics.median(own), 2) if own else None,
                    "over_bare_us": round(statistics.median(over), 2) if over else None,
                    "over_bare_iqr_us": [round(q, 2) for q in statistics.quantiles(over, n=4)[::2]]
                    if len(over) > 1
                    else None,
                }
            )
    return rows

