"""Native vs custom: the same torch MLP served by the embedded Triton as a custom torch python-backend
model and as its ONNX export (python-backend onnxruntime runner), measured in the same run.

Cold start = Triton's load time through the repository API (median of N, alternating the two models);
throughput = grpc.aio, batch-1 requests, concurrency 1 and 32, ~S seconds each (bounded by a deadline).
Also: export time and parity error of the conversion, stub memory (RSS) once loaded.

    python -m bench.native_bench [--seconds 5] [--repeats 5] [--json bench/out/native.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import tritonclient.grpc.aio as grpcaio

from controlplane.native import prefer_native
from controlplane.render import embedded_target, render_repository
from controlplane.spec import DeploymentSpec, resolve
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.launcher import EmbeddedTriton

ROOT = Path(__file__).resolve().parents[1]
IN_FEATURES, HIDDEN, OUT_FEATURES = 64, 256, 10

PACKAGE = f'''
import numpy as np


def build():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear({IN_FEATURES}, {HIDDEN}), torch.nn.ReLU(),
        torch.nn.Linear({HIDDEN}, {HIDDEN}), torch.nn.ReLU(),
        torch.nn.Linear({HIDDEN}, {OUT_FEATURES}),
    ).eval()


class Model:
    def load(self, model_dir, device):
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        self.module = build()

    def predict(self, inputs):
        with self.torch.inference_mode():
            return {{"logits": self.module(self.torch.from_numpy(inputs["x"])).numpy()}}

    def export_module(self):
        return self.module, {{"x": np.zeros((2, {IN_FEATURES}), np.float32)}}
'''
MANIFEST = {
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [IN_FEATURES]}],
    "outputs": [{"name": "logits", "datatype": "FP32", "dims": [OUT_FEATURES]}],
    "env": {"OMP_NUM_THREADS": "1"},
}


async def load_times(admin: TritonAdminClient, models: list[str], repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {m: [] for m in models}
    for i in range(repeats):
        for model in models if i % 2 == 0 else reversed(models):  # alternate: neither always goes first
            start = time.perf_counter()
            await admin.load(model)
            times[model].append(time.perf_counter() - start)
            await admin.unload(model, wait=True)
    return times


async def throughput(url: str, model: str, concurrency: int, seconds: float) -> dict[str, float]:
    client = grpcaio.InferenceServerClient(url)
    x = np.random.default_rng(0).standard_normal((1, IN_FEATURES)).astype(np.float32)
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal errors
        while time.perf_counter() < deadline:
            tensor = grpcaio.InferInput("x", [1, IN_FEATURES], "FP32")
            tensor.set_data_from_numpy(x)
            start = time.perf_counter()
            try:
                await client.infer(model, [tensor], client_timeout=30)
            except Exception:
                errors += 1
                continue
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeout=seconds + 60)
    elapsed = time.perf_counter() - start
    await client.close()
    latencies.sort()
    n = len(latencies)
    return {
        "requests": n,
        "errors": errors,
        "rps": n / elapsed,
        "p50_ms": 1000 * latencies[n // 2] if n else float("nan"),
        "p99_ms": 1000 * latencies[max(0, int(n * 0.99) - 1)] if n else float("nan"),
    }


def stub_rss_mb(triton: EmbeddedTriton, model: str) -> float:
    total = 0
    for pid in triton.stub_pids(model):
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


async def main(seconds: float, repeats: int) -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "model": f"MLP {IN_FEATURES}-{HIDDEN}-{HIDDEN}-{OUT_FEATURES} (torch, 1 intra-op thread)",
        "settings": {"max_batch_size": 32, "instances": 1, "seconds": seconds, "repeats": repeats},
    }
    with tempfile.TemporaryDirectory(prefix="native-bench-") as tmp:
        root = Path(tmp)
        pkg = root / "torch-mlp"
        pkg.mkdir()
        (pkg / "snooze_model.py").write_text(textwrap.dedent(PACKAGE))
        (pkg / "snooze_model.json").write_text(json.dumps(MANIFEST))
        start = time.perf_counter()
        decision = prefer_native(pkg, max_batch_size=32, out_dir=root / "onnx-mlp")
        if not decision.native:
            raise SystemExit(f"export failed: {decision.reason}")
        worst = max(c["max_abs"] for c in decision.report["comparisons"])
        results["conversion"] = {
            "exporter": decision.exporter,
            "export_secs": round(decision.export_secs, 3),
            "worker_total_secs": round(time.perf_counter() - start, 3),
            "parity_max_abs": worst,
            "parity_comparisons": len(decision.report["comparisons"]),
        }
        models = {"custom-torch": pkg, "onnx-export": decision.publish_path}
        specs = [resolve(DeploymentSpec(id=m, path=p, max_batch_size=32)) for m, p in models.items()]
        repo = root / "repo"
        render_repository(specs, repo, embedded_target())
        with EmbeddedTriton(repo, root / "work") as triton:
            async with TritonAdminClient(triton.http_url) as admin:
                times = await load_times(admin, list(models), repeats)
                results["cold_start_secs"] = {
                    m: {"median": round(statistics.median(t), 4), "all": [round(v, 4) for v in t]}
                    for m, t in times.items()
                }
                results["throughput"] = {}
                results["stub_rss_mb"] = {}
                for model in models:
                    await admin.load(model)
                    await throughput(triton.grpc_url, model, 4, 0.5)  # warm-up
                    results["stub_rss_mb"][model] = round(stub_rss_mb(triton, model), 1)
                    for concurrency in (1, 32):
                        before = await admin.model_stats(model)
                        served = await throughput(triton.grpc_url, model, concurrency, seconds)
                        after = await admin.model_stats(model)
                        executions = max(1, after.execution_count - before.execution_count)
                        inferences = after.inference_count - before.inference_count
                        results["throughput"].setdefault(model, {})[f"c{concurrency}"] = {
                            **{k: round(v, 3) for k, v in served.items()},
                            "mean_executed_batch": round(inferences / executions, 2),
                        }
                    await admin.unload(model, wait=True)
    cold = results["cold_start_secs"]
    tput = results["throughput"]
    results["ratios_onnx_vs_custom"] = {
        "cold_start": round(cold["onnx-export"]["median"] / cold["custom-torch"]["median"], 3),
        **{
            f"rps_{c}": round(tput["onnx-export"][c]["rps"] / tput["custom-torch"][c]["rps"], 3)
            for c in ("c1", "c32")
        },
    }
    return results


def table(results: dict[str, Any]) -> str:
    conv = results["conversion"]
    lines = [
        f"{results['model']} on {results['machine']}",
        f"export: {conv['exporter']} exporter {conv['export_secs']} s (worker total {conv['worker_total_secs']} s), "
        f"parity max abs error {conv['parity_max_abs']:.2g} over {conv['parity_comparisons']} comparisons",
        "",
        f"{'model':<14}{'cold start':>12}{'rps c1':>10}{'p50 c1':>10}{'rps c32':>10}{'p50 c32':>10}{'p99 c32':>10}"
        f"{'batch c32':>11}{'stub RSS':>10}",
    ]
    for model, cold in results["cold_start_secs"].items():
        t1, t32 = results["throughput"][model]["c1"], results["throughput"][model]["c32"]
        lines.append(
            f"{model:<14}{cold['median']:>10.3f} s{t1['rps']:>10.0f}{t1['p50_ms']:>8.2f}ms{t32['rps']:>10.0f}"
            f"{t32['p50_ms']:>8.2f}ms{t32['p99_ms']:>8.2f}ms{t32['mean_executed_batch']:>11.1f}"
            f"{results['stub_rss_mb'][model]:>7.0f} MB"
        )
    r = results["ratios_onnx_vs_custom"]
    lines.append(f"onnx/custom: cold start x{r['cold_start']}, rps c1 x{r['rps_c1']}, rps c32 x{r['rps_c32']}")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "native.json")
    args = parser.parse_args()
    report = asyncio.run(main(args.seconds, args.repeats))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"\nwritten to {args.json}")
