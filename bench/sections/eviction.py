"""Section eviction: the eviction policies replayed in virtual time over Zipf, scan and shifting-hot-set traces on a
fixed memory budget (bench/eviction_replay.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.markdown import table
from bench.registry import Data, Rendering, RunContext, Section, register


async def run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import eviction_replay

    return eviction_replay.run(root, **params)


def summary(ev: Data) -> list[str]:
    return [_eviction_summary(ev)]


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


def markdown(ev: Data, rendering: Rendering) -> list[str]:
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
        table(
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


register(
    Section(
        name="eviction",
        order=130,
        about="the eviction policies replayed in virtual time (Zipf, scan, shifting hot set) on a fixed budget",
        params={"requests": 20000},
        quick={"requests": 2000},  # virtual time: the full replay takes seconds too
        run=run,
        markdown=markdown,
        summary=summary,
        keys=frozenset({"traces", "default_policy", "budget_mib", "ok", "source", "unit_slots"}),
    )
)
