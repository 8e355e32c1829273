"""Batching: a custom model's throughput through Triton (its dynamic batcher, batch-1 requests from
grpc.aio clients, direct to Triton) vs the same `predict` called in-process on batches of the size
Triton actually executed (the ceiling), with the mean executed batch size from Triton's statistics.

Two models: the numpy example (trivially cheap: the ratio measures pure serving cost) and a numpy
dense-layer model calibrated so that one predict on a batch of 8 costs about 1 ms here. Then what the
runtime adds over a hand-written python-backend model doing the same work (bench/runtime_cost.py).

Then the torch example three ways (``bench.common.TORCH_VARIANTS``: in its stub, in a preforked worker,
as its ONNX export), measured in interleaved rounds (the order rotates each round): the cost of one
request at concurrency 1 (client p50 and Triton's compute time per batch) and the throughput at 32,
with the preforked worker's cost over the stub's per round.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, TypedDict

from bench import runtime_cost
from bench._load import Job, LoadWorker
from bench.common import (
    EXAMPLES,
    MATMUL_WIDTH,
    TORCH_VARIANTS,
    calibrate_matmul_layers,
    direct_urls,
    inprocess_ceiling,
    matmul_package,
    serving_stack,
    torch_variant_entries,
)

CONCURRENCY = (1, 8, 32)
MAX_BATCH = 32


class _Model(TypedDict):
    """One numpy model of the section."""

    path: Path
    width: int  # features per row
    params: dict[str, Any]
    description: str


async def run(
    root: Path, *, seconds: float, warmup: float, pairs: int, pair_seconds: float, torch_rounds: int = 3
) -> dict[str, Any]:
    layers, est_ms = calibrate_matmul_layers(1.0, 8)
    models: dict[str, _Model] = {
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
    if torch_rounds:
        variants = torch_variant_entries(root, MAX_BATCH, idle_timeout_secs=3600)
        entries += [{"id": m, **entry} for m, entry in variants.items()]
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
        admin = stack.admin
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
                await stack.lifecycle.unload(model)
                out["models"][model] = {
                    "description": info["description"],
                    "predict_ms_batch_1": round(ceiling[1]["ms_per_call"], 4),
                    "predict_ms_batch_8": round(ceiling[8]["ms_per_call"], 4),
                    "rows": rows,
                }
            if torch_rounds:
                out["torch_workers"] = await _torch_workers(stack, worker, seconds, warmup, torch_rounds)
    # After the stack is gone: its own Triton and control plane must not share the CPUs with this one.
    out["runtime_vs_handwritten"] = await runtime_cost.run(
        root / "runtime_cost", seconds=pair_seconds, pairs=pairs, warmup=warmup
    )
    return out


TORCH_CONCURRENCY = (1, 32)


async def _torch_workers(stack: Any, worker: LoadWorker, seconds: float, warmup: float, rounds: int) -> dict[str, Any]:
    admin = stack.admin
    variants = list(TORCH_VARIANTS)
    for model in variants:
        await stack.lifecycle.ensure_ready(model)
    cells: dict[str, dict[int, list[dict[str, float]]]] = {m: {c: [] for c in TORCH_CONCURRENCY} for m in variants}
    for r in range(rounds):
        for model in variants[r % len(variants) :] + variants[: r % len(variants)]:  # rotate: no one always first
            for concurrency in TORCH_CONCURRENCY:
                job = Job(
                    "grpc", direct_urls(stack)["grpc"], model, concurrency, seconds,
                    shape=[1, 8], input_name="features", output_name="logits", warmup_secs=warmup,
                )  # fmt: skip
                before = await admin.model_stats(model)
                result = await worker.run(job)
                after = await admin.model_stats(model)
                inferences = max(1, after.inference_count - before.inference_count)
                executions = max(1, after.execution_count - before.execution_count)
                cells[model][concurrency].append({
                    "p50_ms": result.p50_ms,
                    "rows_per_s": round(result.rps, 1),
                    "errors": result.errors,
                    "mean_executed_batch": round(inferences / executions, 2),
                    # per request, so per batch at c=1: Triton counts a batch's time for each request in it
                    "triton_compute_us_per_request": round(
                        (after.compute_infer_ns - before.compute_infer_ns) / inferences / 1e3, 1
                    ),
                })  # fmt: skip
    out: dict[str, Any] = {"rounds": rounds, "seconds": seconds, "variants": {}}
    base = cells["torch-mlp"]
    for model in variants:
        c1, c32 = cells[model][1], cells[model][32]
        out["variants"][model] = {
            "description": TORCH_VARIANTS[model],
            "c1_p50_ms": _median([s["p50_ms"] for s in c1]),
            "c1_triton_compute_us": _median([s["triton_compute_us_per_request"] for s in c1]),
            "c32_rows_per_s": _median([s["rows_per_s"] for s in c32]),
            "c32_mean_executed_batch": _median([s["mean_executed_batch"] for s in c32]),
            "errors": sum(s["errors"] for s in c1 + c32),
            # paired with the in-stub model's run of the same round
            "c1_p50_added_ms": _median([s["p50_ms"] - b["p50_ms"] for s, b in zip(c1, base[1], strict=True)]),
            "c1_compute_added_us": _median(
                [
                    s["triton_compute_us_per_request"] - b["triton_compute_us_per_request"]
                    for s, b in zip(c1, base[1], strict=True)
                ]
            ),  # fmt: skip
            "c32_vs_in_stub": round(
                _median([s["rows_per_s"] for s in c32]) / _median([b["rows_per_s"] for b in base[32]]), 3
            ),
            "rounds": {str(c): cells[model][c] for c in TORCH_CONCURRENCY},
        }
    for model in variants:
        await stack.lifecycle.unload(model)
    return out


def _median(values: list[float]) -> float:
    return round(float(statistics.median(values)), 4) if values else float("nan")
