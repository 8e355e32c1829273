"""Sections keepalive and keepalive_replay: the keep-alive policies replayed in virtual time over synthetic traces,
or over a trace file (``--replay``), with the cold starts this report measured (bench/keepalive_replay.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.markdown import table
from bench.plotting import pyplot, save
from bench.registry import Data, Rendering, RunContext, Section, register


async def run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import keepalive_replay

    return keepalive_replay.run(root, **params, measured=ctx.results.get("coldstart"))


async def run_replay(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import keepalive_replay

    return keepalive_replay.run(
        root,
        **params,
        measured=ctx.results.get("coldstart"),
        trace_file=ctx.options["replay"],
        cold_start_secs=ctx.options.get("cold_start_secs"),
    )


def plot(res: Data, path: Path) -> str:
    plt = pyplot()
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
    return save(fig, path)


def summary(k: Data) -> list[str]:
    return [_keepalive_summary(k)]


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


def _markdown(name: str) -> Callable[[Data, Rendering], list[str]]:
    def markdown(data: Data, rendering: Rendering) -> list[str]:
        return _keepalive_lines(data, name) + rendering.image(name, "keep-alive")

    return markdown


def _keepalive_lines(k: Data, name: str) -> list[str]:
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
        table(
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
        table(
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
    return lines


KEYS = frozenset(
    {"source", "cold_start_secs", "cold_start_source", "fixed_timeouts_s", "adaptive_fallback_s", "traces"}
)
register(
    Section(
        name="keepalive",
        order=100,
        about="the keep-alive policies replayed in virtual time over synthetic traces (seconds, no server)",
        params={},  # virtual time: the full replay takes seconds, quick or not
        quick={},
        run=run,
        markdown=_markdown("keepalive"),
        summary=summary,
        plot=plot,
        keys=KEYS,
    )
)
# Run by --replay TRACE_FILE (bench/keepalive_replay.py has the trace format), not by --only alone.
REPLAY = "keepalive_replay"
register(
    Section(
        name=REPLAY,
        order=101,
        about="with --replay TRACE_FILE: the keep-alive policies over your own trace",
        params={},
        quick={},
        run=run_replay,
        markdown=_markdown(REPLAY),
        plot=plot,
        keys=KEYS,
        default=False,
    )
)
