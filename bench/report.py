"""report.md and its plots from the results dictionary (one run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DPI = 80
TARGET_COLORS = {"direct": "#4c72b0", "bare_envoy": "#dd8452", "gateway": "#55a868", "client_ceiling": "#8c8c8c"}


def _save(fig: Any, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path.name


# ------------------------------------------------------------------------------ plots


def plot_gateway(res: dict[str, Any], path: Path) -> str:
    rows = res["rows"]
    conc = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    for col, protocol in enumerate(("grpc", "http")):
        for row_i, (metric, label) in enumerate(
            (("throughput_vs_direct", "throughput / direct Triton"), ("p50_ms", "p50 latency (ms)"))
        ):
            ax = axes[row_i][col]
            width = 0.2
            for i, target in enumerate(TARGET_COLORS):
                vals = [
                    next(
                        r[metric]
                        for r in rows
                        if r["protocol"] == protocol and r["concurrency"] == c and r["target"] == target
                    )
                    for c in conc
                ]
                xs = [j + (i - 1.5) * width for j in range(len(conc))]
                ax.bar(xs, vals, width, label=target, color=TARGET_COLORS[target])
            ax.set_xticks(range(len(conc)), [f"c={c}" for c in conc])
            ax.set_title(f"{protocol.upper()}: {label}", fontsize=10)
            if metric == "throughput_vs_direct":
                ax.axhline(1.0, color="black", lw=0.8)
    axes[0][0].legend(fontsize=8)
    return _save(fig, path)


def plot_coldstart(res: dict[str, Any], path: Path) -> str:
    models = list(res["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(3.2 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        samples = res["models"][model]["samples"]
        series = [[s["triton_load_s"] for s in samples], [s["first_response_s"] for s in samples]]
        ax.boxplot(series, widths=0.5, showfliers=False)
        for i, vals in enumerate(series, start=1):
            jitter = [i + 0.12 * ((k % 7) - 3) / 3 for k in range(len(vals))]
            ax.scatter(jitter, vals, s=10, alpha=0.6, color=("#4c72b0", "#55a868")[i - 1])
        ax.set_xticks([1, 2], ["Triton load", "gateway\nfirst response"])
        med = res["models"][model]["overhead_s"]["median"]
        ax.set_title(f"{model}\noverhead median {1000 * med:.0f} ms", fontsize=9)
        ax.set_ylabel("seconds")
        ax.set_ylim(bottom=0)
    return _save(fig, path)


def plot_batching(res: dict[str, Any], path: Path) -> str:
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
    return _save(fig, path)


def plot_scale_to_zero(res: dict[str, Any], path: Path) -> str:
    fig, ax = plt.subplots(figsize=(8, 3.4))
    t = [s[0] for s in res["samples"]]
    v = [s[1] for s in res["samples"]]
    ax.plot(t, v, lw=1.2, color="#4c72b0")
    colors = {"wake": "#55a868", "idle": "#dd8452", "unloaded": "#c44e52"}
    for i, ev in enumerate(res["events_s"]):
        for name, color in colors.items():
            ax.axvline(ev[name], color=color, ls="--", lw=0.8, label=name if i == 0 else None)
        ax.axvspan(ev["ready"], ev["idle"], color="#55a868", alpha=0.1, label="traffic" if i == 0 else None)
    ax.axhline(res["rss_mib"]["before"], color="black", lw=0.6, ls=":", label="before")
    ax.set_xlabel("seconds")
    ax.set_ylabel("Triton tree RSS (MiB)")
    ax.set_title(f"{res['model']}: idle_timeout {res['settings']['idle_timeout_secs']} s", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    return _save(fig, path)


PLOTS = {
    "gateway": plot_gateway,
    "coldstart": plot_coldstart,
    "batching": plot_batching,
    "scale_to_zero": plot_scale_to_zero,
}


def write_plots(results: dict[str, Any], plot_dir: Path) -> dict[str, str]:
    out = {}
    for name, fn in PLOTS.items():
        if name in results["sections"]:
            out[name] = fn(results["sections"][name], plot_dir / f"{name}.png")
    return out


# ------------------------------------------------------------------------------ markdown


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _ms(s: float) -> str:
    return f"{1000 * s:.0f} ms"


def _summary_lines(sec: dict[str, Any]) -> list[str]:
    out = []
    if g := sec.get("gateway"):
        r = g["ratios"]
        out.append(
            "- **Gateway** throughput vs direct Triton (c=1 / 8 / 32): gRPC "
            + " / ".join(f"{r[f'grpc_c{c}']['gateway_vs_direct']:.2f}" for c in (1, 8, 32))
            + ", HTTP "
            + " / ".join(f"{r[f'http_c{c}']['gateway_vs_direct']:.2f}" for c in (1, 8, 32))
            + "; the bare Envoy hop: gRPC "
            + " / ".join(f"{r[f'grpc_c{c}']['bare_envoy_vs_direct']:.2f}" for c in (1, 8, 32))
            + ", HTTP "
            + " / ".join(f"{r[f'http_c{c}']['bare_envoy_vs_direct']:.2f}" for c in (1, 8, 32))
            + f". Added p50 at c=1: gateway {r['grpc_c1']['gateway_added_p50_ms']:.2f} ms (gRPC), "
            f"{r['http_c1']['gateway_added_p50_ms']:.2f} ms (HTTP)."
        )
    if c := sec.get("coldstart"):
        parts = [
            f"{m} {v['first_response_vs_triton_load']:.2f}x (+{_ms(v['overhead_s']['median'])})"
            for m, v in c["models"].items()
        ]
        out.append(
            "- **Cold start** through the gateway vs Triton's own load time (median over "
            f"{c['cycles']} cycles): " + ", ".join(parts) + "."
        )
    if b := sec.get("batching"):
        parts = []
        for m, v in b["models"].items():
            last = v["rows"][-1]
            parts.append(
                f"{m} {last['triton_vs_inprocess']:.3f} of in-process at c={last['concurrency']} "
                f"(mean batch {last['mean_executed_batch']})"
            )
        out.append(
            "- **Batching** (Triton rows/s / in-process predict rows/s, same batch size): " + "; ".join(parts) + "."
        )
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
    if z := sec.get("scale_to_zero"):
        ret = z["loaded_increment_returned"]
        out.append(
            f"- **Scale to zero** ({z['model']}): Triton tree RSS after idle unload / before = "
            f"{z['after_vs_before']:.3f} "
            f"({'within' if z['after_within_5pct_of_before'] else 'NOT within'} 5%); "
            + (f"{100 * ret:.1f}% of the loaded increment returned." if ret is not None else "")
        )
    if s := sec.get("scale"):
        cp = s["control_plane"]
        n = s["models"]
        out.append(
            f"- **Scale** ({n} models): render {s['render']['per_model_ms']:.1f} ms/model, static validation "
            f"{s['validate_static']['per_model_ms']:.0f} ms/model; control-plane RSS {n} vs 0 models "
            f"{cp[f'rss_{n}_vs_0_models']:.3f}x; idle CPU {100 * cp[f'idle_cpu_share_{n}_models']:.1f}% of one core."
        )
    return out


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
            f"({b32['added_us_per_request']} us added per request). Of the runtime's cost, the hand-off to the user "
            f"thread that enforces request_timeout_secs is {micro['handoff_us']} us per execute.",
            "",
        ]
    return [
        "### snoozeml's runtime vs a hand-written python-backend model",
        "",
        f"{rc['model']}. All in one Triton (max_batch_size {st['max_batch_size']}); the runtime as rendered "
        f"(request_timeout_secs {st['request_timeout_secs']}: predict runs on a user thread that the limit needs) "
        "and with request_timeout_secs null (predict on the stub's own thread). Batch-1 gRPC requests straight to "
        f"Triton carrying the gateway's request-id header; {st['pairs']} interleaved rounds of {st['seconds']} s per "
        "model and concurrency (the order rotates), medians of the per-round values. Added ms at c=1 = "
        "1/rps(runtime) - 1/rps(hand-written) (the target's measure); added p50 = the same from median latencies, "
        "which a stalled round moves less; compute added = the difference of Triton's compute_infer per request "
        "(the stub's execute as Triton sees it). Load average (1 min) "
        f"{rc['load_average_start'][0]:.2f} at the start, {rc['load_average_end'][0]:.2f} at the end.",
        "",
        _table(
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


def markdown(results: dict[str, Any], plots: dict[str, str], plot_rel: str) -> str:
    m = results["machine"]
    sec = results["sections"]
    lines = [
        "# snoozeml benchmark report",
        "",
        f"Generated by `{results['command']}` on {results['started']} in {results['wall_s']:.0f} s. Every figure is"
        " measured in the same run as its comparison. **Ratios first**; absolute numbers are from this machine:",
        "",
        f"> {m['cpu_model']}, {m['cores']} cores, {m['memory_gib']} GiB RAM, Python {m['python']}, {m['platform']}.",
        f"> Load average at start {m['load_average']}, at end {results['load_average_end']}: this machine is shared"
        " (other test suites run on it), so absolute numbers are noisy; ratios taken back to back are steadier.",
        "",
        "Sections (wall time, finished): "
        + "; ".join(
            f"{k} {v['wall_s']:.0f} s, {v['finished']}" + (" (quick)" if v.get("quick") else "")
            for k, v in results.get("section_meta", {}).items()
            if k in sec
        )
        + ". A run with `--only` re-measures those sections and keeps the others from earlier runs.",
        "",
        "## Summary",
        "",
        *_summary_lines(sec),
        "",
    ]
    if results.get("quick"):
        lines[2:2] = ["**Quick mode** (smoke test): short durations, few cycles; not for quoting.", ""]
    if g := sec.get("gateway"):
        lines += [
            "## Gateway vs direct Triton",
            "",
            f"Model: {g['model']}. Each cell: {g['settings']['seconds']} s after {g['settings']['warmup_secs']} s of "
            "warm-up, closed loop (`c` requests in flight), load generator in its own process "
            f"({g['settings']['client']}). `bare_envoy` is Envoy with one route per port (the price of any hop); "
            "`gateway` is the snoozeml Envoy as served (auth on, retry-to-activator routes); `client_ceiling` is "
            "Envoy answering by itself (direct response): the most this client can drive on this machine. "
            f"Retries to the activator during the run: {g['gateway_retries_during_run']} (warm traffic never "
            "touches Python).",
            "",
            _table(
                [
                    "protocol",
                    "c",
                    "gateway/direct",
                    "bare/direct",
                    "gateway/bare",
                    "+p50 gateway (ms)",
                    "+p50 bare (ms)",
                    "direct/client ceiling",
                    "client-bound?",
                ],
                [
                    [
                        k.split("_")[0],
                        k.split("_c")[1],
                        v["gateway_vs_direct"],
                        v["bare_envoy_vs_direct"],
                        v["gateway_vs_bare_envoy"],
                        v["gateway_added_p50_ms"],
                        v["bare_envoy_added_p50_ms"],
                        v["direct_share_of_client_ceiling"],
                        "yes" if v["client_bound"] else "no",
                    ]
                    for k, v in g["ratios"].items()
                ],
            ),
            "",
            "Absolute numbers:",
            "",
            _table(
                ["protocol", "c", "target", "req/s", "p50 ms", "p99 ms", "errors"],
                [
                    [r["protocol"], r["concurrency"], r["target"], r["rps"], r["p50_ms"], r["p99_ms"], r["errors"]]
                    for r in g["rows"]
                ],
            ),
            "",
        ]
        if "gateway" in plots:
            lines += [f"![gateway]({plot_rel}/{plots['gateway']})", ""]
    if c := sec.get("coldstart"):
        lines += [
            "## Cold start: first response through the gateway vs Triton's load time",
            "",
            f"{c['cycles']} cycles per model (plus one uncounted warm-up cycle), models interleaved. "
            "Each cycle unloads "
            "the model through the lifecycle manager, then times one HTTP inference through the gateway on an open "
            "connection (404 from Triton -> Envoy retry -> activator -> load -> forward). `Triton load` is the "
            "duration of the very `TritonAdminClient.load` call the lifecycle made for that request; overhead = "
            "first response - Triton load, per cycle. The fair baseline for a first response is Triton's load "
            "plus the first inference of a fresh python stub (tens of ms inside Triton itself), measured straight "
            "against Triton in the same cycle: `vs direct` = first response - (direct load + direct first inference).",
            "",
            _table(
                [
                    "model",
                    "first response / Triton load",
                    "Triton load median / p90 / max",
                    "first response median / p90 / max",
                    "overhead median / p90 / max",
                    "direct load + first infer median",
                    "vs direct median / p90",
                ],
                [
                    [
                        f"{mdl} ({v['description']})",
                        v["first_response_vs_triton_load"],
                        " / ".join(_ms(v["triton_load_s"][k]) for k in ("median", "p90", "max")),
                        " / ".join(_ms(v["first_response_s"][k]) for k in ("median", "p90", "max")),
                        " / ".join(_ms(v["overhead_s"][k]) for k in ("median", "p90", "max")),
                        _ms(v["direct_load_and_first_infer_s"]["median"]),
                        " / ".join(_ms(v["overhead_vs_direct_s"][k]) for k in ("median", "p90")),
                    ]
                    for mdl, v in c["models"].items()
                ],
            ),
            "",
        ]
        if "coldstart" in plots:
            lines += [f"![cold start]({plot_rel}/{plots['coldstart']})", ""]
    if b := sec.get("batching"):
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
                _table(
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
        if "batching" in plots:
            lines += [f"![batching]({plot_rel}/{plots['batching']})", ""]
        lines += _runtime_cost_lines(b.get("runtime_vs_handwritten"))
    if z := sec.get("scale_to_zero"):
        r = z["rss_mib"]
        lines += [
            "## Scale to zero: Triton process-tree memory",
            "",
            f"{z['model']}, idle_timeout {z['settings']['idle_timeout_secs']} s, {z['settings']['cycles']} cycles of "
            f"wake -> {z['settings']['traffic']} -> idle unload; RSS of tritonserver and its stubs sampled every "
            f"{int(1000 * z['settings']['sample_interval_secs'])} ms.",
            "",
            _table(
                [
                    "before (MiB)",
                    "loaded median (MiB)",
                    "loaded peak (MiB)",
                    "after each cycle (MiB)",
                    "after / before",
                    "within 5%?",
                    "loaded increment returned",
                    "last after / first after",
                ],
                [
                    [
                        r["before"],
                        r["loaded_median"],
                        r["loaded_peak"],
                        ", ".join(map(str, r["after_each_cycle"])),
                        z["after_vs_before"],
                        "yes" if z["after_within_5pct_of_before"] else "no",
                        z["loaded_increment_returned"],
                        z["last_cycle_after_vs_first_cycle_after"],
                    ]
                ],
            ),
            "",
            f"Wake-up (first request) {', '.join(f'{v:.2f} s' for v in z['first_request_s'])}; idle unload came "
            f"{', '.join(f'{v:.1f} s' for v in z['idle_unload_after_traffic_s'])} after traffic stopped; errors "
            f"{z['errors']}.",
            "",
        ]
        if not z["after_within_5pct_of_before"]:
            lines += [
                "`before` is a freshly started tritonserver that has never loaded a python-backend model; the "
                "first load maps the python backend library into the server process and it stays there. "
                "Compare `last after / first after` for growth per cycle.",
                "",
            ]
        if "scale_to_zero" in plots:
            lines += [f"![scale to zero]({plot_rel}/{plots['scale_to_zero']})", ""]
    if s := sec.get("scale"):
        n = s["models"]
        cp, rd, vd = s["control_plane"], s["render"], s["validate_static"]
        lines += [
            f"## Scale: {n} published models",
            "",
            _table(
                ["measure", "value"],
                [
                    [
                        f"render + write {n} tiny numpy packages",
                        f"{rd['total_s']} s ({rd['per_model_ms']} ms/model: resolve "
                        f"{rd['resolve_s']} s, render {rd['render_s']} s, write {rd['write_s']} s)",
                    ],
                    [
                        f"static validation of {vd['models']} of them",
                        f"{vd['total_s']} s ({vd['per_model_ms']} ms/model; {vd['note']}; ok={vd['ok']})",
                    ],
                    [
                        f"control-plane RSS, {n} vs 0 models",
                        f"{cp[f'rss_{n}_vs_0_models']}x ({cp[f'rss_mib_{n}_models']} vs "
                        f"{cp['rss_mib_0_models']} MiB, {cp['rss_kib_per_published_model']} KiB per model)",
                    ],
                    [
                        f"control-plane idle CPU, {n} models",
                        f"{100 * cp[f'idle_cpu_share_{n}_models']:.2f}% of one core "
                        f"(0 models: {100 * cp['idle_cpu_share_0_models']:.2f}%; {cp['idle_window_s']} s window, "
                        "sweep every "
                        f"{cp['sweep_interval_secs']} s)",
                    ],
                    [
                        f"Triton idle CPU, {n} models (the sweeper's polls)",
                        f"{100 * cp[f'triton_idle_cpu_share_{n}_models']:.2f}%",
                    ],
                    ["stack start, 0 / n models", f"{cp['start_s_0_models']} s / {cp[f'start_s_{n}_models']} s"],
                ],
            ),
            "",
            f"The control plane is measured in a fresh `ServingStack` process: {cp['process']}.",
            "",
        ]
    if nat := sec.get("native"):
        lines += ["## Native (ONNX export) vs custom torch", "", "```", _json_block(nat), "```", ""]
    lines += [
        "Raw numbers: `report.json` next to this file. Re-run: `make bench` (9-13 minutes on 2 cores) or "
        "`python -m bench --quick` / `--only SECTION`.",
        "",
    ]
    return "\n".join(lines)


def _json_block(data: Any) -> str:
    import json

    return json.dumps(data, indent=1)[:4000]
