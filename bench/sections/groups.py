"""Section groups: the cold first response of an ensemble and of a BLS pipeline against their steps' own
(measured by bench/groups.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.markdown import ms, table
from bench.registry import Data, Rendering, RunContext, Section, register

LABELS = {
    "step": "one step alone",
    "steps": "both steps, one after the other (the baseline)",
    "pipe": "the ensemble of the two (steps woken first)",
    "bls": "a BLS caller of the two (each callee woken from inside its execute)",
}


async def run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import groups

    return await groups.run(root, **params)


def summary(r: Data) -> list[str]:
    c, ratio = r["cold_first_response"], r["ratio_to_steps"]
    return [
        f"- **Ensembles and BLS asleep**: cold first response of an ensemble {ms(c['pipe']['median'])} "
        f"({ratio['pipe']}x its two steps woken one after the other, {ms(c['steps']['median'])}), of a BLS "
        f"pipeline {ms(c['bls']['median'])} ({ratio['bls']}x)."
    ]


def markdown(r: Data, rendering: Rendering) -> list[str]:
    c, ratio = r["cold_first_response"], r["ratio_to_steps"]
    rows = [[label, ms(c[t]["median"]), ms(c[t]["p90"]), f"{ratio[t]}x"] for t, label in LABELS.items() if t in c]
    return [
        "## Ensembles and BLS pipelines, woken from sleep",
        "",
        f"{r['cycles']} cycles, targets interleaved in a rotating order, every model asleep before each request "
        f"(gRPC through the gateway); load average at the end {r['load_average']}. Triton model folders written "
        "by bench/groups.py: two python steps, an ensemble of them, a python model calling them through BLS.",
        "",
        table(["cold first response of", "median", "p90", "vs both steps"], rows),
        "",
    ]


register(
    Section(
        name="groups",
        order=57,
        about="cold first response of an ensemble and a BLS pipeline against their steps' own",
        params={"cycles": 10},
        quick={"cycles": 2},
        run=run,
        markdown=markdown,
        summary=summary,
        keys=frozenset({"cycles", "load_average", "cold_first_response", "ratio_to_steps"}),
    )
)
