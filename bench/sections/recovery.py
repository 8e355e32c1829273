"""Section recovery: a model process killed while idle and by a poison request, per topology (measured by
bench/recovery.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.markdown import ms, table
from bench.registry import Data, Rendering, RunContext, Section, register


async def run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import recovery

    return await recovery.run(root, **params)


def summary(r: Data) -> list[str]:
    out = []
    t = r["topologies"]
    out.append(
        "- **Recovery** after a model process dies (median of "
        f"{r['cycles']} cycles): killed while idle, back on a new process in "
        + ", ".join(f"{ms(t[k]['recovered']['median'])} ({k})" for k in t)
        + "; a poison request's client told in "
        + ", ".join(f"{ms(t[k]['error']['median'])} ({k})" for k in t)
        + "."
    )
    return out


def markdown(r: Data, rendering: Rendering) -> list[str]:
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
            row.append(f"{ms(v['median'])} (p90 {ms(v['p90'])})" if v else "-")
        rows.append(row)
    return [
        "## Recovery after a model process dies, per topology",
        "",
        f"{r['cycles']} cycles per topology, interleaved, gRPC through the gateway; load average at the end "
        f"{r['load_average']}. embedded = tritonserver is serve's child; two_process = `snoozectl triton` "
        "beside serve (the compose / Kubernetes topology on one machine). About a second of each answer "
        'that meets the dead process is Triton\'s own wait before it says "Stub process ... is not healthy".',
        "",
        table(["", *r["topologies"]], rows),
        "",
    ]


register(
    Section(
        name="recovery",
        order=60,
        about="recovery after a model process dies (killed while idle, poison request), embedded and two-process",
        params={"cycles": 10},
        quick={"cycles": 1},
        run=run,
        markdown=markdown,
        summary=summary,
        keys=frozenset({"cycles", "load_average", "topologies"}),
    )
)
