"""Section scale: rendering, validating and serving many published models (measured by bench/scale.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from bench.markdown import table
from bench.registry import Data, Rendering, RunContext, Section, register


async def run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import scale, scale_serve

    params = dict(params)
    sizes = params.pop("serve_sizes")
    data = await asyncio.to_thread(scale.run, root, **params)
    data["serve"] = await asyncio.to_thread(scale_serve.run, root / "serve", sizes=sizes)
    return data


def serve_markdown(serve: Data) -> list[str]:
    """`snoozectl serve --models` over N packages (bench/scale_serve.py)."""
    rows = []
    for r in serve["sizes"]:
        first, again, listing, wake = r["first_start"], r["restart"], r["listing"], r["cold_wake_last"] or {}
        rows.append(
            [
                f"{r['models']:,}",
                f"{first['api_live_s']} / {first['gateway_live_s']} s",
                f"{first['all_published_s']} s",
                f"{again['api_live_s']} s ({again['unchanged']:,} adopted, {again['written']:,} written)",
                f"{listing['full_ms']['p50']} / {listing['full_ms']['p99']} ms",
                f"{listing['page_100_ms']['p50']} / {listing['page_100_ms']['p99']} ms",
                f"{listing['state_ready_ms']['p50']} ms",
                f"{r['rss_kib_per_model']} KiB",
                f"{wake.get('secs')} s ({'right' if wake.get('right') else wake.get('status')})",
            ]
        )
    return [
        "### `snoozectl serve --models` over N tiny custom packages",
        "",
        table(
            [
                "models",
                "API / gateway live",
                "all published",
                "restart, work dir kept: live",
                "full list p50 / p99",
                "page of 100 p50 / p99",
                "state=ready p50",
                "control plane per model",
                "cold wake of the last",
            ],
            rows,
        ),
        "",
    ]


def summary(s: Data) -> list[str]:
    out = []
    cp = s["control_plane"]
    n = s["models"]
    out.append(
        f"- **Scale** ({n} models): render {s['render']['per_model_ms']:.1f} ms/model, static validation "
        f"{s['validate_static']['per_model_ms']:.0f} ms/model; control-plane RSS {n} vs 0 models "
        f"{cp[f'rss_{n}_vs_0_models']:.3f}x; idle CPU {100 * cp[f'idle_cpu_share_{n}_models']:.1f}% of one core."
    )
    return out


def markdown(s: Data, rendering: Rendering) -> list[str]:
    lines: list[str] = []
    n = s["models"]
    cp, rd, vd = s["control_plane"], s["render"], s["validate_static"]
    lines += [
        f"## Scale: {n} published models",
        "",
        table(
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
    if "serve" in s:
        lines += serve_markdown(s["serve"])
    return lines


register(
    Section(
        name="scale",
        order=50,
        about="render, validate and serve many published models: time per model, control-plane memory and idle CPU; "
        "serve --models at 1,000 and 10,000: live, published, restart, listing, memory per model, a cold wake",
        params={"n": 200, "validate_n": 200, "idle_secs": 10.0, "serve_sizes": [1000, 10000]},
        quick={"n": 10, "validate_n": 3, "idle_secs": 0.5, "serve_sizes": [20]},
        run=run,
        markdown=markdown,
        summary=summary,
        keys=frozenset({"models", "render", "validate_static", "control_plane"}),
    )
)
