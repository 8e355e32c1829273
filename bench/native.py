"""Native vs custom: the same torch MLP served by the embedded Triton as a custom torch python-backend
model and as its ONNX export (python-backend onnxruntime runner), measured in the same run.

Cold start = Triton's load time through the repository API (median of N, alternating the two models);
throughput = the shared load generator (bench._load, grpc.aio in its own process), batch-1 requests,
concurrency 1 and 32, direct to Triton. Also: export time and parity error of the conversion, stub
memory (RSS) once loaded. Not in the default run (it measures the converters, not serving):

    python -m bench --only native
"""

from __future__ import annotations

import json
import statistics
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil

from bench._load import Job, LoadWorker
from controlplane.native import prefer_native
from controlplane.render import embedded_target
from controlplane.spec import DeploymentSpec, resolve
from controlplane.store import render_repository
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.launcher import EmbeddedTriton

ROOT = Path(__file__).resolve().parents[1]
IN_FEATURES, HIDDEN, OUT_FEATURES = 64, 256, 10

PACKAGE = f"""
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
"""
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


def stub_rss_mb(triton: EmbeddedTriton, model: str) -> float:
    total = 0
    for pid in triton.stub_pids(model):
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


async def run(root: Path, *, seconds: float, repeats: int) -> dict[str, Any]:
    results: dict[str, Any] = {
        "model": f"MLP {IN_FEATURES}-{HIDDEN}-{HIDDEN}-{OUT_FEATURES} (torch, 1 intra-op thread)",
        "settings": {"max_batch_size": 32, "instances": 1, "seconds": seconds, "repeats": repeats},
    }
    root.mkdir(parents=True, exist_ok=True)
    pkg = root / "torch-mlp"
    pkg.mkdir()
    (pkg / "snooze_model.py").write_text(textwrap.dedent(PACKAGE))
    (pkg / "snooze_model.json").write_text(json.dumps(MANIFEST))
    start = time.perf_counter()
    decision = prefer_native(pkg, max_batch_size=32, out_dir=root / "onnx-mlp")
    report, export_secs = decision.report, decision.export_secs
    if not decision.native or report is None or export_secs is None:
        raise RuntimeError(f"export failed: {decision.reason}")
    worst = max(c["max_abs"] for c in report["comparisons"])
    results["conversion"] = {
        "exporter": decision.exporter,
        "export_secs": round(export_secs, 3),
        "worker_total_secs": round(time.perf_counter() - start, 3),
        "parity_max_abs": worst,
        "parity_comparisons": len(report["comparisons"]),
    }
    models = {"custom-torch": pkg, "onnx-export": decision.publish_path}
    specs = [resolve(DeploymentSpec(id=m, path=p, max_batch_size=32)) for m, p in models.items()]
    repo = root / "repo"
    render_repository(specs, repo, embedded_target())
    with EmbeddedTriton(repo, root / "work") as triton:
        async with TritonAdminClient(triton.http_url) as admin, LoadWorker() as worker:
            times = await load_times(admin, list(models), repeats)
            results["cold_start_secs"] = {
                m: {"median": round(statistics.median(t), 4), "all": [round(v, 4) for v in t]} for m, t in times.items()
            }
            results["throughput"] = {}
            results["stub_rss_mb"] = {}
            for model in models:
                await admin.load(model)
                job = Job("grpc", triton.grpc_url, model, 4, 0.5, shape=[1, IN_FEATURES], output_name="logits")
                await worker.run(job)  # warm-up
                results["stub_rss_mb"][model] = round(stub_rss_mb(triton, model), 1)
                for concurrency in (1, 32):
                    before = await admin.model_stats(model)
                    r = await worker.run(
                        Job(
                            "grpc",
                            triton.grpc_url,
                            model,
                            concurrency,
                            seconds,
                            shape=[1, IN_FEATURES],
                            output_name="logits",
                        )
                    )
                    served = {
                        "requests": r.requests,
                        "errors": r.errors,
                        "rps": r.rps,
                        "p50_ms": r.p50_ms,
                        "p99_ms": r.p99_ms,
                    }
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
        **{f"rps_{c}": round(tput["onnx-export"][c]["rps"] / tput["custom-torch"][c]["rps"], 3) for c in ("c1", "c32")},
    }
    return results
