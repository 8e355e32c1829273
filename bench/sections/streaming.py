"""Section streaming: gRPC streams and SSE of a decoupled model through the gateway against direct Triton, a
sleeping model's first token, and a stream held open past the idle timeout (measured by bench/streaming.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.markdown import table
from bench.registry import Data, Rendering, RunContext, Section, register


async def run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import streaming

    return await streaming.run(root, **params)


def summary(st: Data) -> list[str]:
    return [
        f"- **Streaming** (a decoupled model, median of {st['cycles']} interleaved cycles): a warm stream's "
        f"tokens/s through the gateway vs direct Triton: gRPC {st['grpc_gateway_over_direct']:.2f}x, SSE "
        f"{st['sse_gateway_over_direct']:.2f}x; first token on a sleeping model "
        f"{st['first_token_overhead_ms']:+.1f} ms over Triton's own load + first token."
    ]


def markdown(st: Data, rendering: Rendering) -> list[str]:
    cold, tps, first, open_ = st["cold_ms"], st["tokens_per_s"], st["warm_first_token_ms"], st["open_stream"]
    la = st.get("load_average", {})
    return [
        "## Streaming: generate_stream (SSE) and gRPC streams of a decoupled model",
        "",
        f"`bench/streaming.py`: {st['cycles']} cold cycles and {st.get('warm_cycles', st['cycles'])} warm ones, "
        "interleaved (gateway and direct in each cycle, the order rotating), medians; a "
        f"decoupled numpy model yielding {st['tokens']} one-token responses as fast as it can; one Python client "
        f"per stream, a new client per request. Load average at the start {la.get('start')}, at the end "
        f"{la.get('end')}.",
        "",
        table(
            ["", "through the gateway", "direct to Triton", "gateway / direct"],
            [
                [
                    "gRPC stream, tokens/s (first token to last)",
                    tps["grpc_gateway"],
                    tps["grpc_direct"],
                    f"{st['grpc_gateway_over_direct']:.3f}",
                ],
                [
                    "SSE generate_stream, tokens/s",
                    tps["sse_gateway"],
                    tps["sse_direct"],
                    f"{st['sse_gateway_over_direct']:.3f}",
                ],
                ["gRPC stream, warm first token (ms)", first["grpc_gateway"], first["grpc_direct"], ""],
                ["SSE generate_stream, warm first token (ms)", first["sse_gateway"], first["sse_direct"], ""],
                [
                    "sleeping model, first token on a gRPC stream (ms)",
                    cold["gateway_first_token"],
                    f"{cold['triton_load']} load + {cold['direct_first_token']} first token",
                    f"{st['first_token_overhead_ms']:+.1f} ms",
                ],
            ],
        ),
        "",
        *_envoy_floor_lines(st),
        f"Warm streams let on by the wake filter without waiting for the activator (the model's ready flag): "
        f"{st.get('warm_holds', '-')}. A stream with a token every 0.5 s for {open_['seconds']} s on a model whose "
        f"idle timeout is {open_['idle_timeout_secs']} s: {open_['tokens']} tokens, the model "
        f"{open_['state_at_end']} at its end, unloaded {open_['unloaded_after_end_secs']} s after it.",
        "",
    ]


def _envoy_floor_lines(st: dict[str, Any]) -> list[str]:
    tps = st["tokens_per_s"]
    if "grpc_envoy_tcp" not in tps:
        return []
    return [
        "The floor of any Envoy hop on this machine, same cycles: the gRPC stream through a bare Envoy in front of "
        f"Triton, a TCP proxy {tps['grpc_envoy_tcp']} tokens/s ({st['grpc_envoy_tcp_over_direct']:.3f}x direct) and "
        f"an HTTP/2 router with no other filter {tps['grpc_envoy_http2']} tokens/s "
        f"({st['grpc_envoy_http2_over_direct']:.3f}x direct); the gateway over that HTTP/2 floor: "
        f"{st['grpc_gateway_over_envoy_http2']:.3f}x. All warm gRPC streams' tokens over all their time, gateway / "
        f"direct: {st['grpc_gateway_over_direct_all_tokens']:.3f}x (one stream's rate swings with where the "
        "scheduler puts the model's process and Triton's threads).",
        "",
    ]


register(
    Section(
        name="streaming",
        order=70,
        about="gRPC streams and SSE of a decoupled model: tokens/s through the gateway vs direct, first token cold",
        params={"cycles": 9, "tokens": 2000},
        quick={"cycles": 1, "tokens": 200},
        run=run,
        markdown=markdown,
        summary=summary,
        keys=frozenset({"cold_ms", "tokens_per_s", "grpc_gateway_over_direct", "warm_first_token_ms", "open_stream"}),
    )
)
