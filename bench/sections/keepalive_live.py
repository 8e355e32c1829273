"""Section keepalive_live: a periodic caller through the real stack against an adaptive and a fixed keep-alive copy
of one model (measured by bench/keepalive_live.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.markdown import table
from bench.registry import Data, Rendering, RunContext, Section, register


async def run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import keepalive_live

    return await keepalive_live.run(root, **params)


def summary(live: Data) -> list[str]:
    out = []
    a, f = live["policies"]["adaptive"], live["policies"]["fixed"]
    out.append(
        f"- **Keep-alive, live** (a caller every {live['period_s']:g} s, idle timeout "
        f"{live['idle_timeout_s']:g} s, {live['requests']} requests through the gateway): adaptive served "
        f"{a['warm_pct']:.0f}% warm "
        f"({a['warm_after_learning']} of the {a['requests_after_learning']} after it learned), loaded "
        f"{a['loaded_pct']:.0f}% of the time, {a['prewarm_loads']} pre-warms ({a['prewarm_wasted']} wasted); "
        f"fixed {f['warm_pct']:.0f}% warm, loaded {f['loaded_pct']:.0f}%."
    )
    return out


def markdown(live: Data, rendering: Rendering) -> list[str]:
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
        table(
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


register(
    Section(
        name="keepalive_live",
        order=110,
        about="a periodic caller through the real stack: the adaptive keep-alive vs a fixed timeout",
        # the run: period 8 s, fixed timeout 2 s; the policy learns from 3 idle times (10 by default)
        params={"period_s": 8.0, "idle_timeout_s": 2.0, "requests": 16, "min_samples": 3, "min_unloaded_s": 2.0},
        quick={"period_s": 4.0, "idle_timeout_s": 1.0, "requests": 7, "min_samples": 3, "min_unloaded_s": 1.0},
        run=run,
        markdown=markdown,
        summary=summary,
        keys=frozenset({"model", "period_s", "idle_timeout_s", "requests", "policies"}),
    )
)
