"""Streaming through the gateway: time to first token on a sleeping model, tokens/s of a warm stream,
and a stream held open across the idle timeout. Run: ``.venv/bin/python -m bench.streaming``.

One `snoozectl serve` stack in this process (auth on), a decoupled package whose ``predict`` yields
``n`` one-element tokens (``delay`` seconds apart). In the same run, interleaved per cycle:

- cold: the model is unloaded through the lifecycle, then one gRPC stream request through the gateway;
  its time to first token is compared with Triton's own ``load`` (timed around the admin call, the model
  unloaded again first) plus the first token of a stream straight to Triton;
- warm: tokens/s of one request of ``tokens`` tokens on a gRPC stream and on ``generate_stream`` (SSE),
  through the gateway and straight to Triton, alternating (first token to last: the stream's own rate;
  the set-up, including the gateway's one call to the activator, is in the first-token figures). The
  same cycles measure the floor of any Envoy hop on this machine: the gRPC stream through a bare Envoy
  started here, a TCP proxy (no HTTP at all) and an HTTP/2 router (no filter but the router), both in
  front of Triton's gRPC port. The order rotates each cycle; ``warm_cycles`` (default twice ``cycles``):
  one stream's rate swings with where the scheduler puts the model's process and Triton's thread;
- open: a stream whose tokens come ``delay`` apart for three idle timeouts: whether it is cut, and
  whether the model sleeps after it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import tritonclient.grpc as grpcclient

from bench.common import API_KEY, direct_urls, fp32, gateway_urls, serving_stack, write_package
from controlplane.gateway.envoy_process import EnvoyProcess
from controlplane.triton.launcher import free_port

MODEL = "bench-tokens"
IDLE_MODEL = "bench-tokens-idle"
TOKENS_PY = """
    import time

    import numpy as np


    class Model:
        def load(self, model_dir, device):
            pass

        def predict(self, inputs):
            n, delay = inputs["n"].reshape(-1)[0], inputs["delay"].reshape(-1)[0]
            for i in range(int(n)):
                if delay > 0:
                    time.sleep(float(delay))
                yield {"token": np.array([i], dtype=np.int32)}
"""


# The floor of an Envoy hop: two listeners in front of Triton's gRPC port, a TCP proxy and an HTTP/2
# router with no other filter (no request id, no access log, no auth, no Lua).
ENVOY_FLOOR = """
admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: 0 }} }}
static_resources:
  listeners:
  - name: tcp
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {tcp_port} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: floor_tcp
          cluster: triton_grpc
  - name: http2
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {http2_port} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: floor_http2
          codec_type: HTTP2
          generate_request_id: false
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: / }}
                route: {{ cluster: triton_grpc, timeout: 0s }}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: triton_grpc
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    load_assignment:
      cluster_name: triton_grpc
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {triton_port} }} }} }}
"""


@contextlib.contextmanager
def envoy_floor(folder: Path, triton_grpc: str) -> Iterator[dict[str, str]]:
    """A bare Envoy (as many workers as the gateway's) in front of ``triton_grpc`` (``host:port``): the
    gRPC addresses of its TCP proxy and of its HTTP/2 router."""
    ports = {"tcp_port": free_port(), "http2_port": free_port()}
    bootstrap = ENVOY_FLOOR.format(triton_port=int(triton_grpc.rsplit(":", 1)[1]), **ports)
    envoy = EnvoyProcess(bootstrap, folder, listen=[("127.0.0.1", p) for p in ports.values()], name="envoy-floor")
    envoy.start()
    try:
        yield {"tcp": f"127.0.0.1:{ports['tcp_port']}", "http2": f"127.0.0.1:{ports['http2_port']}"}
    finally:
        envoy.stop()


def tokens_package(folder: Path) -> Path:
    """A decoupled model: ``n`` one-token responses, ``delay`` seconds apart."""
    inputs = [{"name": "n", "datatype": "INT32", "dims": [1]}, fp32("delay", 1)]
    return write_package(folder, TOKENS_PY, inputs, [{"name": "token", "datatype": "INT32", "dims": [1]}])


def grpc_stream(url: str, model: str, n: int, delay: float = 0.0, headers: dict[str, str] | None = None) -> dict:
    """One request on a gRPC stream: seconds to the first token and to the last, and the token count."""
    client = grpcclient.InferenceServerClient(url)
    first: list[float] = []
    count = [0]
    errors: list[str] = []
    done = threading.Event()

    def callback(result: Any, error: Any) -> None:
        if error is not None:
            errors.append(error.message())
            done.set()
        elif result.get_response().parameters["triton_final_response"].bool_param:
            done.set()
        else:
            if not first:
                first.append(time.perf_counter())
            count[0] += 1

    inputs = [grpcclient.InferInput("n", [1], "INT32"), grpcclient.InferInput("delay", [1], "FP32")]
    inputs[0].set_data_from_numpy(np.array([n], dtype=np.int32))
    inputs[1].set_data_from_numpy(np.array([delay], dtype=np.float32))
    client.start_stream(callback=callback, headers=headers or {})
    start = time.perf_counter()
    client.async_stream_infer(model, inputs, enable_empty_final_response=True)
    done.wait(600)
    end = time.perf_counter()
    client.stop_stream()
    client.close()
    if errors:
        raise RuntimeError(errors[0])
    return {"first": first[0] - start, "total": end - start, "tokens": count[0]}


def sse_stream(url: str, model: str, n: int, headers: dict[str, str] | None = None) -> dict:
    """One ``generate_stream`` request: seconds to the first event and to the end, and the event count."""
    start = time.perf_counter()
    first = None
    count = 0
    with (
        httpx.Client(timeout=600) as client,
        client.stream(
            "POST", f"{url}/v2/models/{model}/generate_stream", json={"n": n, "delay": 0.0}, headers=headers or {}
        ) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: "):
                count += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    return {"first": (first or end) - start, "total": end - start, "tokens": count}


async def run(root: Path, *, cycles: int, tokens: int, warm_cycles: int | None = None) -> dict[str, Any]:
    load_start = [round(v, 2) for v in os.getloadavg()]
    pkg = tokens_package(root / "pkg" / MODEL)
    entries = [
        {"id": MODEL, "path": pkg, "max_batch_size": 0, "idle_timeout_secs": 3600},
        {"id": IDLE_MODEL, "path": pkg, "max_batch_size": 0, "idle_timeout_secs": 1},
    ]
    async with serving_stack(root / "stack", entries, sweep_interval_secs=0.2) as stack:
        gw, direct = gateway_urls(stack), direct_urls(stack)
        key = {"x-api-key": API_KEY}
        triton = stack.admin
        cold: dict[str, list[float]] = {"gateway_first_token": [], "triton_load": [], "direct_first_token": []}
        for _ in range(cycles):
            await stack.lifecycle.unload(MODEL)
            r = await asyncio.to_thread(grpc_stream, gw["grpc"], MODEL, 1, 0.0, key)
            cold["gateway_first_token"].append(r["first"])
            await stack.lifecycle.unload(MODEL)
            started = time.perf_counter()
            await triton.load(MODEL)  # Triton's own load, straight to it
            cold["triton_load"].append(time.perf_counter() - started)
            r = await asyncio.to_thread(grpc_stream, direct["grpc"], MODEL, 1)
            cold["direct_first_token"].append(r["first"])
            await triton.unload(MODEL)
        await stack.lifecycle.ensure_ready(MODEL)
        with envoy_floor(root / "envoy-floor", direct["grpc"]) as floor:
            variants = [
                ("grpc_gateway", lambda: grpc_stream(gw["grpc"], MODEL, tokens, 0.0, key)),
                ("grpc_direct", lambda: grpc_stream(direct["grpc"], MODEL, tokens)),
                ("grpc_envoy_tcp", lambda: grpc_stream(floor["tcp"], MODEL, tokens)),
                ("grpc_envoy_http2", lambda: grpc_stream(floor["http2"], MODEL, tokens)),
                ("sse_gateway", lambda: sse_stream(gw["http"], MODEL, tokens, {"X-API-Key": API_KEY})),
                ("sse_direct", lambda: sse_stream(direct["http"], MODEL, tokens)),
            ]
            warm: dict[str, list[float]] = {name: [] for name, _ in variants}
            warm_first: dict[str, list[float]] = {k: [] for k in warm}
            for cycle in range(warm_cycles or 2 * cycles):
                shift = cycle % len(variants)  # no variant always runs right after the same one
                for name, call in variants[shift:] + variants[:shift]:
                    r = await asyncio.to_thread(call)
                    assert r["tokens"] == tokens, (name, r)
                    warm[name].append((tokens - 1) / (r["total"] - r["first"]))  # the stream's rate, set-up apart
                    warm_first[name].append(r["first"])  # the set-up: connection, the gateway's filters, first token
        warm_holds = stack.activator.holds.warm_holds  # streams let on without waiting for the activator
        # Open across three idle timeouts (idle_timeout_secs = 1): tokens 0.5 s apart for 3 s.
        r = await asyncio.to_thread(grpc_stream, gw["grpc"], IDLE_MODEL, 6, 0.5, key)
        held_state = stack.lifecycle.status(IDLE_MODEL).state
        slept_after = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if str(getattr(stack.lifecycle.status(IDLE_MODEL).state, "value", "")) == "unloaded":
                slept_after = time.monotonic() - (deadline - 30)
                break
            await asyncio.sleep(0.1)
    med = {k: statistics.median(v) for k, v in {**cold, **warm}.items()}
    first_med = {k: statistics.median(v) for k, v in warm_first.items()}
    return {
        "cycles": cycles,
        "warm_cycles": warm_cycles or 2 * cycles,
        "tokens": tokens,
        "load_average": {"start": load_start, "end": [round(v, 2) for v in os.getloadavg()]},
        "cold_ms": {k: round(med[k] * 1000, 2) for k in cold},
        "first_token_overhead_ms": round(
            (med["gateway_first_token"] - med["triton_load"] - med["direct_first_token"]) * 1000, 2
        ),
        "tokens_per_s": {k: round(med[k]) for k in warm},
        "grpc_gateway_over_direct": round(med["grpc_gateway"] / med["grpc_direct"], 3),
        # every warm stream's tokens over all their time (the harmonic mean of the rates): steadier than the
        # median when single streams swing
        "grpc_gateway_over_direct_all_tokens": round(
            statistics.harmonic_mean(warm["grpc_gateway"]) / statistics.harmonic_mean(warm["grpc_direct"]), 3
        ),
        "sse_gateway_over_direct": round(med["sse_gateway"] / med["sse_direct"], 3),
        # the floor of any Envoy hop here: a bare Envoy, TCP proxy / HTTP/2 router only, same cycles
        "grpc_envoy_tcp_over_direct": round(med["grpc_envoy_tcp"] / med["grpc_direct"], 3),
        "grpc_envoy_http2_over_direct": round(med["grpc_envoy_http2"] / med["grpc_direct"], 3),
        "grpc_gateway_over_envoy_http2": round(med["grpc_gateway"] / med["grpc_envoy_http2"], 3),
        # a warm stream's first token, new client and connection each time (medians, ms)
        "warm_first_token_ms": {k: round(v * 1000, 2) for k, v in first_med.items()},
        "warm_holds": warm_holds,
        "open_stream": {
            "tokens": r["tokens"],
            "seconds": round(r["total"], 2),
            "idle_timeout_secs": 1,
            "state_at_end": str(getattr(held_state, "value", held_state)),
            "unloaded_after_end_secs": None if slept_after is None else round(slept_after, 2),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.streaming", description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--warm-cycles", type=int, default=None, help="default: twice --cycles")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="snooze-bench-streaming-") as tmp:
        result = asyncio.run(run(Path(tmp), cycles=args.cycles, tokens=args.tokens, warm_cycles=args.warm_cycles))
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
