"""Batching: a custom model's throughput through Triton (its dynamic batcher, batch-1 requests from
grpc.aio clients, direct to Triton) vs the same `predict` called in-process on batches of the size
Triton actually executed (the ceiling), with the mean executed batch size from Triton's statistics.

Two models: the numpy example (trivially cheap: the ratio measures pure serving cost) and a numpy
dense-layer model calibrated so that one predict on a batch of 8 costs about 1 ms here. Then what the
runtime adds over a hand-written python-backend model doing the same work (bench/runtime_cost.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import runtime_cost
from bench._load import Job, LoadWorker
from bench.common import (
    EXAMPLES,
    MATMUL_WIDTH,
    calibrate_matmul_layers,
    direct_urls,
    inprocess_ceiling,
    matmul_package,
    serving_stack,
)

CONCURRENCY = (1, 8, 32)
MAX_BATCH = 32


async def run(root: Path, *, seconds: float, warmup: float, pairs: int, pair_seconds: float) -> dict[str, Any]:
    layers, est_ms = calibrate_matmul_layers(1.0, 8)
    models = {
        "numpy-linear": {
            "path": EXAMPLES / "numpy-linear",
            "width": 4,
            "params": {"scale": 2.0},
            "description": "examples/models/numpy-linear: x @ W (4x3), trivially cheap",
        },
        "bench-matmul": {
            "path": matmul_package(root / "pkg" / "bench-matmul", layers),
            "width": MATMUL_WIDTH,
            "params": {},
            "description": f"numpy, {layers} tanh(x @ W) layers of width {MATMUL_WIDTH} "
            f"(calibrated: ~{est_ms:.2f} ms per batch of 8, one BLAS thread)",
        },
    }
    entries = [
        {"id": m, "path": v["path"], "max_batch_size": MAX_BATCH, "idle_timeout_secs": 3600} for m, v in models.items()
    ]
    out: dict[str, Any] = {
        "settings": {
            "seconds": seconds,
            "concurrency": list(CONCURRENCY),
            "max_batch_size": MAX_BATCH,
            "max_batch_delay_ms": 0,
            "instances": 1,
            "request_rows": 1,
            "client": "grpc.aio direct to Triton, separate process",
        },
        "models": {},
    }
    async with serving_stack(root / "stack", entries) as stack:
        admin = stack.lifecycle.triton
        async with LoadWorker() as worker:
            for model, info in models.items():
                await stack.lifecycle.ensure_ready(model)
                rows = []
                for concurrency in CONCURRENCY:
                    job = Job(
                        "grpc",
                        direct_urls(stack)["grpc"],
                        model,
                        concurrency,
                        seconds,
                        shape=[1, info["width"]],
                        warmup_secs=warmup,
                    )
                    before = await admin.model_stats(model)
                    r = await worker.run(job)
                    after = await admin.model_stats(model)
                    executions = max(1, after.execution_count - before.execution_count)
                    inferences = after.inference_count - before.inference_count
                    # the warm-up's requests are in the statistics too; their batches look alike
                    rows.append(
                        {
                            "concurrency": concurrency,
                            "rows_per_s": round(r.rps, 1),
                            "p50_ms": r.p50_ms,
                            "p99_ms": r.p99_ms,
                            "errors": r.errors,
                            "mean_executed_batch": round(inferences / executions, 2),
                            # Triton's inference_stats durations are per request: a batch's compute time
                            # is counted once for every request in it.
                            "triton_compute_ms_per_batch": round(
                                (after.compute_infer_ns - before.compute_infer_ns) / max(1, inferences) / 1e6, 3
                            ),
                        }
                    )
                batches = sorted({max(1, round(row["mean_executed_batch"])) for row in rows} | {1, 8})
                ceiling = inprocess_ceiling(info["path"], batches, max(0.3, seconds / 4), info["width"], info["params"])
                for row in rows:
                    b = max(1, round(row["mean_executed_batch"]))
                    row["inprocess_batch"] = b
                    row["inprocess_rows_per_s"] = round(ceiling[b]["rows_per_s"], 1)
                    row["triton_vs_inprocess"] = round(row["rows_per_s"] / ceiling[b]["rows_per_s"], 4)
                await stack.lifecycle.unload(model, reason="bench")
                out["models"][model] = {
                    "description": info["description"],
                    "predict_ms_batch_1": round(ceiling[1]["ms_per_call"], 4),
                    "predict_ms_batch_8": round(ceiling[8]["ms_per_call"], 4),
                    "rows": rows,
                }
    # After the stack is gone: its own Triton and control plane must not share the CPUs with this one.
    out["runtime_vs_handwritten"] = await runtime_cost.run(
        root / "runtime_cost", seconds=pair_seconds, pairs=pairs, warmup=warmup
    )
    return out
