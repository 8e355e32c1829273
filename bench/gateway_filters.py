"""What each gateway filter costs a warm unary request: the gateway as served, the gateway without each filter in
turn, a bare Envoy router (no filter but the router) and direct Triton, interleaved in one run.

For each (protocol, concurrency), every round measures every target for a short slice, the targets' order rotating
from round to round, so a burst of load from the machine's other users lands on different targets and the bare hop
is measured within seconds of each variant; the table takes medians over rounds of per-round numbers (throughput
over the bare hop of the same round, p50 over direct of the same round).
The variants are extra Envoy processes rendered by ``render_bootstrap(omit=...)`` in front of the same Triton and
activator, with the served gateway's keys (``no_auth``, ``no_filters``: rendered without keys).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from bench._load import Job, LoadWorker, bare_envoy_bootstrap
from bench.common import API_KEY, direct_urls, echo_package, fp32, gateway_urls, serving_stack, write_package
from controlplane.gateway.envoy import (
    GRPC_RETRY_BUFFER_BYTES,
    OPTIONAL_FILTERS,
    EnvoyProcess,
    Upstream,
    gateway_keys,
    ready_dir_path,
    render_bootstrap,
)
from controlplane.triton.launcher import free_port

MODEL = "bench-echo"
CONCURRENCY = (1, 32)
PROTOCOLS = ("grpc", "http")
# Each filter left out in turn; "no_filters": none of them (what the routes alone cost: retry, gate, request id).
VARIANTS = ("no_auth", *(f"no_{name}" for name in OPTIONAL_FILTERS), "no_filters")
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


async def run(root: Path, *, seconds: float, warmup: float, rounds: int) -> dict[str, Any]:
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
        urls: dict[str, dict[str, str]] = {"direct": direct_urls(stack), "gateway": gateway_urls(stack)}
        ports = free_port(), free_port()
        processes["bare_envoy"] = EnvoyProcess(
            bare_envoy_bootstrap(
                http_port=ports[0],
                grpc_port=ports[1],
                triton_http=(triton["http"].host, triton["http"].port),
                triton_grpc=(triton["grpc"].host, triton["grpc"].port),
            ),
            root / "bare_envoy",
            listen=[("127.0.0.1", p) for p in ports],
            name="bare",
        )
        urls["bare_envoy"] = {"http": f"http://127.0.0.1:{ports[0]}", "grpc": f"127.0.0.1:{ports[1]}"}

        def bootstrap_of(ports: tuple[int, int], *, keys: bool = True, omit: list[str] | tuple[str, ...] = ()) -> str:
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
                omit=omit,
            )

        for variant in VARIANTS:
            ports = free_port(), free_port()
            omitted = {"no_filters": "all"}.get(variant, variant.removeprefix("no_"))
            bootstrap = bootstrap_of(
                ports,
                keys=omitted not in ("auth", "all"),
                omit={"auth": [], "all": OPTIONAL_FILTERS}.get(omitted, [omitted]),
            )
            processes[f"gateway_{variant}"] = EnvoyProcess(
                bootstrap, root / variant, listen=[("127.0.0.1", p) for p in ports], name=variant
            )
            urls[f"gateway_{variant}"] = {"http": f"http://127.0.0.1:{ports[0]}", "grpc": f"127.0.0.1:{ports[1]}"}
        http_buffer = stack.settings.wake_buffer_bytes
        for variant, buffer in (("large", GRPC_RETRY_BUFFER_BYTES), ("large_no_copy", http_buffer)):
            ports = free_port(), free_port()
            bootstrap = bootstrap_of(ports)
            limit = f"request_body_buffer_limit: {GRPC_RETRY_BUFFER_BYTES}"
            assert bootstrap.count(limit) == 1, "the gRPC listener's retry buffer moved"
            processes[f"gateway_{variant}"] = EnvoyProcess(
                bootstrap.replace(limit, f"request_body_buffer_limit: {buffer}"),
                root / variant,
                listen=[("127.0.0.1", p) for p in ports],
                name=variant,
            )
            urls[f"gateway_{variant}"] = {"http": f"http://127.0.0.1:{ports[0]}", "grpc": f"127.0.0.1:{ports[1]}"}
        targets = ["direct", "bare_envoy", "gateway", *(f"gateway_{v}" for v in VARIANTS)]
        large: list[dict[str, Any]] = []
        runs: list[dict[str, Any]] = []
        lua_before = _lua_executions(stack.gateway.stats())
        try:
            for process in processes.values():
                process.start()
            async with LoadWorker() as worker:
                for protocol in PROTOCOLS:
                    for concurrency in CONCURRENCY:
                        for r in range(rounds):
                            order = targets[r % len(targets) :] + targets[: r % len(targets)]
                            for name in order:
                                job = Job(
                                    protocol,
                                    urls[name][protocol],
                                    MODEL,
                                    concurrency,
                                    seconds,
                                    headers={} if name in ("direct", "bare_envoy") else {"x-api-key": API_KEY},
                                    warmup_secs=warmup,
                                )
                                result = await worker.run(job)
                                runs.append(
                                    {
                                        "round": r,
                                        "protocol": protocol,
                                        "concurrency": concurrency,
                                        "target": name,
                                        "rps": round(result.rps, 1),
                                        "p50_ms": result.p50_ms,
                                        "errors": result.errors,
                                        "first_error": result.first_error,
                                    }
                                )
                            runs[-1]["load_average"] = [round(v, 2) for v in os.getloadavg()]
                lua_during = _lua_executions(stack.gateway.stats()) - lua_before
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
            "client": "grpc.aio (raw ModelInferRequest bytes) / aiohttp, in a separate process",
        },
        "targets": targets,
        "load_average": {"start": load_start, "end": [round(v, 2) for v in os.getloadavg()]},
        "gateway_lua_executions": lua_during,  # the served gateway's Lua runs over all its warm requests
        "runs": runs,
        "table": _table(runs, targets, rounds),
        "large": {
            "request_mib": LARGE_FLOATS * 4 / 2**20,
            "runs": large,
            "p50_ms": {
                t: round(statistics.median(x["p50_ms"] for x in large if x["target"] == t), 2) for t in LARGE_TARGETS
            },
            "errors": {t: sum(x["errors"] for x in large if x["target"] == t) for t in LARGE_TARGETS},
        },
    }


def _lua_executions(stats: dict[str, int]) -> int:
    return sum(v for k, v in stats.items() if k.endswith("lua.executions"))


def _table(runs: list[dict[str, Any]], targets: list[str], rounds: int) -> list[dict[str, Any]]:
    """Per protocol and target: median c=32 rps, its median per-round ratio to the bare hop, and the median
    per-round c=1 p50 added over direct."""
    by = {(x["round"], x["protocol"], x["concurrency"], x["target"]): x for x in runs}
    rows = []
    for protocol in PROTOCOLS:
        for target in targets:
            c32 = [by[(r, protocol, 32, target)] for r in range(rounds)]
            ratio = [x["rps"] / by[(r, protocol, 32, "bare_envoy")]["rps"] for r, x in enumerate(c32)]
            added = [
                by[(r, protocol, 1, target)]["p50_ms"] - by[(r, protocol, 1, "direct")]["p50_ms"] for r in range(rounds)
            ]
            rows.append(
                {
                    "protocol": protocol,
                    "target": target,
                    "c32_rps": round(statistics.median(x["rps"] for x in c32), 1),
                    "c32_vs_bare_envoy": round(statistics.median(ratio), 3),
                    "c1_p50_ms": round(
                        statistics.median(by[(r, protocol, 1, target)]["p50_ms"] for r in range(rounds)), 3
                    ),
                    "c1_added_p50_ms": round(statistics.median(added), 3),
                    "errors": sum(by[(r, protocol, c, target)]["errors"] for r in range(rounds) for c in CONCURRENCY),
                }
            )
    return rows
