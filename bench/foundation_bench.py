"""Foundation numbers: load time per example model through Triton's repository API, and the numpy
example's throughput through the embedded Triton (grpc.aio) vs its `predict` called in-process on
the same batch sizes, measured in the same run.

    python -m bench.foundation_bench [--seconds 5] [--json bench/out/foundation.json]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc.aio as grpcaio

from controlplane.render import embedded_target, render_repository
from controlplane.spec import discover, resolve_all
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.launcher import EmbeddedTriton

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "models"


async def load_times(admin: TritonAdminClient, model: str, repeats: int = 5) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await admin.load(model)
        times.append(time.perf_counter() - start)
        await admin.unload(model, wait=True)
    return times


async def grpc_throughput(url: str, model: str, concurrency: int, seconds: float) -> dict[str, float]:
    client = grpcaio.InferenceServerClient(url)
    x = np.ones((1, 4), dtype=np.float32)
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            tensor = grpcaio.InferInput("x", [1, 4], "FP32")
            tensor.set_data_from_numpy(x)
            start = time.perf_counter()
            await client.infer(model, [tensor])
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    await client.close()
    latencies.sort()
    return {
        "requests": len(latencies),
        "rps": len(latencies) / elapsed,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[int(len(latencies) * 0.99) - 1],
    }


def inprocess_rps(batch: int, seconds: float) -> float:
    """The ceiling: the same predict, same batch size, no server."""
    spec = importlib.util.spec_from_file_location("numpy_linear", EXAMPLES / "numpy-linear" / "snooze_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.Model(scale=2.0)
    model.load(str(EXAMPLES / "numpy-linear"), "cpu")
    x = np.ones((batch, 4), dtype=np.float32)
    calls, deadline = 0, time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < deadline:
        model.predict({"x": x})
        calls += 1
    return calls * batch / (time.perf_counter() - start)


async def main(seconds: float) -> dict:
    specs = resolve_all(discover(EXAMPLES))
    results: dict = {"machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores, {platform.python_version()}"}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        render_repository(specs, repo, embedded_target())
        with EmbeddedTriton(repo, Path(tmp) / "work") as triton:
            async with TritonAdminClient(triton.http_url) as admin:
                results["load_secs_median_of_5"] = {}
                for spec in specs:
                    times = await load_times(admin, spec.id)
                    results["load_secs_median_of_5"][spec.id] = round(statistics.median(times), 4)
                await admin.load("numpy-linear")
                results["throughput"] = {}
                for concurrency in (1, 32):
                    before = await admin.model_stats("numpy-linear")
                    served = await grpc_throughput(triton.grpc_url, "numpy-linear", concurrency, seconds)
                    after = await admin.model_stats("numpy-linear")
                    executions = max(1, after.execution_count - before.execution_count)
                    mean_batch = (after.inference_count - before.inference_count) / executions
                    ceiling = inprocess_rps(max(1, round(mean_batch)), seconds / 2)
                    results["throughput"][f"c{concurrency}"] = {
                        **{k: round(v, 3) for k, v in served.items()},
                        "mean_executed_batch": round(mean_batch, 2),
                        "inprocess_rps_same_batch": round(ceiling, 1),
                        "ratio_vs_inprocess": round(served["rps"] / ceiling, 4),
                    }
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "foundation.json")
    args = parser.parse_args()
    report = asyncio.run(main(args.seconds))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
