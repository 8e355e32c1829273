"""Section coldstart: a sleeping model's first response through the gateway against Triton's own load time, the
first request after a pre-warm, and the memory of the torch example loaded three ways (measured by
bench/coldstart.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.markdown import ms, ms2, table
from bench.plotting import pyplot, save
from bench.registry import Data, Rendering, RunContext, Section, register


async def run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import coldstart

    return await coldstart.run(root, **params)


def plot(res: Data, path: Path) -> str:
    plt = pyplot()
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
    return save(fig, path)


def summary(c: Data) -> list[str]:
    out = []
    parts = [
        f"{m} {v['first_response_vs_triton_load']:.2f}x (+{ms(v['overhead_s']['median'])})"
        for m, v in c["models"].items()
    ]
    out.append(
        "- **Cold start** through the gateway vs Triton's own load time (median over "
        f"{c['cycles']} cycles): " + ", ".join(parts) + "."
    )
    if (w := _worker_summary(c)) is not None:
        out.append(w)
    return out


def _worker_summary(c: dict[str, Any]) -> str | None:
    m, mem = c["models"], c.get("memory") or {}
    if not {"torch-mlp", "torch-mlp-preforked"} <= set(m):
        return None
    n = c.get("memory_copies")
    text = (
        "- **Preforked workers** (the torch example): first response through the gateway "
        f"{ms(m['torch-mlp-preforked']['first_response_s']['median'])} preforked vs "
        f"{ms(m['torch-mlp']['first_response_s']['median'])} in the stub"
    )
    if "torch-mlp-onnx" in m:
        text += f" and {ms(m['torch-mlp-onnx']['first_response_s']['median'])} as ONNX"
    if {"torch-mlp", "torch-mlp-preforked"} <= set(mem):
        pf, stub = mem["torch-mlp-preforked"][f"{n}_loaded"], mem["torch-mlp"][f"{n}_loaded"]
        text += (
            f"; {n} copies loaded take {pf['pss_mib']:.0f} MiB preforked vs {stub['pss_mib']:.0f} MiB in the stub "
            f"(PSS, {pf['pss_mib'] / stub['pss_mib']:.2f}x)"
        )
    return text + "."


def markdown(c: Data, rendering: Rendering) -> list[str]:
    lines: list[str] = []
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
        table(
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
                    " / ".join(ms(v["triton_load_s"][k]) for k in ("median", "p90", "max")),
                    " / ".join(ms(v["first_response_s"][k]) for k in ("median", "p90", "max")),
                    " / ".join(ms(v["overhead_s"][k]) for k in ("median", "p90", "max")),
                    ms(v["direct_load_and_first_infer_s"]["median"]),
                    " / ".join(ms(v["overhead_vs_direct_s"][k]) for k in ("median", "p90")),
                ]
                for mdl, v in c["models"].items()
            ],
        ),
        "",
    ]
    lines += _coldstart_decomposition(c)
    lines += _prewarm_lines(c)
    lines += rendering.image("coldstart", "cold start")
    return lines + _memory_lines(c)


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
        table(
            ["model", "1: accounted", "1: PSS", f"{n}: accounted", f"{n}: PSS", f"{n}: PSS per copy", "parent PSS"],
            rows,
        ),
        "",
    ]


def _coldstart_decomposition(c: dict[str, Any]) -> list[str]:
    """A first response split into Triton's load, the fresh stub's first inference, and snoozeml's share."""
    keys = ("direct_load_s", "direct_first_infer_s", "overhead_vs_direct_s")
    rows = [
        [m, *(ms(v["decomposition_s"][k]["median"]) for k in keys), ms(v["first_response_s"]["median"])]
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
        table(
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
            ms2(v["prewarmed_first_s"]["median"]),
            ms2(v["prewarmed_first_s"]["p90"]),
            ms2(v["warm_s"]["median"]),
            v["prewarmed_first_vs_warm"],
            ms2(v["warm_after_gap_s"]["median"]) if v.get("warm_after_gap_s") else "-",
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
        table(
            ["model", "first after pre-warm median", "p90", "warm median", "first / warm", f"warm after {gap} idle"],
            rows,
        ),
        "",
    ]


register(
    Section(
        name="coldstart",
        order=20,
        about="a sleeping model's first response through the gateway vs Triton's load time; memory of the torch "
        "example in its stub, preforked and as ONNX",
        params={
            "cycles": 20,
            "models": [
                "numpy-linear",
                "torch-mlp",
                "torch-mlp-preforked",
                "torch-mlp-onnx",
                "onnx-mlp",
                "torch-conv",
                "torch-conv-preforked",
            ],
            "memory_copies": 5,
        },
        quick={
            "cycles": 1,
            "models": ["numpy-linear", "torch-mlp-preforked", "torch-conv-preforked", "onnx-mlp"],
            "memory_copies": 2,
            "warmup_cycle": False,
        },
        run=run,
        markdown=markdown,
        summary=summary,
        plot=plot,
        keys=frozenset({"cycles", "models"}),
    )
)
