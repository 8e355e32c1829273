"""Section batching: rows per second through Triton's dynamic batcher against the same ``predict`` in-process, the
runtime against a hand-written python-backend model, and the torch example three ways (measured by
bench/batching.py and bench/runtime_cost.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.markdown import table
from bench.plotting import pyplot, save
from bench.registry import Data, Rendering, RunContext, Section, register


async def run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import batching

    return await batching.run(root, **params)


def plot(res: Data, path: Path) -> str:
    plt = pyplot()
    models = list(res["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = res["models"][model]["rows"]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["rows_per_s"] for r in rows], 0.4, label="through Triton", color="#4c72b0")
        ax.bar(
            [x + 0.2 for x in xs],
            [r["inprocess_rows_per_s"] for r in rows],
            0.4,
            label="in-process predict",
            color="#8c8c8c",
        )
        ax.set_yscale("log")
        ax.set_xticks(list(xs), [f"c={r['concurrency']}\nbatch {r['mean_executed_batch']:.1f}" for r in rows])
        ax.set_title(model, fontsize=10)
        ax.set_ylabel("rows / s")
    axes[0][0].legend(fontsize=8)
    return save(fig, path)


def summary(b: Data) -> list[str]:
    out = []
    parts = []
    for m, v in b["models"].items():
        last = v["rows"][-1]
        parts.append(
            f"{m} {last['triton_vs_inprocess']:.3f} of in-process at c={last['concurrency']} "
            f"(mean batch {last['mean_executed_batch']})"
        )
    out.append("- **Batching** (Triton rows/s / in-process predict rows/s, same batch size): " + "; ".join(parts) + ".")
    if rc := b.get("runtime_vs_handwritten"):
        t = rc["targets"]
        out.append(
            f"- **Runtime vs hand-written model** (median of {rc['settings']['pairs']} interleaved rounds): "
            f"{rc['c1']['added_ms']:+.3f} ms per request at c=1 "
            f"({'meets' if t['added_ms_c1_met'] else 'misses'} <= {t['added_ms_c1_max']} ms), "
            f"{rc['c32']['ratio']:.3f}x throughput at c=32 "
            f"({'meets' if t['ratio_c32_met'] else 'misses'} >= {t['ratio_c32_min']}x); "
            f"load average {rc['load_average_start'][0]:.2f} -> {rc['load_average_end'][0]:.2f}."
        )
    if t := b.get("torch_workers"):
        pf = t["variants"]["torch-mlp-preforked"]
        out.append(
            f"- **Preforked per request** (the torch example, c=1): +{pf['c1_p50_added_ms']:.3f} ms p50 "
            f"(+{pf['c1_compute_added_us']:.0f} µs of Triton compute) over the stub; at c=32 "
            f"{pf['c32_vs_in_stub']:.2f}x the stub's throughput."
        )
    return out


def markdown(b: Data, rendering: Rendering) -> list[str]:
    lines: list[str] = []
    st = b["settings"]
    lines += [
        "## Batching: through Triton vs `predict` in-process",
        "",
        "Batch-1 requests over gRPC straight to Triton (its dynamic batcher, "
        f"max_batch_size {st['max_batch_size']}, "
        f"max delay {st['max_batch_delay_ms']} ms, {st['instances']} instance), {st['seconds']} s per cell. The "
        "ceiling is the same `predict` called in a fresh interpreter (best of short rounds) on batches of the size "
        "Triton executed "
        "(mean executed batch = inference_count / execution_count from Triton's statistics). BLAS is pinned to "
        "one thread in every process.",
        "",
    ]
    for mdl, v in b["models"].items():
        lines += [
            f"**{mdl}**: {v['description']}; predict costs {v['predict_ms_batch_1']:.3f} ms at batch 1 and "
            f"{v['predict_ms_batch_8']:.3f} ms at batch 8 in-process.",
            "",
            table(
                [
                    "c",
                    "mean executed batch",
                    "Triton rows/s",
                    "in-process rows/s (same batch)",
                    "Triton / in-process",
                    "Triton compute ms per batch",
                    "p50 ms",
                    "p99 ms",
                ],
                [
                    [
                        r["concurrency"],
                        r["mean_executed_batch"],
                        r["rows_per_s"],
                        r["inprocess_rows_per_s"],
                        r["triton_vs_inprocess"],
                        r["triton_compute_ms_per_batch"],
                        r["p50_ms"],
                        r["p99_ms"],
                    ]
                    for r in v["rows"]
                ],
            ),
            "",
        ]
    lines += rendering.image("batching", "batching")
    lines += _runtime_cost_lines(b.get("runtime_vs_handwritten"))
    return lines + _torch_worker_lines(b.get("torch_workers"))


def _runtime_cost_rows(rc: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for c in ("c1", "c32"):
        v = rc[c]
        limit = rc["settings"]["request_timeout_secs"]
        for label, w in ((f"runtime (limit {limit} s)", v), ("runtime, no limit", v.get("no_limit"))):
            if w is None:  # a report.json from before the no-limit model was measured
                continue
            rows.append(
                [
                    c[1:],
                    label,
                    w.get("rps", v["runtime_rps"]),
                    v["handwritten_rps"],
                    w["ratio"],
                    f"{w['added_ms']:+.4f}" if "added_ms" in w else "-",
                    f"{w['added_p50_ms']:+.4f}" if "added_p50_ms" in w else "-",
                    f"{w['compute_added_ms']:+.4f}",
                    w["mean_executed_batch"],
                ]
            )
    return rows


def _runtime_cost_lines(rc: dict[str, Any] | None) -> list[str]:
    if not rc:  # a report.json from before this comparison existed
        return []
    st, t = rc["settings"], rc["targets"]
    verdict = ("Too few rounds to judge the targets (quick run). " if st["pairs"] < 3 else "") + (
        f"Targets, for the runtime with its time limit: at most {t['added_ms_c1_max']} ms added at c=1 "
        f"({'met' if t['added_ms_c1_met'] else 'NOT met'}), at least {t['ratio_c32_min']}x at c=32 "
        f"({'met' if t['ratio_c32_met'] else 'NOT met'}). Errors: {rc['c1']['errors'] + rc['c32']['errors']}."
    )
    micro = rc.get("execute_inprocess")
    micro_lines = []
    if micro:
        b1, b32 = micro["batch_1"], micro["batch_32"]
        micro_lines = [
            "In-process `execute()` with stand-in pb_utils objects (best of short rounds, no Triton): batch 1 "
            f"hand-written {b1['handwritten_us']} us, runtime {b1['runtime_us']} us (no limit: "
            f"{b1.get('runtime_no_limit_us', '-')} us); batch 32 {b32['handwritten_us']} us vs {b32['runtime_us']} us "
            f"({b32['added_us_per_request']} us added per request). Of the runtime's cost, enforcing "
            f"request_timeout_secs (the watchdog's clock read and stores) is {micro.get('watchdog_us', '-')} us per "
            "execute.",
            "",
        ]
    return [
        "### snoozeml's runtime vs a hand-written python-backend model",
        "",
        f"{rc['model']}. All in one Triton (max_batch_size {st['max_batch_size']}); the runtime as rendered "
        f"(request_timeout_secs {st['request_timeout_secs']}, enforced by a watchdog thread beside the stub's) "
        "and with request_timeout_secs null (no watchdog); predict runs on the stub's own thread in both. "
        "Batch-1 gRPC requests straight to "
        f"Triton carrying the gateway's request-id header; {st['pairs']} interleaved rounds of {st['seconds']} s per "
        "model and concurrency (the order rotates), medians of the per-round values. Added ms at c=1 = "
        "1/rps(runtime) - 1/rps(hand-written) (the target's measure); added p50 = the same from median latencies, "
        "which a stalled round moves less; compute added = the difference of Triton's compute_infer per request "
        "(the stub's execute as Triton sees it). Load average (1 min) "
        f"{rc['load_average_start'][0]:.2f} at the start, {rc['load_average_end'][0]:.2f} at the end.",
        "",
        table(
            [
                "c",
                "model",
                "req/s",
                "hand-written req/s",
                "vs hand-written",
                "added ms per request",
                "added p50 ms",
                "compute added ms",
                "mean executed batch",
            ],
            _runtime_cost_rows(rc),
        ),
        "",
        verdict,
        "",
        *micro_lines,
    ]


def _torch_worker_lines(t: dict[str, Any] | None) -> list[str]:
    if not t:
        return []
    rows = [
        [
            f"{model} ({v['description']})", v["c1_p50_ms"], v["c1_p50_added_ms"], v["c1_triton_compute_us"],
            v["c1_compute_added_us"], v["c32_rows_per_s"], v["c32_vs_in_stub"], v["c32_mean_executed_batch"],
            v["errors"],
        ]
        for model, v in t["variants"].items()
    ]  # fmt: skip
    return [
        "**The torch example, three ways** (batch-1 gRPC requests straight to Triton, max_batch_size 32; "
        f"{t['rounds']} interleaved rounds of {t['seconds']} s per cell, medians; `added` = this model minus the "
        "in-stub model of the same round, median over rounds; Triton compute = compute_infer per request, which "
        "at c=1 is per batch).",
        "",
        table(
            [
                "model",
                "c=1 p50 ms",
                "added ms",
                "c=1 Triton compute µs",
                "added µs",
                "c=32 rows/s",
                "vs in-stub",
                "c=32 mean batch",
                "errors",
            ],
            rows,
        ),  # fmt: skip
        "",
    ]


register(
    Section(
        name="batching",
        order=30,
        about="Triton's dynamic batcher vs predict in-process; the runtime vs a hand-written model; the torch "
        "example in its stub, preforked and as ONNX",
        params={"seconds": 4.0, "warmup": 0.5, "pairs": 7, "pair_seconds": 2.0, "torch_rounds": 3},
        quick={"seconds": 0.2, "warmup": 0.05, "pairs": 1, "pair_seconds": 0.2, "torch_rounds": 0},
        run=run,
        markdown=markdown,
        summary=summary,
        plot=plot,
        keys=frozenset({"settings", "models"}),
    )
)
