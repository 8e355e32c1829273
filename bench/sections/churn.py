"""Section churn: many models in little memory under Zipf traffic and republishes, one eviction policy after the
other (measured by bench/churn.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.markdown import ms, table
from bench.registry import Data, Rendering, RunContext, Section, register

# the scenario: 40 models x 40 MiB of real memory under 400 MiB, 8 clients, Zipf(1), 120 s per policy
SCENARIO: dict[str, Any] = {
    "models": 40,
    "ballast_mb": 40,
    "budget_mb": 400,
    "seconds": 120.0,
    "clients": 8,
    "republish_secs": 15.0,
}
# 4 models of ~50 MiB (8 MiB ballast + the stub) under a budget that holds two: swaps from the start
QUICK: dict[str, Any] = {
    "models": 4,
    "ballast_mb": 8,
    "budget_mb": 130,
    "seconds": 4.0,
    "clients": 4,
    "republish_secs": 2.0,
}


async def run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import churn

    return await churn.run(root, **params)


def summary(c: Data) -> list[str]:
    return [_churn_summary(c)] if c.get("policies") else []


def _churn_summary(c: dict[str, Any]) -> str:
    st = c["settings"]
    parts = [
        f"{name}: {p['answers']} answers ({p['answers_per_s']}/s), hot p50 {p['hot_p50_ms']} ms, unload median "
        f"{ms(p['unload_median_s']) if p['unload_median_s'] is not None else '-'}, {p['errors']} errors, "
        f"{p['wrong_answers']} wrong"
        for name, p in c["policies"].items()
    ]
    return (
        f"- **Churn** ({st['models']} models x {st['ballast_mb']} MiB under {st['budget_mb']:g} MiB, "
        f"{st['seconds']:g} s per policy): " + "; ".join(parts) + "."
    )


def markdown(c: Data, rendering: Rendering) -> list[str]:
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
        table(
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


register(
    Section(
        name="churn",
        order=140,
        about="many models in little memory (Zipf traffic, republishes): the eviction policies side by side",
        params=SCENARIO,
        quick=QUICK,
        run=run,
        markdown=markdown,
        summary=summary,
        keys=frozenset({"settings", "policies"}),
    )
)
