"""Gateway overhead: direct Triton vs a bare Envoy hop vs the snoozeml gateway, HTTP and gRPC,
concurrency 1, 8 and 32, against one warm model, plus the load generator's own ceiling (Envoy answering
by itself), all in the same run.

The snoozeml gateway runs as served: auth on (the key is sent), wake-by-retry routes, the activator
behind it (never reached here: the model is warm; the retry counter proves it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench._load import Job, LoadWorker
from bench.common import API_KEY, direct_urls, echo_package, gateway_urls, serving_stack
from bench.reference_envoys import bare_envoy_bootstrap, ceiling_bootstrap
from controlplane.gateway.envoy import Upstream
from controlplane.gateway.envoy_process import EnvoyProcess
from controlplane.triton.launcher import free_port

MODEL = "bench-echo"
TARGETS = ("direct", "bare_envoy", "gateway", "client_ceiling")
CONCURRENCY = (1, 8, 32)
CLIENT_BOUND = 0.7  # direct reaching this share of the client's ceiling: the client, not Triton, limits


async def run(root: Path, *, seconds: float, warmup: float) -> dict[str, Any]:
    pkg = echo_package(root / "pkg" / MODEL)
    entries = [{"id": MODEL, "path": pkg, "max_batch_size": 8, "idle_timeout_secs": 3600}]
    async with serving_stack(root / "stack", entries) as stack:
        await stack.lifecycle.ensure_ready(MODEL)
        t_http, t_grpc = (Upstream.parse(u) for u in (stack.triton_process.http_url, stack.triton_process.grpc_url))
        ports = {n: (free_port(), free_port()) for n in ("bare", "ceiling")}
        bare = EnvoyProcess(
            bare_envoy_bootstrap(
                http_port=ports["bare"][0],
                grpc_port=ports["bare"][1],
                triton_http=(t_http.host, t_http.port),
                triton_grpc=(t_grpc.host, t_grpc.port),
            ),
            root / "bare_envoy",
            listen=[("127.0.0.1", p) for p in ports["bare"]],
            name="bare",
        )
        ceiling = EnvoyProcess(
            ceiling_bootstrap(http_port=ports["ceiling"][0], grpc_port=ports["ceiling"][1]),
            root / "ceiling_envoy",
            listen=[("127.0.0.1", p) for p in ports["ceiling"]],
            name="ceiling",
        )
        bare.start()
        ceiling.start()
        try:
            targets = {
                "direct": direct_urls(stack),
                "bare_envoy": {"http": f"http://127.0.0.1:{ports['bare'][0]}", "grpc": f"127.0.0.1:{ports['bare'][1]}"},
                "gateway": gateway_urls(stack),
                "client_ceiling": {
                    "http": f"http://127.0.0.1:{ports['ceiling'][0]}",
                    "grpc": f"127.0.0.1:{ports['ceiling'][1]}",
                },
            }
            retries_before = _retries(stack)
            rows = []
            async with LoadWorker() as worker:
                for protocol in ("grpc", "http"):
                    for concurrency in CONCURRENCY:
                        results = {}
                        for name in TARGETS:
                            headers = {"x-api-key": API_KEY} if name == "gateway" else {}
                            job = Job(
                                protocol,
                                targets[name][protocol],
                                MODEL,
                                concurrency,
                                seconds,
                                headers=headers,
                                warmup_secs=warmup,
                            )
                            results[name] = await worker.run(job)
                        rows += _rows(protocol, concurrency, results)
            retries = _retries(stack) - retries_before
        finally:
            bare.stop()
            ceiling.stop()
    return {
        "model": f"{MODEL}: numpy y = 2x, one 1x4 FP32 row per request, max_batch_size 8, 1 instance",
        "settings": {
            "seconds": seconds,
            "warmup_secs": warmup,
            "concurrency": list(CONCURRENCY),
            "envoy_concurrency": 2,
            "client": "grpc.aio / aiohttp in a separate process",
        },
        "gateway_retries_during_run": retries,
        "rows": rows,
        "ratios": _ratios(rows),
    }


def _retries(stack: Any) -> int:
    stats = stack.gateway.stats()
    return int(sum(v for k, v in stats.items() if k.endswith("upstream_rq_retry")))


def _rows(protocol: str, concurrency: int, results: dict[str, Any]) -> list[dict[str, Any]]:
    base, ceiling = results["direct"], results["client_ceiling"]
    rows = []
    for name, r in results.items():
        rows.append(
            {
                "protocol": protocol,
                "concurrency": concurrency,
                "target": name,
                "requests": r.requests,
                "errors": r.errors,
                "first_error": r.first_error,
                "rps": round(r.rps, 1),
                "throughput_vs_direct": round(r.rps / base.rps, 3) if base.rps else None,
                "share_of_client_ceiling": round(r.rps / ceiling.rps, 3) if ceiling.rps else None,
                "p50_ms": r.p50_ms,
                "p99_ms": r.p99_ms,
                "added_p50_ms": round(r.p50_ms - base.p50_ms, 3),
                "added_p99_ms": round(r.p99_ms - base.p99_ms, 3),
            }
        )
    return rows


def _ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per protocol and concurrency: gateway/direct, bare/direct, gateway/bare, and whether the client limits."""
    out: dict[str, Any] = {}
    by = {(r["protocol"], r["concurrency"], r["target"]): r for r in rows}
    for protocol, concurrency, _ in by:
        key = f"{protocol}_c{concurrency}"
        if key in out:
            continue
        d, b, g = (by[(protocol, concurrency, t)] for t in ("direct", "bare_envoy", "gateway"))
        out[key] = {
            "gateway_vs_direct": g["throughput_vs_direct"],
            "bare_envoy_vs_direct": b["throughput_vs_direct"],
            "gateway_vs_bare_envoy": round(g["rps"] / b["rps"], 3) if b["rps"] else None,
            "gateway_added_p50_ms": g["added_p50_ms"],
            "bare_envoy_added_p50_ms": b["added_p50_ms"],
            "direct_share_of_client_ceiling": d["share_of_client_ceiling"],
            "client_bound": bool(d["share_of_client_ceiling"] and d["share_of_client_ceiling"] >= CLIENT_BOUND),
        }
    return out
