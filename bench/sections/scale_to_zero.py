"""Section scale_to_zero: the memory of Triton's process tree before a model wakes, while it serves and after its
idle unload (measured by bench/scale_to_zero.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.markdown import table
from bench.plotting import pyplot, save
from bench.registry import Data, Rendering, RunContext, Section, register


async def run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import scale_to_zero

    return await scale_to_zero.run(root, **params)


def plot(res: Data, path: Path) -> str:
    plt = pyplot()
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
    return save(fig, path)


def summary(z: Data) -> list[str]:
    out = []
    ret = z["loaded_increment_returned"]
    out.append(
        f"- **Scale to zero** ({z['model']}): Triton tree RSS after idle unload / before = "
        f"{z['after_vs_before']:.3f} "
        f"({'within' if z['after_within_5pct_of_before'] else 'NOT within'} 5%); "
        + (f"{100 * ret:.1f}% of the loaded increment returned." if ret is not None else "")
    )
    return out


def markdown(z: Data, rendering: Rendering) -> list[str]:
    lines: list[str] = []
    r = z["rss_mib"]
    lines += [
        "## Scale to zero: Triton process-tree memory",
        "",
        f"{z['model']}, idle_timeout {z['settings']['idle_timeout_secs']} s, {z['settings']['cycles']} cycles of "
        f"wake -> {z['settings']['traffic']} -> idle unload; RSS of tritonserver and its stubs sampled every "
        f"{int(1000 * z['settings']['sample_interval_secs'])} ms.",
        "",
        table(
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
    return lines + rendering.image("scale_to_zero", "scale to zero")


register(
    Section(
        name="scale_to_zero",
        order=40,
        about="Triton's process-tree memory before a wake, while serving and after the idle unload",
        params={
            "model": "torch-mlp",
            "idle_timeout": 3.0,
            "baseline_secs": 2.0,
            "traffic_secs": 5.0,
            "cycles": 2,
            "settle_secs": 2.0,
        },
        quick={
            "model": "numpy-linear",
            "idle_timeout": 1.0,
            "baseline_secs": 0.5,
            "traffic_secs": 0.3,
            "cycles": 1,
            "settle_secs": 1.0,
        },
        run=run,
        markdown=markdown,
        summary=summary,
        plot=plot,
        keys=frozenset(
            {"model", "settings", "rss_mib", "after_vs_before", "after_within_5pct_of_before", "samples", "events_s"}
        ),
    )
)
