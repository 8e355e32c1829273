"""Sections envoy_cpu and envoy_instructions: each gateway configuration's own CPU, and its instructions counted by
callgrind, per request, in front of an Envoy that answers itself (measured by bench/envoy_cpu.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.markdown import table
from bench.registry import Data, RunContext, Section, register
from bench.sections.gateway_filters import TARGET_NAMES


async def run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import envoy_cpu

    return await envoy_cpu.run(root, **params)


async def run_instructions(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import envoy_cpu

    return await envoy_cpu.run_instructions(root, **params)


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
            TARGET_NAMES.get(r["target"], r["target"]),
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
        table(
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
            TARGET_NAMES.get(r["target"], r["target"]),
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
        table(
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


register(
    Section(
        name="envoy_cpu",
        order=90,
        about="each gateway configuration's own CPU per request in front of an Envoy that answers itself",
        # 12 Envoy configurations x 2 protocols x 15 rounds x 1 s: 6 minutes
        params={"seconds": 1.0, "rounds": 15, "concurrency": 8},
        quick={"seconds": 0.2, "rounds": 1, "concurrency": 8},
        run=run,
        markdown=lambda data, rendering: _envoy_cpu_lines(data),
        keys=frozenset({"settings", "table", "runs", "load_average"}),
        default=False,
    )
)
register(
    Section(
        name="envoy_instructions",
        order=91,
        about="the same configurations' instructions per request, counted by callgrind (needs valgrind)",
        # 13 configurations under callgrind, each some 20 s to start and 2 x (300 + 2 x 2000) requests: 7 minutes
        params={"requests": 2000, "warmup_requests": 300, "repeats": 2, "concurrency": 8},
        quick={"requests": 100, "warmup_requests": 20, "repeats": 1, "concurrency": 8},
        run=run_instructions,
        markdown=lambda data, rendering: _envoy_instructions_lines(data),
        keys=frozenset({"settings", "table", "runs"}),
        default=False,
    )
)
