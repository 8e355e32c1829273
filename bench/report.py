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


def plot_keepalive(res: dict[str, Any], path: Path) -> str:
    traces = list(res["traces"].items())
    cols = min(4, len(traces))
    rows_n = -(-len(traces) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(3.3 * cols, 3.0 * rows_n), squeeze=False)
    for ax in axes.flat[len(traces) :]:
        ax.axis("off")
    for ax, (name, tr) in zip(axes.flat, traces, strict=False):
        rows = tr["rows"]
        fixed = [r for r in rows if r["policy"].startswith("fixed")]
        ax.plot(
            [r["loaded_pct"] for r in fixed],
            [r["cold"] for r in fixed],
            "o-",
            color="#4c72b0",
            ms=4,
            label="fixed timeout",
        )
        for r in fixed:
            ax.annotate(
                r["policy"].split()[1],
                (r["loaded_pct"], r["cold"]),
                fontsize=6,
                xytext=(3, 3),
                textcoords="offset points",
            )
        for policy, style, color in (("always-on", "s", "black"), ("adaptive", "*", "#c44e52")):
            r = next(x for x in rows if x["policy"] == policy)
            ax.plot(
                [r["loaded_pct"]], [r["cold"]], style, color=color, ms=10 if policy == "adaptive" else 5, label=policy
            )
        ax.set_yscale("symlog", linthresh=1)  # 0 and 1 cold start stay visible next to thousands
        ax.set_ylim(-0.3, 2 * tr["requests"])
        ax.set_xlim(-3, 103)
        ax.set_title(f"{name} ({tr['requests']} requests)", fontsize=8)
        ax.set_xlabel("loaded, % of time", fontsize=7)
        ax.set_ylabel("client-visible cold starts", fontsize=7)
        ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=6, loc="lower left")
    return _save(fig, path)


POLICY_COLORS = {"affine": "#4c72b0", "round_robin": "#dd8452"}


def plot_fleet(res: dict[str, Any], path: Path) -> str:
    fig, axes = plt.subplots(2, 1, figsize=(8, 5.4), sharex=True)
    seen: dict[str, int] = {}
    for phase in res["phases"]:
        policy = phase["policy"]
        seen[policy] = seen.get(policy, 0) + 1
        t = [s[0] for s in phase["samples"]]
        style = "-" if seen[policy] == 1 else "--"
        label = f"{policy} #{seen[policy]}"
        axes[0].plot(t, [s[1] for s in phase["samples"]], style, color=POLICY_COLORS[policy], lw=1.2, label=label)
        axes[1].plot(t, [s[2] for s in phase["samples"]], style, color=POLICY_COLORS[policy], lw=1.2, label=label)
    st = res["settings"]
    axes[0].set_ylabel("loaded instances\n(all nodes)")
    axes[1].set_ylabel("memory of loaded\nmodels (MiB)")
    axes[1].set_xlabel("seconds into the phase (same trace every phase)")
    axes[0].set_title(
        f"{st['nodes']} nodes, {st['models']} models, Zipf s={st['zipf_s']}, {st['rate_rps']:g} req/s, "
        f"idle_timeout {st['idle_timeout_secs']:g} s",
        fontsize=10,
    )
    for ax in axes:
        ax.axvline(st["seconds"], color="black", lw=0.6, ls=":")
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=7, loc="lower right")
    return _save(fig, path)


PLOTS = {
    "gateway": plot_gateway,
    "coldstart": plot_coldstart,
    "batching": plot_batching,
    "scale_to_zero": plot_scale_to_zero,
    "keepalive": plot_keepalive,
    "keepalive_replay": plot_keepalive,
    "fleet": plot_fleet,
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


def _ms2(s: float) -> str:
    return f"{1000 * s:.2f} ms"


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
        if (w := _worker_summary(c)) is not None:
            out.append(w)
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
        if t := b.get("torch_workers"):
            pf = t["variants"]["torch-mlp-preforked"]
            out.append(
                f"- **Preforked per request** (the torch example, c=1): +{pf['c1_p50_added_ms']:.3f} ms p50 "
                f"(+{pf['c1_compute_added_us']:.0f} µs of Triton compute) over the stub; at c=32 "
                f"{pf['c32_vs_in_stub']:.2f}x the stub's throughput."
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
    if r := sec.get("recovery"):
        t = r["topologies"]
        out.append(
            "- **Recovery** after a model process dies (median of "
            f"{r['cycles']} cycles): killed while idle, back on a new process in "
            + ", ".join(f"{_ms(t[k]['recovered']['median'])} ({k})" for k in t)
            + "; a poison request's client told in "
            + ", ".join(f"{_ms(t[k]['error']['median'])} ({k})" for k in t)
            + "."
        )
    if k := sec.get("keepalive"):
        out.append(_keepalive_summary(k))
    if live := sec.get("keepalive_live"):
        a, f = live["policies"]["adaptive"], live["policies"]["fixed"]
        out.append(
            f"- **Keep-alive, live** (a caller every {live['period_s']:g} s, idle timeout "
            f"{live['idle_timeout_s']:g} s, {live['requests']} requests through the gateway): adaptive served "
            f"{a['warm_pct']:.0f}% warm "
            f"({a['warm_after_learning']} of the {a['requests_after_learning']} after it learned), loaded "
            f"{a['loaded_pct']:.0f}% of the time, {a['prewarm_loads']} pre-warms ({a['prewarm_wasted']} wasted); "
            f"fixed {f['warm_pct']:.0f}% warm, loaded {f['loaded_pct']:.0f}%."
        )
    later = (("fleet", _fleet_summary), ("streaming", _streaming_summary))
    out += [line(sec[name]) for name, line in later if sec.get(name)]
    return out


def _streaming_summary(st: dict[str, Any]) -> str:
    return (
        f"- **Streaming** (a decoupled model, median of {st['cycles']} interleaved cycles): a warm stream's "
        f"tokens/s through the gateway vs direct Triton: gRPC {st['grpc_gateway_over_direct']:.2f}x, SSE "
        f"{st['sse_gateway_over_direct']:.2f}x; first token on a sleeping model "
        f"{st['first_token_overhead_ms']:+.1f} ms over Triton's own load + first token."
    )


def _fleet_summary(f: dict[str, Any]) -> str:
    st, a, r, hop = f["settings"], f["policies"]["affine"], f["policies"]["round_robin"], f["hop"]["ratios"]
    return (
        f"- **Fleet** ({st['nodes']} nodes, {st['models']} models, Zipf s={st['zipf_s']} at {st['rate_rps']:g} req/s, "
        f"idle_timeout {st['idle_timeout_secs']:g} s, same trace): model-affine routing held "
        f"{a['mean_memory_mib']:.0f} MiB of loaded models on average vs {r['mean_memory_mib']:.0f} MiB for round robin "
        f"(**{f['ratios']['mean_memory_affine_vs_rr']:.2f}x**, second half of the trace "
        f"{f['ratios']['second_half_memory_affine_vs_rr']:.2f}x; peak {a['peak_memory_mib']:.0f} vs "
        f"{r['peak_memory_mib']:.0f} MiB, instances {a['mean_instances']:.1f} vs {r['mean_instances']:.1f}), "
        f"client-visible cold starts {a['client_cold_starts']} vs {r['client_cold_starts']}, p50 / p99 "
        f"{a['p50_ms']:.1f} / {a['p99_ms']:.0f} ms vs {r['p50_ms']:.1f} / {r['p99_ms']:.0f} ms. The fleet hop adds "
        f"{hop['grpc_c1']['added_p50_ms']:.2f} ms p50 at c=1 (gRPC; HTTP {hop['http_c1']['added_p50_ms']:.2f} ms), "
        f"throughput vs the node's own gateway {hop['grpc_c1']['throughput_fleet_vs_node']:.2f} (c=1) / "
        f"{hop['grpc_c8']['throughput_fleet_vs_node']:.2f} (c=8)."
    )


def _worker_summary(c: dict[str, Any]) -> str | None:
    m, mem = c["models"], c.get("memory") or {}
    if not {"torch-mlp", "torch-mlp-preforked"} <= set(m):
        return None
    n = c.get("memory_copies")
    text = (
        "- **Preforked workers** (the torch example): first response through the gateway "
        f"{_ms(m['torch-mlp-preforked']['first_response_s']['median'])} preforked vs "
        f"{_ms(m['torch-mlp']['first_response_s']['median'])} in the stub"
    )
    if "torch-mlp-onnx" in m:
        text += f" and {_ms(m['torch-mlp-onnx']['first_response_s']['median'])} as ONNX"
    if {"torch-mlp", "torch-mlp-preforked"} <= set(mem):
        pf, stub = mem["torch-mlp-preforked"][f"{n}_loaded"], mem["torch-mlp"][f"{n}_loaded"]
        text += (
            f"; {n} copies loaded take {pf['pss_mib']:.0f} MiB preforked vs {stub['pss_mib']:.0f} MiB in the stub "
            f"(PSS, {pf['pss_mib'] / stub['pss_mib']:.2f}x)"
        )
    return text + "."


def _eviction_summary(ev: dict[str, Any]) -> str:
    d = ev["default_policy"]
    parts = [
        f"{t} {100 * tr['sized']['verdict']['hit_ratio_minus_lru']:+.1f} points "
        f"(cold-start s x{tr['sized']['verdict']['cold_start_s_vs_lru']})"
        for t, tr in ev["traces"].items()
    ]
    met = sum(tr["sized"]["verdict"]["ok"] and tr["unit"]["verdict"]["ok"] for tr in ev["traces"].values())
    return (
        f"- **Eviction** (virtual-time replay, {ev['budget_mib']:g} MiB budget): {d} at or above LRU's hit ratio "
        f"on {met} of {len(ev['traces'])} traces (sized and unit-sized); {d} vs LRU: " + "; ".join(parts) + "."
    )


def _churn_summary(c: dict[str, Any]) -> str:
    st = c["settings"]
    parts = [
        f"{name}: {p['answers']} answers ({p['answers_per_s']}/s), hot p50 {p['hot_p50_ms']} ms, unload median "
        f"{_ms(p['unload_median_s']) if p['unload_median_s'] is not None else '-'}, {p['errors']} errors, "
        f"{p['wrong_answers']} wrong"
        for name, p in c["policies"].items()
    ]
    return (
        f"- **Churn** ({st['models']} models x {st['ballast_mb']} MiB under {st['budget_mb']:g} MiB, "
        f"{st['seconds']:g} s per policy): " + "; ".join(parts) + "."
    )


def _churn_lines(c: dict[str, Any] | None) -> list[str]:
    if not c or not c.get("policies"):
        return []
    st, pol = c["settings"], c["policies"]
    skipped = st["policies_skipped"]
    skipped = f" Policies this build does not know: {', '.join(skipped)}." if skipped else ""
    return [
        "## Churn: many models in little memory, the eviction policies side by side",
        "",
        f"One node (the embedded stack, auth on, autoscaling off), `SNOOZE_MEMORY_BUDGET_MB={st['budget_mb']:g}`, "
        f"{st['models']} custom models each holding {st['ballast_mb']} MiB of touched numpy memory; {st['clients']} "
        f"closed-loop clients pick models by Zipf(s={st['zipf_s']:g}) (seed {st['seed']}; the {st['hot_models']} "
        f"most requested get {100 * st['hot_traffic_share']:.0f}% of the requests) and send one request at a time "
        "through the gateway, HTTP or gRPC at random (tritonclient aio); every answer's value is checked (the "
        "version published when it was sent, or a newer one being published meanwhile). A model is republished "
        f"every {st['republish_secs']:g} s (hot models first). One fresh stack per policy, the same traffic, "
        f"{st['seconds']:g} s each, one after the other. `unload` is timed from its start until the model's memory "
        "is free (`ended`: its processes were ended once Triton had taken it out of service, "
        "`controlplane/lifecycle/unloading.py`); the tree is tritonserver and its model processes, sampled every "
        f"0.1 s.{skipped}",
        "",
        _table(
            [
                "policy",
                "answers",
                "answers/s",
                "errors",
                "wrong",
                "hot p50 / p99 ms",
                "rest p50 / p99 ms",
                "cold starts",
                "evictions",
                "swaps/s",
                "unload median / p90 / max ms (ended of all)",
                "peak tree RSS MiB (models' processes)",
                "peak tree Pss MiB (what the budget counts)",
                "republishes ok",
                "load average (1 min) start / end",
            ],
            [
                [
                    name,
                    p["answers"],
                    p["answers_per_s"],
                    p["errors"],
                    p["wrong_answers"],
                    f"{p['hot_p50_ms']} / {p['hot_p99_ms']}",
                    f"{p['rest_p50_ms']} / {p['rest_p99_ms']}",
                    p["cold_starts"],
                    p["evictions"],
                    p["swaps_per_s"],
                    (
                        f"{1000 * p['unload_median_s']:.0f} / {1000 * p['unload_p90_s']:.0f} / "
                        f"{1000 * p['unload_max_s']:.0f} ({p['unloads_ended']} of {p['unloads']})"
                    )
                    if p["unloads"]
                    else "-",
                    f"{p['peak_tree_mib']:.0f} ({p['peak_model_processes_mib']:.0f})",
                    (
                        f"{p['peak_tree_pss_mib']:.0f} vs {st['budget_mb']:g} budget"
                        if "peak_tree_pss_mib" in p
                        else "-"
                    ),
                    f"{p['republishes_ok']} of {len(p['republishes'])}",
                    f"{p['load_average_start'][0]} / {p['load_average_end'][0]}",
                ]
                for name, p in pol.items()
            ],
        ),
        "",
        *(f"- {name}: errors {p['error_examples']}" for name, p in pol.items() if p["error_examples"]),
        *(f"- {name}: wrong answers {p['wrong_examples']}" for name, p in pol.items() if p["wrong_examples"]),
        *(
            f"- {name}: unloads that took Triton's own way, by reason: {p['unloads_waited_why']}"
            for name, p in pol.items()
            if p.get("unloads_waited_why")
        ),
        "",
    ]


def _eviction_lines(ev: dict[str, Any] | None) -> list[str]:
    if not ev:
        return []
    d = ev["default_policy"]
    lines = [
        "## Eviction policies replayed in virtual time",
        "",
        "The policy code the lifecycle runs (`controlplane/lifecycle/memory/eviction.py`, driven through the calls "
        f"`MemoryBudget` makes) over request traces ({ev['source']}), on a budget of {ev['budget_mib']:g} MiB; "
        "models of 20-250 MiB loading in 0.07-2.4 s (`bench/eviction_replay.py`). A miss evicts in the policy's "
        "order until the model fits and charges its client the model's load time. Unit-sized: every model the "
        f"same size, the budget {ev['unit_slots']} models, where Belady's offline optimum is the most hits "
        f"possible. Replay time {ev['replay_wall_s']:.1f} s.",
        "",
        f"**The issue's test**: the default ({d}) at or above LRU's hit ratio on every trace: "
        + ("met." if ev["ok"] else "**not met**."),
        "",
        _table(
            [
                "trace",
                "requests (models)",
                "sizes",
                "policy",
                "hit ratio",
                "loads",
                "client cold-start s",
                f"{d} - LRU hit ratio",
                "of optimum",
            ],
            [
                [
                    f"{t} ({tr['description']})" if kind == "sized" and i == 0 else "",
                    f"{tr['requests']} ({tr['models']})" if kind == "sized" and i == 0 else "",
                    kind if i == 0 else "",
                    r["policy"],
                    f"{r['hit_ratio']:.3f}",
                    r["loads"],
                    r["cold_start_s"],
                    f"{100 * tr[kind]['verdict']['hit_ratio_minus_lru']:+.1f} pts" if r["policy"] == d else "",
                    (
                        f"{tr[kind]['verdict']['hit_ratio_of_optimum']:.2f}"
                        if r["policy"] == d
                        else f"{tr[kind]['verdict']['lru_hit_ratio_of_optimum']:.2f}"
                        if r["policy"] == "lru"
                        else ""
                    )
                    if "hit_ratio_of_optimum" in tr[kind]["verdict"]
                    else "",
                ]
                for t, tr in ev["traces"].items()
                for kind in ("sized", "unit")
                for i, r in enumerate(tr[kind]["rows"])
            ],
        ),
        "",
    ]
    return lines


def _keepalive_summary(k: dict[str, Any]) -> str:
    met = [t for t, tr in k["traces"].items() if tr["verdict"]["ok"]]
    parts = []
    for t, tr in k["traces"].items():
        a = tr["rows"][-1]
        near = tr["verdict"].get("nearest_cheaper_fixed")
        versus = f" vs {near['cold']} for {near['policy']} ({near['loaded_pct']:.1f}%)" if near else ""
        parts.append(f"{t} {a['cold']} ({a['loaded_pct']:.1f}% loaded){versus}")
    return (
        f"- **Keep-alive** (virtual-time replay): adaptive has fewer client-visible cold starts than every fixed "
        f"timeout using no more memory on {len(met)} of {len(k['traces'])} traces. Cold starts of adaptive (loaded "
        "share of time) vs the fixed timeout with the most memory at or below it: " + "; ".join(parts) + "."
    )


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
        *([_eviction_summary(sec["eviction"])] if "eviction" in sec else []),
        *([_churn_summary(sec["churn"])] if sec.get("churn", {}).get("policies") else []),
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
            f"{c['cycles']} cycles per model "
            f"({'plus one uncounted warm-up cycle' if c.get('warmup_cycle', True) else 'no warm-up cycle: --quick'}), "
            "models interleaved. "
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
        lines += _coldstart_decomposition(c)
        lines += _prewarm_lines(c)
        if "coldstart" in plots:
            lines += [f"![cold start]({plot_rel}/{plots['coldstart']})", ""]
        lines += _memory_lines(c)
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
        lines += _torch_worker_lines(b.get("torch_workers"))
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
                    *(
                        [
                            [
                                f"`snoozectl validate` of {vd['models']} of them (a fresh process, as CI runs it)",
                                f"{vd['cli_total_s']} s, exit code {vd['cli_exit_code']} ({vd['cores']} cores, load "
                                f"average {vd['load_average_start']} at the start)",
                            ]
                        ]
                        if "cli_total_s" in vd
                        else []
                    ),
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
    lines += _recovery_lines(sec.get("recovery"))
    lines += _streaming_lines(sec.get("streaming"))
    lines += _gateway_filters_lines(sec.get("gateway_filters"))
    lines += _gateway_filters_lines(sec.get("gateway_targets"), section="gateway_targets")
    lines += _gateway_filters_lines(sec.get("gateway_routes"), section="gateway_routes")
    lines += _envoy_cpu_lines(sec.get("envoy_cpu"))
    lines += _envoy_instructions_lines(sec.get("envoy_instructions"))
    lines += _keepalive_sections(sec, plots, plot_rel)
    lines += _keepalive_live_lines(sec.get("keepalive_live"))
    lines += _fleet_lines(sec.get("fleet"), plots, plot_rel)
    lines += _eviction_lines(sec.get("eviction"))
    lines += _churn_lines(sec.get("churn"))
    if nat := sec.get("native"):
        lines += ["## Native (ONNX export) vs custom torch", "", "```", _json_block(nat), "```", ""]
    lines += [
        "Raw numbers: `report.json` next to this file. Re-run: `make bench` (15-20 minutes on 2 cores) or "
        "`python -m bench --quick` / `--only SECTION`.",
        "",
    ]
    return "\n".join(lines)


def _memory_lines(c: dict[str, Any]) -> list[str]:
    memory = c.get("memory")
    if not memory:
        return []
    n = c["memory_copies"]
    rows = []
    for model, m in memory.items():
        one, many = m["1_loaded"], m[f"{n}_loaded"]
        rows.append([
            model, one["accounted_mib"], one["pss_mib"], many["accounted_mib"], many["pss_mib"],
            round(many["pss_mib"] / n, 1), many["parents_pss_mib"] or "-",
        ])  # fmt: skip
    return [
        f"**Memory of the torch example loaded** (MiB; one copy, then {n} copies loaded together, nothing else "
        "loaded). `accounted`: what the lifecycle charges (the models' memory_bytes: stub RSS, plus a preforked "
        "worker's USS; plus the preloaded parent, counted once). `PSS`: the kernel's proportional set size summed "
        "over the stubs, workers and parent (shared pages split between the processes that map them): what they "
        "take together.",
        "",
        _table(
            ["model", "1: accounted", "1: PSS", f"{n}: accounted", f"{n}: PSS", f"{n}: PSS per copy", "parent PSS"],
            rows,
        ),
        "",
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
        _table(
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


def _json_block(data: Any) -> str:
    import json

    return json.dumps(data, indent=1)[:4000]


def _coldstart_decomposition(c: dict[str, Any]) -> list[str]:
    """A first response split into Triton's load, the fresh stub's first inference, and snoozeml's share."""
    keys = ("direct_load_s", "direct_first_infer_s", "overhead_vs_direct_s")
    rows = [
        [m, *(_ms(v["decomposition_s"][k]["median"]) for k in keys), _ms(v["first_response_s"]["median"])]
        for m, v in c["models"].items()
        if v.get("decomposition_s")
    ]
    if not rows:  # a report.json from before the decomposition was measured
        return []
    la = c.get("load_average", {})
    return [
        "Decomposition of a first response (medians; Triton's load and the first inference of a fresh stub are "
        "measured straight against Triton in the same cycle; the rest is snoozeml's lifecycle and gateway). Load "
        f"average at the section's start {la.get('start')}, end {la.get('end')}.",
        "",
        _table(
            ["model", "Triton load", "first inference of a fresh stub", "lifecycle + gateway", "first response"],
            rows,
        ),
        "",
    ]


def _prewarm_lines(c: dict[str, Any]) -> list[str]:
    """The first request after a pre-warm (a load with no request waiting) against warm requests."""
    rows = [
        [
            m,
            _ms2(v["prewarmed_first_s"]["median"]),
            _ms2(v["prewarmed_first_s"]["p90"]),
            _ms2(v["warm_s"]["median"]),
            v["prewarmed_first_vs_warm"],
            _ms2(v["warm_after_gap_s"]["median"]) if v.get("warm_after_gap_s") else "-",
        ]
        for m, v in c["models"].items()
        if v.get("prewarmed_first_s")
    ]
    if not rows:  # a report.json from before this was measured
        return []
    lead = next((v["prewarm_lead_s"] for v in c["models"].values() if v.get("prewarm_lead_s")), None)
    gap = f"{lead:g} s" if lead else "a gap"
    return [
        "First request after a pre-warm: in each cycle the lifecycle loads the model with no request waiting (as "
        "the adaptive keep-alive's pre-warm does; the load runs the config's `model_warmup` inference); "
        f"{gap} later (a pre-warm runs ahead of the request it expects) one request, five warm ones back to back, "
        f"and, after another {gap} of idle, one more warm request (the control: after an idle gap every hop's "
        "thread has to wake up, warm model or not). All through the gateway on one open connection, medians over "
        "cycles.",
        "",
        _table(
            ["model", "first after pre-warm median", "p90", "warm median", "first / warm", f"warm after {gap} idle"],
            rows,
        ),
        "",
    ]


def _streaming_lines(st: dict[str, Any] | None) -> list[str]:
    if not st:
        return []
    cold, tps, first, open_ = st["cold_ms"], st["tokens_per_s"], st["warm_first_token_ms"], st["open_stream"]
    la = st.get("load_average", {})
    return [
        "## Streaming: generate_stream (SSE) and gRPC streams of a decoupled model",
        "",
        f"`bench/streaming.py`: {st['cycles']} cold cycles and {st.get('warm_cycles', st['cycles'])} warm ones, "
        "interleaved (gateway and direct in each cycle, the order rotating), medians; a "
        f"decoupled numpy model yielding {st['tokens']} one-token responses as fast as it can; one Python client "
        f"per stream, a new client per request. Load average at the start {la.get('start')}, at the end "
        f"{la.get('end')}.",
        "",
        _table(
            ["", "through the gateway", "direct to Triton", "gateway / direct"],
            [
                [
                    "gRPC stream, tokens/s (first token to last)",
                    tps["grpc_gateway"],
                    tps["grpc_direct"],
                    f"{st['grpc_gateway_over_direct']:.3f}",
                ],
                [
                    "SSE generate_stream, tokens/s",
                    tps["sse_gateway"],
                    tps["sse_direct"],
                    f"{st['sse_gateway_over_direct']:.3f}",
                ],
                ["gRPC stream, warm first token (ms)", first["grpc_gateway"], first["grpc_direct"], ""],
                ["SSE generate_stream, warm first token (ms)", first["sse_gateway"], first["sse_direct"], ""],
                [
                    "sleeping model, first token on a gRPC stream (ms)",
                    cold["gateway_first_token"],
                    f"{cold['triton_load']} load + {cold['direct_first_token']} first token",
                    f"{st['first_token_overhead_ms']:+.1f} ms",
                ],
            ],
        ),
        "",
        *_envoy_floor_lines(st),
        f"Warm streams let on by the wake filter without waiting for the activator (the model's ready flag): "
        f"{st.get('warm_holds', '-')}. A stream with a token every 0.5 s for {open_['seconds']} s on a model whose "
        f"idle timeout is {open_['idle_timeout_secs']} s: {open_['tokens']} tokens, the model "
        f"{open_['state_at_end']} at its end, unloaded {open_['unloaded_after_end_secs']} s after it.",
        "",
    ]


_GATEWAY_TARGET_NAMES = {
    "direct": "direct to Triton",
    "bare_envoy": "bare Envoy (router only)",
    "bare_envoy_auth": "bare Envoy with the same API key check (api_key_auth, then the router)",
    "gateway": "**the gateway, as served**",
    "gateway_twin": "twin: a second Envoy with the gateway's own bootstrap",
    "direct_with_id": "direct to Triton, the client sending x-request-id",
    "gateway_no_request_id": "gateway without a request id (Envoy's x-request-id not generated)",
    "gateway_no_retry": "gateway without the retry to the activator",
    "gateway_no_gate": "gateway without the snapshot gate route",
    "gateway_no_access_log": "gateway without the held-request access log",
    "gateway_no_auth": "gateway without api_key_auth, as `make serve` runs it (no keys; the client sends none)",
    "gateway_no_hints": "gateway without the shape hint (gRPC: its listener's filter; HTTP: its upstream matcher)",
    "gateway_no_wake": "gateway without the wake filters",
    "gateway_no_dead_stub": "gateway without the dead-stub marker (HTTP's upstream)",
    "gateway_no_filters": "gateway routes without any of these filters",
}


_GATEWAY_HEADINGS = {
    "gateway_filters": "## What each gateway filter costs a warm unary request",
    "gateway_targets": "## The gateway against a bare Envoy hop, many rounds (the warm path's targets)",
    "gateway_routes": "## What the gateway's routes cost a warm unary request besides filters",
}


def _gateway_filters_lines(gf: dict[str, Any] | None, *, section: str = "gateway_filters") -> list[str]:
    """The per-filter table (section gateway_filters), the gateway's targets alone (gateway_targets: direct, the
    bare hop, the gateway and its twin over many rounds) or what its routes do (gateway_routes)."""
    if not gf:
        return []
    st, la = gf["settings"], gf["load_average"]
    rows = [
        [
            r["protocol"],
            _GATEWAY_TARGET_NAMES.get(r["target"], r["target"]),
            r["c32_rps"],
            f"{r['c32_vs_bare_envoy']:.3f}",
            "{:.3f} to {:.3f}".format(*r["c32_vs_bare_envoy_iqr"]) if "c32_vs_bare_envoy_iqr" in r else "-",
            r["c1_p50_ms"],
            f"{r['c1_added_p50_ms']:+.3f}",
            *(r.get("c32_cpu_us", {}).get(part, "-") for part in ("envoy", "triton", "client")),
        ]
        for r in gf["table"]
    ]
    method = (
        f"per protocol and concurrency (1, 32), one client process drives every target in turn, {st['seconds']} s "
        f"each on new connections (after {st.get('slice_warmup_secs', 0.05)} s of warm-up on them), for "
        f"{st['rounds']} cycles (after "
        f"{st['warmup_secs']} s of warm-up per target first), the order rotating by one from cycle to cycle; "
        "medians over cycles of per-cycle numbers (throughput over the same cycle's bare hop, p50 over the same "
        "cycle's direct p50), with a 95 % confidence interval of the median (order statistics). CPU per request: "
        "user + system time of each process over a slice over the client's count of its successful requests, "
        "median over cycles. "
    )
    if st.get("restart_every"):
        method += (
            f"Every Envoy of the run, the served gateway too, was restarted after each {st['restart_every']} "
            f"cycles ({st['envoy_restarts']} times per Envoy), so what one process keeps for its life is one "
            "block's luck, not a target's. "
        )
    return [
        _GATEWAY_HEADINGS[section],
        "",
        f"`bench/gateway_filters.py` (section {section}): {method}"
        f"Client: {st['client']}. Load average at the start {la['start']}, at the end "
        f"{la['end']}. Lua runs in the served gateway over all these warm requests: {gf['gateway_lua_executions']}.",
        "",
        _table(
            [
                "protocol",
                "target",
                "c=32 req/s",
                "c=32 / bare Envoy",
                "its middle half of rounds",
                "c=1 p50 (ms)",
                "c=1 p50 over direct (ms)",
                "c=32 CPU µs per request: Envoy",
                "Triton and its model processes",
                "client",
            ],  # fmt: skip
            rows,
        ),
        "",
        *_gateway_filters_reading(gf["table"]),
        *_gateway_large_lines(gf.get("large"), st),
    ]


def _envoy_cpu_lines(ec: dict[str, Any] | None) -> list[str]:
    if not ec:
        return []
    st, la = ec["settings"], ec["load_average"]

    def iqr(r: dict[str, Any]) -> str:
        q = r["over_bare_iqr_us"]
        return f"{q[0]:+.1f} to {q[1]:+.1f}" if q else "-"

    rows = [
        [
            r["protocol"],
            _GATEWAY_TARGET_NAMES.get(r["target"], r["target"]),
            r["envoy_cpu_us"],
            f"{r['over_bare_us']:+.1f}" if r["over_bare_us"] is not None else "-",
            iqr(r),
        ]
        for r in ec["table"]
    ]
    return [
        "## Each gateway configuration's own CPU per request, Triton taken out",
        "",
        f"`bench/envoy_cpu.py`: every configuration in front of one Envoy that answers each request itself (no "
        f"Triton, no model); concurrency {st['concurrency']}, {st['rounds']} rounds of {st['seconds']} s per "
        "target, the order rotating; the Envoy under test's user + system CPU over its own downstream request count, "
        f"median over rounds. Envoy --concurrency {st['envoy_concurrency']}. Load average at the start {la['start']}, "
        f"at the end {la['end']}.",
        "",
        _table(
            ["protocol", "target", "Envoy CPU µs per request", "over the bare hop (µs)", "its middle half of rounds"],
            rows,
        ),
        "",
    ]


def _envoy_instructions_lines(ei: dict[str, Any] | None) -> list[str]:
    if not ei:
        return []
    st = ei["settings"]

    def signed(v: float | None) -> str:
        return "-" if v is None else f"{v / 1000:+.1f}k"

    rows = [
        [
            r["protocol"],
            _GATEWAY_TARGET_NAMES.get(r["target"], r["target"]),
            "-" if r["instructions_per_request"] is None else f"{r['instructions_per_request'] / 1000:.1f}k",
            signed(r["over_bare"]),
            "-" if r["over_bare_pct"] is None else f"{r['over_bare_pct']:+.1f} %",
            signed(r["gateway_minus_this"]),
            "-" if r["spread"] is None else f"{r['spread'] / 1000:.1f}k",
        ]
        for r in ei["table"]
    ]
    errors = sum(r["errors"] for r in ei["runs"])
    return [
        "## Each gateway configuration's instructions per request, counted (no noise)",
        "",
        "`python -m bench --only envoy_instructions` (`bench/envoy_cpu.py`, `run_instructions`): the configurations "
        "of the section above, each Envoy in turn under valgrind's callgrind (one worker), in front of an Envoy that "
        f"answers itself; per protocol {st['warmup_requests']} requests of warm-up, then {st['repeats']} times "
        f"{st['requests']} requests at concurrency {st['concurrency']} between a zeroing and a dump of its counters. "
        "Instructions are not time (a cache miss costs more than an add), but they do not move with the machine's "
        "other work: repeats agree to a few hundred. `the gateway's minus this` is what leaving that part out "
        "saves (rows without auth also save the key check). The gateway here has keys; its clients send the key, "
        f"keyless rows' clients none. Requests that failed: {errors}.",
        "",
        _table(
            [
                "protocol",
                "target",
                "instructions per request",
                "over the bare hop",
                "of the bare hop's",
                "the gateway's minus this",
                "spread over repeats",
            ],
            rows,
        ),  # fmt: skip
        "",
    ]


def _gateway_large_lines(large: dict[str, Any] | None, st: dict[str, Any]) -> list[str]:
    """A warm large gRPC request: the copy the gRPC retry keeps (every ModelInfer can be retried, no Lua reads
    its size) against the same gateway with HTTP's retry buffer (a large request not kept: no copy, no wake)."""
    if not large:
        return []
    p50, errors = large["p50_ms"], large["errors"]
    direct = p50["direct"]
    return [
        f"A warm {large['request_mib']:g} MiB gRPC ModelInfer (one client, {st['seconds'] * 2} s per target per "
        f"round, the same rounds, rotating; p50 of each round's requests, median over rounds): direct "
        f"{direct} ms; the gateway {p50['gateway_large']} ms ({p50['gateway_large'] - direct:+.2f} ms over "
        f"direct), where Envoy keeps a copy for the retry; the same gateway with HTTP's retry buffer for gRPC (no "
        f"copy, so no wake for it) {p50['gateway_large_no_copy']} ms "
        f"({p50['gateway_large_no_copy'] - direct:+.2f} ms). Errors: {errors}.",
        "",
    ]


def _gateway_filters_reading(table: list[dict[str, Any]]) -> list[str]:
    """Against the issue's targets (c=32 >= 0.95x the bare hop; c=1 added p50 <= the bare hop's + 0.1 ms), and the
    run's own noise: on gRPC the dead-stub marker does not exist, so that variant's config is the gateway's."""
    by = {(r["protocol"], r["target"]): r for r in table}
    lines = []
    parts = ("envoy", "triton", "client")
    served_as = {"gateway": "the gateway", "gateway_no_auth": "the keyless gateway (`make serve`)"}
    for protocol, target in ((p, t) for p in ("grpc", "http") for t in served_as):
        g, b = by.get((protocol, target)), by.get((protocol, "bare_envoy"))
        if not g or not b:
            continue
        over = g["c1_added_p50_ms"] - b["c1_added_p50_ms"]
        ci = g.get("c32_vs_bare_envoy_ci95")
        ci_text = " (95 % CI of the median {:.3f} to {:.3f})".format(*ci) if ci else ""
        lines.append(
            f"- {protocol}: {served_as[target]} at c=32 is {g['c32_vs_bare_envoy']:.3f}x the bare hop{ci_text} "
            f"(target 0.95: {'met' if g['c32_vs_bare_envoy'] >= 0.95 else 'not met'}); at c=1 it adds {over:+.3f} ms "
            f"over the bare hop's added p50 (target +0.1 ms: {'met' if over <= 0.1 else 'not met'})."
        )
        if all(p in g.get("c32_cpu_us", {}) and p in b.get("c32_cpu_us", {}) for p in parts):
            gc, bc = g["c32_cpu_us"], b["c32_cpu_us"]
            extra = ", ".join(f"{p} {gc[p] - bc[p]:+.1f} µs" for p in parts)
            total_g, total_b = sum(gc[p] for p in parts), sum(bc[p] for p in parts)
            lines.append(
                f"- CPU, {protocol}: a request through {served_as[target]} takes {total_g:.0f} µs of CPU against "
                f"the bare hop's {total_b:.0f} µs ({extra}); on a machine that CPU bounds, that predicts "
                f"{total_b / total_g:.3f}x the bare hop's throughput, against {g['c32_vs_bare_envoy']:.3f}x measured."
            )
    for protocol in ("grpc", "http"):
        g = by.get((protocol, "gateway"))
        if g and "c32_vs_bare_envoy_auth" in g:
            ratio, over = g["c32_vs_bare_envoy_auth"], g["c1_p50_over_bare_envoy_auth_ms"]
            lines.append(
                f"- {protocol}, keys on both sides: the gateway with keys at c=32 is {ratio:.3f}x a bare hop that "
                f"checks the same key (0.95: {'met' if ratio >= 0.95 else 'not met'}); at c=1 its p50 is "
                f"{over:+.3f} ms over that hop's (+0.1 ms: {'met' if over <= 0.1 else 'not met'})."
            )
    # Rows that run the gateway's own config (noise): its twin, and on gRPC the variant without the dead-stub
    # marker (which only HTTP's upstream has)
    twin = "the twin runs the gateway's own bootstrap in a second Envoy"
    same = [(p, "gateway_twin", twin) for p in ("grpc", "http")]
    same.append(("grpc", "gateway_no_dead_stub", "the row without the dead-stub marker runs the gateway's own config"))
    for protocol, target, what in same:
        twin, served = by.get((protocol, target)), by.get((protocol, "gateway"))
        if twin and served:
            lines.append(
                f"- Noise, {protocol}: {what}; it reads {twin['c32_vs_bare_envoy']:.3f}x and "
                f"{twin['c1_added_p50_ms']:+.3f} ms against the gateway's {served['c32_vs_bare_envoy']:.3f}x and "
                f"{served['c1_added_p50_ms']:+.3f} ms."
            )
    return [*lines, ""] if lines else []


def _envoy_floor_lines(st: dict[str, Any]) -> list[str]:
    tps = st["tokens_per_s"]
    if "grpc_envoy_tcp" not in tps:
        return []
    return [
        "The floor of any Envoy hop on this machine, same cycles: the gRPC stream through a bare Envoy in front of "
        f"Triton, a TCP proxy {tps['grpc_envoy_tcp']} tokens/s ({st['grpc_envoy_tcp_over_direct']:.3f}x direct) and "
        f"an HTTP/2 router with no other filter {tps['grpc_envoy_http2']} tokens/s "
        f"({st['grpc_envoy_http2_over_direct']:.3f}x direct); the gateway over that HTTP/2 floor: "
        f"{st['grpc_gateway_over_envoy_http2']:.3f}x. All warm gRPC streams' tokens over all their time, gateway / "
        f"direct: {st['grpc_gateway_over_direct_all_tokens']:.3f}x (one stream's rate swings with where the "
        "scheduler puts the model's process and Triton's threads).",
        "",
    ]


def _recovery_lines(r: dict[str, Any] | None) -> list[str]:
    if not r:
        return []
    names = {
        "answered": "request sent right after SIGKILL of the idle process: answered in",
        "recovered": "SIGKILL -> model READY on a new process",
        "error": "poison request: its client gets the crash error in",
        "serving_again": "poison request sent -> first successful request after it",
    }
    rows = []
    for key, label in names.items():
        row = [label]
        for data in r["topologies"].values():
            v = data.get(key, {})
            row.append(f"{_ms(v['median'])} (p90 {_ms(v['p90'])})" if v else "-")
        rows.append(row)
    return [
        "## Recovery after a model process dies, per topology",
        "",
        f"{r['cycles']} cycles per topology, interleaved, gRPC through the gateway; load average at the end "
        f"{r['load_average']}. embedded = tritonserver is serve's child; two_process = `snoozectl triton` "
        "beside serve (the compose / Kubernetes topology on one machine). About a second of each answer "
        'that meets the dead process is Triton\'s own wait before it says "Stub process ... is not healthy".',
        "",
        _table(["", *r["topologies"]], rows),
        "",
    ]


def _keepalive_sections(sec: dict[str, Any], plots: dict[str, str], plot_rel: str) -> list[str]:
    lines = []
    for name in ("keepalive", "keepalive_replay"):
        if name in sec:
            lines += _keepalive_lines(sec[name], name, plots, plot_rel)
    return lines


def _keepalive_lines(k: dict[str, Any], name: str, plots: dict[str, str], plot_rel: str) -> list[str]:
    costs = ", ".join(f"{m} {v:.2f} s" for m, v in k["cold_start_secs"].items())
    title = "synthetic traces" if name == "keepalive" else f"trace {k['source']}"
    lines = [
        f"## Keep-alive policies replayed in virtual time: {title}",
        "",
        "The policy code the lifecycle runs (`controlplane/keepalive.py`) replayed over request traces "
        f"({k['source']}); fixed timeouts ({', '.join(f'{t:g}' for t in k['fixed_timeouts_s'])} s), always-on "
        f"(loaded before the first request) and adaptive (fallback and price: {k['adaptive_fallback_s']:g} s) "
        "over the same requests. A cold request waits for the model's cold start "
        f"({costs}: {k['cold_start_source']}); a request that comes during a load, its own or a pre-warm, waits "
        "for the rest of it: both count as client-visible cold starts. Loaded time runs from the start of a load "
        f"to the unload. Replay time {k['replay_wall_s']:.1f} s.",
        "",
        "**The issue's test**: adaptive has fewer client-visible cold starts than every fixed timeout that uses "
        "no more loaded model-seconds (`nearest`: of those, the one with the most loaded time, the strongest "
        "competitor); on a periodic trace also >= 90% warm at < 50% loaded. A fixed timeout with exactly "
        "adaptive's schedule (both loaded from the first request to the end) is a tie, not a defeat.",
        "",
        _table(
            [
                "trace",
                "model",
                "requests",
                "adaptive: cold / warm % / loaded %",
                "pre-warms (wasted)",
                "nearest fixed at no more memory: cold / loaded %",
                "met?",
            ],
            [
                [
                    f"{t} ({tr['description']})",
                    f"{tr['model']} ({tr['cold_start_secs']:.2f} s)",
                    tr["requests"],
                    "{cold} / {warm_pct} / {loaded_pct}".format(**tr["rows"][-1]),
                    f"{tr['rows'][-1]['prewarm_loads']} ({tr['rows'][-1]['wasted_prewarms']})",
                    (
                        "{policy}: {cold} / {loaded_pct}".format(**tr["verdict"]["nearest_cheaper_fixed"])
                        if "nearest_cheaper_fixed" in tr["verdict"]
                        else "none uses less"
                    ),
                    ("yes" if tr["verdict"]["ok"] else "**no**")
                    + (
                        " (tie: " + ", ".join(tr["verdict"]["fixed_same_schedule"]) + ")"
                        if tr["verdict"]["fixed_same_schedule"]
                        else ""
                    ),
                ]
                for t, tr in k["traces"].items()
            ],
        ),
        "",
        "Every policy on every trace:",
        "",
        _table(
            [
                "trace",
                "policy",
                "client-visible cold starts",
                "warm %",
                "loaded % of time",
                "loaded model-hours",
                "request loads",
                "pre-warm loads (wasted)",
                "waited s",
            ],
            [
                [
                    t,
                    r["policy"],
                    r["cold"],
                    r["warm_pct"],
                    r["loaded_pct"],
                    round(r["loaded_s"] / 3600, 2),
                    r["request_loads"],
                    f"{r['prewarm_loads']} ({r['wasted_prewarms']})",
                    r["wait_s"],
                ]
                for t, tr in k["traces"].items()
                for r in tr["rows"]
            ],
        ),
        "",
    ]
    if name in plots:
        lines += [f"![keep-alive]({plot_rel}/{plots[name]})", ""]
    return lines


def _keepalive_live_lines(live: dict[str, Any] | None) -> list[str]:
    if not live:
        return []
    rows = []
    for policy, r in live["policies"].items():
        latency = " / ".join("-" if r[k] is None else f"{r[k]:.0f} ms" for k in ("latency_warm_ms", "latency_cold_ms"))
        rows.append(
            [
                f"{policy} ({r['windows']['reason']})",
                f"{r['warm']} of {r['requests']} ({r['warm_pct']}%)",
                f"{r['warm_after_learning']} of {r['requests_after_learning']}",
                r["request_loads"],
                f"{r['prewarm_loads']} ({r['prewarm_used']} / {r['prewarm_wasted']})",
                f"{r['unloaded_between_requests']} of {r['requests'] - 1}",
                f"{r['loaded_pct']}%",
                latency,
                r["errors"],
            ]
        )
    return [
        "## Keep-alive in the real stack: a periodic caller, adaptive vs fixed",
        "",
        f"Two copies of {live['model']} under the same traffic: one request to each every {live['period_s']:g} s "
        f"through the gateway, {live['requests']} requests, idle timeout {live['idle_timeout_s']:g} s (shorter than "
        "the period: the fixed policy unloads before every request). The adaptive policy learns its windows from "
        f"{live['min_samples']} idle times and may unload when the model then stays out at least "
        f"{live['min_unloaded_s']:g} s (`SNOOZE_KEEP_ALIVE_MIN_SAMPLES` / `SNOOZE_KEEP_ALIVE_MIN_UNLOADED_SECS`; "
        "10 and 60 s by default, lowered for a run of minutes). Warm: the request did not wait for the model to "
        "wake (`snooze_wake_waits`), neither a cold start nor a pre-warm still loading. Loaded: the model was "
        "loading, ready or unloading (sampled every 100 ms from the first request to the last). Pre-warms: "
        "`snooze_prewarm_loads` (used / wasted: `snooze_prewarm_outcomes`).",
        "",
        _table(
            [
                "policy (its window at the end)",
                "warm",
                "warm after learning",
                "request loads",
                "pre-warms (used / wasted)",
                "unloaded between requests",
                "loaded",
                "median latency warm / cold",
                "errors",
            ],
            rows,
        ),
        "",
        "Warm requests in order (adaptive): "
        + " ".join("W" if w else "c" for w in live["policies"]["adaptive"]["warm_by_request"])
        + "; idle times it learned from (s): "
        + ", ".join(f"{x:g}" for x in live["policies"]["adaptive"]["idle_times_s"])
        + ".",
        "",
    ]


_FLEET_COLUMNS = {
    "requests": "requests",
    "errors": "errors",
    "client_cold_starts": "client cold starts",
    "slow_requests": "slow",
    "request_loads": "loads by traffic",
    "idle_unloads": "idle unloads",
}


def _fleet_reading(f: dict[str, Any]) -> list[str]:
    """Why the policies differ, in this run's numbers."""
    st, a, r = f["settings"], f["policies"]["affine"], f["policies"]["round_robin"]
    last_affine = next(ph for ph in reversed(f["phases"]) if ph["policy"] == "affine")
    spills = a["placements"] - st["models"]
    lines = [
        f"Reading: round robin sends every node 1/{st['nodes']} of each model's requests, so every node ends up "
        f"holding most models ({r['placements']} (node, model) pairs loaded at some point vs {a['placements']} for "
        f"{st['models']} models), and a model whose requests on one node come further apart than idle_timeout is "
        f"unloaded and woken again there (idle unloads {r['idle_unloads']} vs {a['idle_unloads']}, loads by traffic "
        f"{r['request_loads']} vs {a['request_loads']})."
        + (
            f" Affine's {spills} pair(s) beyond one per model are bounded-load spills (a node with requests waiting "
            "on a cold start hands the next request to the next node of the ring)."
            if spills > 0
            else ""
        )
        + " The ring balances model names, not traffic: models held per node at the end of the last affine phase "
        f"{', '.join(map(str, last_affine['models_per_node_end']))}; loads by traffic per node "
        f"{', '.join(map(str, a['loads_per_node']))} (affine) vs {', '.join(map(str, r['loads_per_node']))} "
        "(round robin).",
        "",
    ]
    if a["p99_ms"] > r["p99_ms"]:
        lines[-2] += " " + _fleet_p99_reading(a, r)
    return lines


def _fleet_p99_reading(a: dict[str, Any], r: dict[str, Any]) -> str:
    """Why affine's p99 can be above round robin's with fewer cold starts, from what this run measured."""
    text = (
        "Affine's p99 is higher although it has fewer cold starts: under both policies p99 falls among the slow "
        f"requests ({100 * a['slow_requests'] / a['requests']:.1f}% and "
        f"{100 * r['slow_requests'] / r['requests']:.1f}% of all requests)"
    )
    if (a["slow_median_ms"] or 0) > (r["slow_median_ms"] or 0):
        text += f", and affine's slow requests wait longer (median {a['slow_median_ms']} vs {r['slow_median_ms']} ms)"
    else:
        text += (
            f"; their medians are close ({a['slow_median_ms']} vs {r['slow_median_ms']} ms) and the tail decides "
            f"(slowest {a['slow_max_ms']} vs {r['slow_max_ms']} ms)"
        )
    share = {k: max(v["loads_per_node"]) / max(1, sum(v["loads_per_node"])) for k, v in (("a", a), ("r", r))}
    if share["a"] > share["r"]:
        text += (
            f". Affine's loads pile up on fewer nodes (the busiest node ran {100 * share['a']:.0f}% of them vs "
            f"{100 * share['r']:.0f}%) and a node's loads share its load slots (max_concurrent_loads) and its "
            "cores, so a cold request there can wait for other models' loads before its own"
        )
    return text + "."


def _fleet_lines(f: dict[str, Any] | None, plots: dict[str, str], plot_rel: str) -> list[str]:
    if not f:
        return []
    st, pol, ratios, hop = f["settings"], f["policies"], f["ratios"], f["hop"]
    lines = [
        "## Fleet: model-affine routing vs round robin over the same nodes",
        "",
        f"{st['nodes']} nodes (`snoozectl serve` each: embedded Triton, control plane, node gateway; auth on, "
        f"autoscaling off) over one store of {st['models']} tiny models ({st['model']}), idle_timeout "
        f"{st['idle_timeout_secs']:g} s; two fleet gateways over the same nodes: `affine` (ring hash on the model "
        f"name, hash_balance_factor {st['hash_balance_factor']}) and `round_robin`. One seeded trace "
        f"({st['trace_requests']} requests in {st['seconds']:g} s: {st['traffic']}; Zipf s={st['zipf_s']}, "
        f"requests per model from the most to the least requested: {', '.join(map(str, st['requests_per_model']))}) "
        f"replayed through each gateway in turn ({' -> '.join(st['order'])}), every node unloading every model "
        f"before each phase. Loaded instances and their measured memory (RSS of the models' processes, summed over "
        f"the nodes) sampled every {st['sample_interval_secs']:g} s; client-visible cold starts are the nodes' "
        "`snooze_wake_waits_total` (requests that waited for a wake), loads by traffic their "
        '`snooze_cold_starts_total{trigger="request"}`; slow = latency above '
        f"{st['cold_threshold_ms']:g} ms (10x the run's median, at least 100 ms), a cross-check. Nodes started in "
        f"{st['startup_s']:g} s; load average at the start {f['load_average_start']}, at the end {f['load_average']}.",
        "",
        _table(
            [
                "policy",
                "phases",
                *_FLEET_COLUMNS.values(),
                "(node, model) pairs loaded",
                "mean / peak instances",
                "mean / peak MiB",
                "second-half mean MiB",
                "p50 ms",
                "p99 ms",
                "slow: median / max ms",
            ],
            [
                [
                    name,
                    p["phases"],
                    *(p[k] for k in _FLEET_COLUMNS),
                    p["placements"],
                    f"{p['mean_instances']} / {p['peak_instances']}",
                    f"{p['mean_memory_mib']:.0f} / {p['peak_memory_mib']:.0f}",
                    f"{p['second_half_mean_memory_mib']:.0f}",
                    p["p50_ms"],
                    p["p99_ms"],
                    f"{p['slow_median_ms']} / {p['slow_max_ms']}",
                ]
                for name, p in pol.items()
            ],
        ),
        "",
        f"**affine / round robin**: mean memory **{ratios['mean_memory_affine_vs_rr']}** (second half of the trace, "
        f"the ramp from empty left out: {ratios['second_half_memory_affine_vs_rr']}), peak memory "
        f"{ratios['peak_memory_affine_vs_rr']}, mean instances {ratios['mean_instances_affine_vs_rr']}, client-visible "
        f"cold starts {ratios['client_cold_starts_affine_vs_rr']}, p99 {ratios['p99_affine_vs_rr']}.",
        "",
        *_fleet_reading(f),
        "Per phase (the time means and peaks cover the trace's duration; `client late` is how far behind its "
        "schedule the open-loop client sent a request at worst, and with the load average it shows other work on "
        "this shared machine):",
        "",
        _table(
            [
                "#",
                "policy",
                *_FLEET_COLUMNS.values(),
                "mean / peak instances",
                "mean / peak MiB",
                "p50 ms",
                "p99 ms",
                "mean load s",
                "loads per node",
                "models held per node at the end",
                "client late max ms",
                "load average (1 min) at the end",
            ],
            [
                [
                    i + 1,
                    ph["policy"],
                    *(ph[k] for k in _FLEET_COLUMNS),
                    f"{ph['mean_instances']} / {ph['peak_instances']}",
                    f"{ph['mean_memory_mib']:.0f} / {ph['peak_memory_mib']:.0f}",
                    ph["p50_ms"],
                    ph["p99_ms"],
                    ph["mean_load_s"],
                    ", ".join(map(str, ph["loads_per_node"])),
                    ", ".join(map(str, ph["models_per_node_end"])),
                    ph["max_client_late_ms"],
                    ph["load_average_1m"],
                ]
                for i, ph in enumerate(f["phases"])
            ],
        ),
        "",
    ]
    if "fleet" in plots:
        lines += [f"![fleet]({plot_rel}/{plots['fleet']})", ""]
    hs = hop["settings"]
    by = {(r["protocol"], r["concurrency"], r["target"]): r for r in hop["rows"]}
    lines += [
        "### The price of the fleet hop",
        "",
        f"Model {hop['model']} warm on its owner {hop['owner']}; closed loop, {hs['seconds']:g} s per cell after "
        f"{hs['warmup_secs']:g} s of warm-up per target, repeats: {hs['repeats']}, the two targets interleaved "
        "(order alternating), medians of the repeats. `fleet` = through the affine fleet gateway (which then "
        "goes to a node's gateway), `node` = straight to the owner node's gateway. Nodes holding the model after "
        f"the cells: {', '.join(hop['holders_after'])}"
        + (
            " (at c=8 the fleet gateway's bounded load spilled the one hot model onto another node, so the fleet "
            "column at c=8 is served by more than one node)."
            if len(hop["holders_after"]) > 1
            else "."
        ),
        "",
        _table(
            [
                "protocol",
                "c",
                "fleet req/s",
                "node req/s",
                "throughput fleet / node",
                "fleet p50 ms",
                "node p50 ms",
                "added p50 ms",
                "added p99 ms",
                "errors",
            ],
            [
                [
                    protocol,
                    c,
                    by[(protocol, c, "fleet")]["rps"],
                    by[(protocol, c, "node")]["rps"],
                    v["throughput_fleet_vs_node"],
                    by[(protocol, c, "fleet")]["p50_ms"],
                    by[(protocol, c, "node")]["p50_ms"],
                    v["added_p50_ms"],
                    v["added_p99_ms"],
                    by[(protocol, c, "fleet")]["errors"] + by[(protocol, c, "node")]["errors"],
                ]
                for key, v in hop["ratios"].items()
                for protocol, c in [(key.split("_c")[0], int(key.split("_c")[1]))]
            ],
        ),
        "",
    ]
    return lines
