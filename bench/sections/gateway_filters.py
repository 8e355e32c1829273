"""Sections gateway_filters, gateway_targets and gateway_routes: what each part of the gateway costs a warm unary
request, against a bare Envoy hop and direct Triton in interleaved rounds (measured by bench/gateway_filters.py;
the variants are bench/gateway_variants.py). One run, three sets of targets."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.markdown import table
from bench.registry import Data, Rendering, RunContext, Section, register

# Every Envoy restarted after this many cycles (a process's own luck is one block's, not a target's): 4 blocks.
RESTART_EVERY = 10
# The gateway with keys (as deployed with auth) and without (as `make serve` runs it), its twin for the noise.
TARGETS = {"variants": ("no_auth",), "twin": True, "large_requests": False, "bare_auth": True}
# What the routes do besides filters, each left out in turn (bench.gateway_variants.ROUTE_EDITS), and the filters.
ROUTES = {
    "variants": ("no_request_id", "no_retry", "no_gate", "no_access_log", "no_auth", "no_hints", "no_filters"),
    "large_requests": False,
    "direct_with_id": True,
}


async def run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import gateway_filters

    return await gateway_filters.run(root, **params)


TARGET_NAMES = {
    "direct": "direct to Triton",
    "bare_envoy": "bare Envoy (router only)",
    "bare_envoy_auth": "bare Envoy with the same API key check (api_key_auth, then the router)",
    "gateway": "**the gateway, as served**",
    "gateway_twin": "twin: a second Envoy with the gateway's own bootstrap",
    "direct_with_id": "direct to Triton, the client sending x-request-id",
    "gateway_no_request_id": "gateway without a request id (Envoy's x-request-id not generated)",
    "gateway_no_retry": "gateway without the retry to the activator",
    "gateway_no_gate": "gateway without the snapshot gate route",
    "gateway_no_access_log": "gateway without the held-request access log",
    "gateway_no_auth": "gateway without api_key_auth, as `make serve` runs it (no keys; the client sends none)",
    "gateway_no_hints": "gateway without the shape hint (gRPC: its listener's filter; HTTP: its upstream matcher)",
    "gateway_no_wake": "gateway without the wake filters",
    "gateway_no_retry_marks": "gateway without the retry marker (HTTP's upstream: dead stub, missing model)",
    "gateway_no_filters": "gateway routes without any of these filters",
}


_GATEWAY_HEADINGS = {
    "gateway_filters": "## What each gateway filter costs a warm unary request",
    "gateway_targets": "## The gateway against a bare Envoy hop, many rounds (the warm path's targets)",
    "gateway_routes": "## What the gateway's routes cost a warm unary request besides filters",
}


def _gateway_filters_lines(gf: dict[str, Any] | None, *, section: str = "gateway_filters") -> list[str]:
    """The per-filter table (section gateway_filters), the gateway's targets alone (gateway_targets: direct, the
    bare hop, the gateway and its twin over many rounds) or what its routes do (gateway_routes)."""
    if not gf:
        return []
    st, la = gf["settings"], gf["load_average"]
    rows = [
        [
            r["protocol"],
            TARGET_NAMES.get(r["target"], r["target"]),
            r["c32_rps"],
            f"{r['c32_vs_bare_envoy']:.3f}",
            "{:.3f} to {:.3f}".format(*r["c32_vs_bare_envoy_iqr"]) if "c32_vs_bare_envoy_iqr" in r else "-",
            r["c1_p50_ms"],
            f"{r['c1_added_p50_ms']:+.3f}",
            *(r.get("c32_cpu_us", {}).get(part, "-") for part in ("envoy", "triton", "client")),
        ]
        for r in gf["table"]
    ]
    method = (
        f"per protocol and concurrency (1, 32), one client process drives every target in turn, {st['seconds']} s "
        f"each on new connections (after {st.get('slice_warmup_secs', 0.05)} s of warm-up on them), for "
        f"{st['rounds']} cycles (after "
        f"{st['warmup_secs']} s of warm-up per target first), the order rotating by one from cycle to cycle; "
        "medians over cycles of per-cycle numbers (throughput over the same cycle's bare hop, p50 over the same "
        "cycle's direct p50), with a 95 % confidence interval of the median (order statistics). CPU per request: "
        "user + system time of each process over a slice over the client's count of its successful requests, "
        "median over cycles. "
    )
    if st.get("restart_every"):
        method += (
            f"Every Envoy of the run, the served gateway too, was restarted after each {st['restart_every']} "
            f"cycles ({st['envoy_restarts']} times per Envoy), so what one process keeps for its life is one "
            "block's luck, not a target's. "
        )
    return [
        _GATEWAY_HEADINGS[section],
        "",
        f"`bench/gateway_filters.py` (section {section}): {method}"
        f"Client: {st['client']}. Load average at the start {la['start']}, at the end "
        f"{la['end']}. Lua runs in the served gateway over all these warm requests: {gf['gateway_lua_executions']}.",
        "",
        table(
            [
                "protocol",
                "target",
                "c=32 req/s",
                "c=32 / bare Envoy",
                "its middle half of rounds",
                "c=1 p50 (ms)",
                "c=1 p50 over direct (ms)",
                "c=32 CPU µs per request: Envoy",
                "Triton and its model processes",
                "client",
            ],  # fmt: skip
            rows,
        ),
        "",
        *_gateway_filters_reading(gf["table"]),
        *_gateway_large_lines(gf.get("large"), st),
    ]


def _gateway_large_lines(large: dict[str, Any] | None, st: dict[str, Any]) -> list[str]:
    """A warm large gRPC request: the copy the gRPC retry keeps (every ModelInfer can be retried, no Lua reads
    its size) against the same gateway with HTTP's retry buffer (a large request not kept: no copy, no wake)."""
    if not large:
        return []
    p50, errors = large["p50_ms"], large["errors"]
    direct = p50["direct"]
    return [
        f"A warm {large['request_mib']:g} MiB gRPC ModelInfer (one client, {st['seconds'] * 2} s per target per "
        f"round, the same rounds, rotating; p50 of each round's requests, median over rounds): direct "
        f"{direct} ms; the gateway {p50['gateway_large']} ms ({p50['gateway_large'] - direct:+.2f} ms over "
        f"direct), where Envoy keeps a copy for the retry; the same gateway with HTTP's retry buffer for gRPC (no "
        f"copy, so no wake for it) {p50['gateway_large_no_copy']} ms "
        f"({p50['gateway_large_no_copy'] - direct:+.2f} ms). Errors: {errors}.",
        "",
    ]


def _gateway_filters_reading(table: list[dict[str, Any]]) -> list[str]:
    """Against the issue's targets (c=32 >= 0.95x the bare hop; c=1 added p50 <= the bare hop's + 0.1 ms), and the
    run's own noise: on gRPC the dead-stub marker does not exist, so that variant's config is the gateway's."""
    by = {(r["protocol"], r["target"]): r for r in table}
    lines = []
    parts = ("envoy", "triton", "client")
    served_as = {"gateway": "the gateway", "gateway_no_auth": "the keyless gateway (`make serve`)"}
    for protocol, target in ((p, t) for p in ("grpc", "http") for t in served_as):
        g, b = by.get((protocol, target)), by.get((protocol, "bare_envoy"))
        if not g or not b:
            continue
        over = g["c1_added_p50_ms"] - b["c1_added_p50_ms"]
        ci = g.get("c32_vs_bare_envoy_ci95")
        ci_text = " (95 % CI of the median {:.3f} to {:.3f})".format(*ci) if ci else ""
        lines.append(
            f"- {protocol}: {served_as[target]} at c=32 is {g['c32_vs_bare_envoy']:.3f}x the bare hop{ci_text} "
            f"(target 0.95: {'met' if g['c32_vs_bare_envoy'] >= 0.95 else 'not met'}); at c=1 it adds {over:+.3f} ms "
            f"over the bare hop's added p50 (target +0.1 ms: {'met' if over <= 0.1 else 'not met'})."
        )
        if all(p in g.get("c32_cpu_us", {}) and p in b.get("c32_cpu_us", {}) for p in parts):
            gc, bc = g["c32_cpu_us"], b["c32_cpu_us"]
            extra = ", ".join(f"{p} {gc[p] - bc[p]:+.1f} µs" for p in parts)
            total_g, total_b = sum(gc[p] for p in parts), sum(bc[p] for p in parts)
            lines.append(
                f"- CPU, {protocol}: a request through {served_as[target]} takes {total_g:.0f} µs of CPU against "
                f"the bare hop's {total_b:.0f} µs ({extra}); on a machine that CPU bounds, that predicts "
                f"{total_b / total_g:.3f}x the bare hop's throughput, against {g['c32_vs_bare_envoy']:.3f}x measured."
            )
    for protocol in ("grpc", "http"):
        g = by.get((protocol, "gateway"))
        if g and "c32_vs_bare_envoy_auth" in g:
            ratio, over = g["c32_vs_bare_envoy_auth"], g["c1_p50_over_bare_envoy_auth_ms"]
            lines.append(
                f"- {protocol}, keys on both sides: the gateway with keys at c=32 is {ratio:.3f}x a bare hop that "
                f"checks the same key (0.95: {'met' if ratio >= 0.95 else 'not met'}); at c=1 its p50 is "
                f"{over:+.3f} ms over that hop's (+0.1 ms: {'met' if over <= 0.1 else 'not met'})."
            )
    # Rows that run the gateway's own config (noise): its twin, and on gRPC the variant without the dead-stub
    # marker (which only HTTP's upstream has)
    twin_note = "the twin runs the gateway's own bootstrap in a second Envoy"
    same = [(p, "gateway_twin", twin_note) for p in ("grpc", "http")]
    same.append(("grpc", "gateway_no_retry_marks", "the row without the retry marker runs the gateway's own config"))
    for protocol, target, what in same:
        twin, served = by.get((protocol, target)), by.get((protocol, "gateway"))
        if twin and served:
            lines.append(
                f"- Noise, {protocol}: {what}; it reads {twin['c32_vs_bare_envoy']:.3f}x and "
                f"{twin['c1_added_p50_ms']:+.3f} ms against the gateway's {served['c32_vs_bare_envoy']:.3f}x and "
                f"{served['c1_added_p50_ms']:+.3f} ms."
            )
    return [*lines, ""] if lines else []


def _markdown(section: str) -> Callable[[Data, Rendering], list[str]]:
    def markdown(data: Data, rendering: Rendering) -> list[str]:
        return _gateway_filters_lines(data, section=section)

    return markdown


KEYS = frozenset({"settings", "table", "runs", "load_average", "gateway_lua_executions"})
register(
    Section(
        name="gateway_filters",
        order=80,
        about="what each gateway filter costs a warm unary request (the gateway less each in turn, interleaved)",
        # The gateway less each filter in turn, the bare hop and direct: 8 targets x 4 x 30 cycles x 0.45 s, and the
        # warm 32 MiB comparison: 8.5 minutes.
        params={"seconds": 0.4, "warmup": 1.0, "rounds": 30, "restart_every": RESTART_EVERY},
        quick={"seconds": 0.2, "warmup": 0.05, "rounds": 1},
        run=run,
        markdown=_markdown("gateway_filters"),
        keys=KEYS | {"large"},
    )
)
register(
    Section(
        name="gateway_targets",
        order=81,
        about="the gateway's targets against the bare Envoy hop alone, many rounds, with a twin for the noise",
        # Direct, the bare hop with and without a key check, the gateway with and without keys, and its twin, in
        # turn (bench._load.AlternatingJob): 6 targets x 4 (protocol, concurrency) x 40 cycles x 0.55 s, 9 minutes.
        params={"seconds": 0.5, "warmup": 1.0, "rounds": 40, "restart_every": RESTART_EVERY, **TARGETS},
        quick={"seconds": 0.2, "warmup": 0.05, "rounds": 2, "restart_every": 1, **TARGETS},
        run=run,
        markdown=_markdown("gateway_targets"),
        keys=KEYS,
        default=False,
    )
)
register(
    Section(
        name="gateway_routes",
        order=82,
        about="what the routes cost besides filters, each part left out in turn",
        # What the routes do besides filters, each left out in turn, and the filters, in turn: 11 targets x 4 x 30
        # cycles x 0.35 s, 8 minutes.
        params={"seconds": 0.3, "warmup": 1.0, "rounds": 30, **ROUTES},
        quick={"seconds": 0.2, "warmup": 0.05, "rounds": 1, **ROUTES},
        run=run,
        markdown=_markdown("gateway_routes"),
        keys=KEYS,
        default=False,
    )
)
