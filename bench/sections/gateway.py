"""Section gateway: the gateway against direct Triton, a bare Envoy hop and the client's own ceiling, HTTP and gRPC
at three concurrencies (measured by bench/gateway.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.markdown import table
from bench.plotting import pyplot, save
from bench.registry import Data, Rendering, RunContext, Section, register

TARGET_COLORS = {"direct": "#4c72b0", "bare_envoy": "#dd8452", "gateway": "#55a868", "client_ceiling": "#8c8c8c"}


async def run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import gateway

    return await gateway.run(root, **params)


def plot(res: Data, path: Path) -> str:
    plt = pyplot()
    rows = res["rows"]
    conc = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    for col, protocol in enumerate(("grpc", "http")):
        for row_i, (metric, label) in enumerate(
            (("throughput_vs_direct", "throughput / direct Triton"), ("p50_ms", "p50 latency (ms)"))
        ):
            ax = axes[row_i][col]
            width = 0.2
            for i, target in enumerate(TARGET_COLORS):
                vals = [
                    next(
                        r[metric]
                        for r in rows
                        if r["protocol"] == protocol and r["concurrency"] == c and r["target"] == target
                    )
                    for c in conc
                ]
                xs = [j + (i - 1.5) * width for j in range(len(conc))]
                ax.bar(xs, vals, width, label=target, color=TARGET_COLORS[target])
            ax.set_xticks(range(len(conc)), [f"c={c}" for c in conc])
            ax.set_title(f"{protocol.upper()}: {label}", fontsize=10)
            if metric == "throughput_vs_direct":
                ax.axhline(1.0, color="black", lw=0.8)
    axes[0][0].legend(fontsize=8)
    return save(fig, path)


def summary(g: Data) -> list[str]:
    out = []
    r = g["ratios"]
    out.append(
        "- **Gateway** throughput vs direct Triton (c=1 / 8 / 32): gRPC "
        + " / ".join(f"{r[f'grpc_c{c}']['gateway_vs_direct']:.2f}" for c in (1, 8, 32))
        + ", HTTP "
        + " / ".join(f"{r[f'http_c{c}']['gateway_vs_direct']:.2f}" for c in (1, 8, 32))
        + "; the bare Envoy hop: gRPC "
        + " / ".join(f"{r[f'grpc_c{c}']['bare_envoy_vs_direct']:.2f}" for c in (1, 8, 32))
        + ", HTTP "
        + " / ".join(f"{r[f'http_c{c}']['bare_envoy_vs_direct']:.2f}" for c in (1, 8, 32))
        + f". Added p50 at c=1: gateway {r['grpc_c1']['gateway_added_p50_ms']:.2f} ms (gRPC), "
        f"{r['http_c1']['gateway_added_p50_ms']:.2f} ms (HTTP)."
    )
    return out


def markdown(g: Data, rendering: Rendering) -> list[str]:
    lines: list[str] = []
    lines += [
        "## Gateway vs direct Triton",
        "",
        f"Model: {g['model']}. Each cell: {g['settings']['seconds']} s after {g['settings']['warmup_secs']} s of "
        "warm-up, closed loop (`c` requests in flight), load generator in its own process "
        f"({g['settings']['client']}). `bare_envoy` is Envoy with one route per port (the price of any hop); "
        "`gateway` is the snoozeml Envoy as served (auth on, retry-to-activator routes); `client_ceiling` is "
        "Envoy answering by itself (direct response): the most this client can drive on this machine. "
        f"Retries to the activator during the run: {g['gateway_retries_during_run']} (warm traffic never "
        "touches Python).",
        "",
        table(
            [
                "protocol",
                "c",
                "gateway/direct",
                "bare/direct",
                "gateway/bare",
                "+p50 gateway (ms)",
                "+p50 bare (ms)",
                "direct/client ceiling",
                "client-bound?",
            ],
            [
                [
                    k.split("_")[0],
                    k.split("_c")[1],
                    v["gateway_vs_direct"],
                    v["bare_envoy_vs_direct"],
                    v["gateway_vs_bare_envoy"],
                    v["gateway_added_p50_ms"],
                    v["bare_envoy_added_p50_ms"],
                    v["direct_share_of_client_ceiling"],
                    "yes" if v["client_bound"] else "no",
                ]
                for k, v in g["ratios"].items()
            ],
        ),
        "",
        "Absolute numbers:",
        "",
        table(
            ["protocol", "c", "target", "req/s", "p50 ms", "p99 ms", "errors"],
            [
                [r["protocol"], r["concurrency"], r["target"], r["rps"], r["p50_ms"], r["p99_ms"], r["errors"]]
                for r in g["rows"]
            ],
        ),
        "",
    ]
    return lines + rendering.image("gateway", "gateway")


register(
    Section(
        name="gateway",
        order=10,
        about="the gateway vs direct Triton, a bare Envoy hop and the client's ceiling (HTTP, gRPC; c = 1, 8, 32)",
        params={"seconds": 3.0, "warmup": 0.5},
        quick={"seconds": 0.2, "warmup": 0.05},
        run=run,
        markdown=markdown,
        summary=summary,
        plot=plot,
        keys=frozenset({"model", "settings", "rows", "ratios", "gateway_retries_during_run"}),
    )
)
