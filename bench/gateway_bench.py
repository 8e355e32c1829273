"""Gateway overhead: direct Triton vs a bare Envoy hop vs the snoozeml gateway, HTTP and gRPC,
concurrency 1 and 32, all in the same run against one embedded tritonserver and one warm model.

The snoozeml gateway runs as served: auth on (the key is sent), wake-by-retry routes, the activator
behind it (never reached here: the model is warm). The bare hop is Envoy with one route per port
and nothing else. Loopback only; each measurement is bounded by --seconds and --max-requests.

    python -m bench.gateway_bench [--seconds 5] [--max-requests 200000] [--json bench/out/gateway.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from bench._load import LoadResult, bare_envoy_bootstrap, grpc_load, http_load
from controlplane.gateway.activator import Activator
from controlplane.gateway.envoy import EnvoyGateway, EnvoyProcess, Upstream
from controlplane.lifecycle import LifecycleManager
from controlplane.render import embedded_target
from controlplane.settings import Settings
from controlplane.spec import DeploymentSpec, resolve
from controlplane.store import ModelStore
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.launcher import EmbeddedTriton, free_port

MODEL = "bench_scale"
KEY = "bench-key"
MODEL_PY = """
import numpy as np


class Model:
    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        return {"y": inputs["x"] * 2}
"""


def write_package(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "snooze_model.py").write_text(textwrap.dedent(MODEL_PY))
    tensor = {"datatype": "FP32", "dims": [4]}
    manifest = {"inputs": [{"name": "x", **tensor}], "outputs": [{"name": "y", **tensor}]}
    (folder / "snooze_model.json").write_text(json.dumps(manifest))
    return folder


async def measure(targets: dict[str, dict[str, str]], seconds: float, max_requests: int) -> list[dict[str, Any]]:
    x = np.ones((1, 4), dtype=np.float32)
    rows = []
    for protocol in ("grpc", "http"):
        for concurrency in (1, 32):
            results: dict[str, LoadResult] = {}
            for name, target in targets.items():
                kw: dict[str, Any] = dict(concurrency=concurrency, seconds=seconds, max_requests=max_requests)
                auth = name == "gateway"
                if protocol == "grpc":
                    metadata = (("x-api-key", KEY),) if auth else ()
                    await grpc_load(target["grpc"], MODEL, x, **{**kw, "seconds": 0.5}, metadata=metadata)  # warm-up
                    results[name] = await grpc_load(target["grpc"], MODEL, x, **kw, metadata=metadata)
                else:
                    headers = {"X-API-Key": KEY} if auth else None
                    await http_load(target["http"], MODEL, x, **{**kw, "seconds": 0.5}, headers=headers)
                    results[name] = await http_load(target["http"], MODEL, x, **kw, headers=headers)
            base = results["direct"]
            for name, r in results.items():
                rows.append(
                    {
                        "protocol": protocol,
                        "concurrency": concurrency,
                        "target": name,
                        "requests": r.requests,
                        "errors": r.errors,
                        "rps": round(r.rps, 1),
                        "throughput_ratio": round(r.rps / base.rps, 3) if base.rps else None,
                        "p50_ms": round(r.percentile(50), 3),
                        "p99_ms": round(r.percentile(99), 3),
                        "added_p50_ms": round(r.percentile(50) - base.percentile(50), 3),
                        "added_p99_ms": round(r.percentile(99) - base.percentile(99), 3),
                    }
                )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    cols = ["protocol", "concurrency", "target", "rps", "throughput_ratio", "p50_ms", "p99_ms",
            "added_p50_ms", "added_p99_ms", "errors"]  # fmt: skip
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


async def run(root: Path, seconds: float, max_requests: int) -> dict[str, Any]:
    repo = root / "model_repository"
    store = ModelStore(repo, embedded_target())
    store.publish(resolve(DeploymentSpec(id=MODEL, path=write_package(root / "package"), max_batch_size=8)))
    triton = EmbeddedTriton(repo, root / "triton")
    settings = Settings(
        work_dir=root, http_port=free_port(), grpc_port=free_port(), api_keys=[KEY], sweep_interval_secs=3600
    )
    bare_http, bare_grpc = free_port(), free_port()
    triton.start()
    admin = TritonAdminClient(triton.http_url, triton.metrics_url, timeout=60)
    lifecycle = LifecycleManager(settings, store, admin, triton_process=triton)
    activator = Activator(lifecycle, store, settings, triton_http_url=triton.http_url, triton_grpc_url=triton.grpc_url)
    t_http, t_grpc = Upstream.parse(triton.http_url), Upstream.parse(triton.grpc_url)
    bare = EnvoyProcess(
        bare_envoy_bootstrap(http_port=bare_http, grpc_port=bare_grpc, triton_http=(t_http.host, t_http.port),
                             triton_grpc=(t_grpc.host, t_grpc.port)),
        root / "bare_envoy",
        listen=[("127.0.0.1", bare_http), ("127.0.0.1", bare_grpc)],
    )  # fmt: skip
    gateway: EnvoyGateway | None = None
    try:
        await lifecycle.start()
        await activator.start()
        gateway = EnvoyGateway(
            settings,
            triton_http=triton.http_url,
            triton_grpc=triton.grpc_url,
            activator_http=activator.http_address,
            activator_grpc=activator.grpc_address,
        )
        gateway.start()
        bare.start()
        await lifecycle.ensure_ready(MODEL)
        targets = {
            "direct": {"http": triton.http_url, "grpc": triton.grpc_url},
            "bare_envoy": {"http": f"http://127.0.0.1:{bare_http}", "grpc": f"127.0.0.1:{bare_grpc}"},
            "gateway": {"http": gateway.http_url, "grpc": gateway.grpc_url},
        }
        rows = await measure(targets, seconds, max_requests)
        retries = gateway.stats().get("cluster.infer_grpc.upstream_rq_retry", 0)
    finally:
        if gateway is not None:
            gateway.stop()
        bare.stop()
        await activator.stop()
        await lifecycle.stop()
        await admin.aclose()
        triton.stop()
    return {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "settings": {"seconds": seconds, "max_requests": max_requests, "envoy_concurrency": 2},
        "model": "numpy x * 2, one 1x4 FP32 row per request",
        "gateway_retries_during_run": retries,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each measurement")
    parser.add_argument("--max-requests", type=int, default=200_000, help="cap on requests per measurement")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "out" / "gateway.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="snooze_gateway_bench_") as tmp:
        report = asyncio.run(run(Path(tmp), args.seconds, args.max_requests))
    print(table(report["rows"]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    main()
