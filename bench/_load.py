"""Async load generators for KServe v2 endpoints, loopback only, bounded in count and time.

The request is built once and sent as raw bytes (gRPC: a serialized ModelInferRequest over a
grpc.aio channel with identity serializers; HTTP: a binary-tensor body over aiohttp), so that the
client spends as little CPU as possible and the numbers measure the server side.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import grpc
import numpy as np
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2

LOOPBACK = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class LoadResult:
    requests: int
    errors: int
    seconds: float
    latencies_ms: list[float]  # sorted

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        return self.latencies_ms[min(len(self.latencies_ms) - 1, int(q / 100 * len(self.latencies_ms)))]


def _check_loopback(host: str) -> None:
    if host not in LOOPBACK:
        raise ValueError(f"load generation is for loopback targets only, not {host!r}")


async def _drive(
    send: Callable[[], Awaitable[bool]], concurrency: int, seconds: float, max_requests: int
) -> LoadResult:
    latencies: list[float] = []
    errors = 0
    issued = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal errors, issued
        while issued < max_requests and time.perf_counter() < deadline:
            issued += 1
            start = time.perf_counter()
            ok = await send()
            latencies.append((time.perf_counter() - start) * 1000)
            errors += not ok

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return LoadResult(len(latencies) - errors, errors, elapsed, sorted(latencies))


def infer_request_bytes(model: str, x: np.ndarray) -> bytes:
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))  # data in raw_input_contents
    request.raw_input_contents.append(x.astype(np.float32).tobytes())
    return request.SerializeToString()


async def grpc_load(
    target: str, model: str, x: np.ndarray, *, concurrency: int, seconds: float, max_requests: int,
    metadata: tuple[tuple[str, str], ...] = (),
) -> LoadResult:  # fmt: skip
    _check_loopback(target.rsplit(":", 1)[0])
    payload = infer_request_bytes(model, x)
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")

        async def send() -> bool:
            try:
                await call(payload, metadata=metadata)
            except grpc.aio.AioRpcError:
                return False
            return True

        return await _drive(send, concurrency, seconds, max_requests)


async def http_load(
    base_url: str, model: str, x: np.ndarray, *, concurrency: int, seconds: float, max_requests: int,
    headers: dict[str, str] | None = None,
) -> LoadResult:  # fmt: skip
    _check_loopback(base_url.split("//", 1)[-1].rsplit(":", 1)[0])
    tensor = httpclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    outputs = [httpclient.InferRequestedOutput("y", binary_data=True)]
    body, json_size = httpclient.InferenceServerClient.generate_request_body([tensor], outputs=outputs)
    all_headers = {"Inference-Header-Content-Length": str(json_size), "Content-Type": "application/octet-stream"}
    all_headers.update(headers or {})
    url = f"{base_url}/v2/models/{model}/infer"
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def send() -> bool:
            async with session.post(url, data=body, headers=all_headers) as r:
                await r.read()
                return r.status == 200

        return await _drive(send, concurrency, seconds, max_requests)


def bare_envoy_bootstrap(*, http_port: int, grpc_port: int, triton_http: tuple[str, int],
                         triton_grpc: tuple[str, int]) -> str:  # fmt: skip
    """The reference hop: Envoy proxying both ports to Triton, no retry, no auth, no local-reply mapping."""

    def listener(name: str, port: int, cluster: str, codec: str) -> str:
        return f"""
  - name: {name}
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          codec_type: {codec}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: / }}
                route: {{ cluster: {cluster}, timeout: 0s }}"""

    def cluster(name: str, address: tuple[str, int], http2: bool) -> str:
        h2 = (
            """
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: { http2_protocol_options: {} }"""
            if http2
            else ""
        )
        return f"""
  - name: {name}
    type: STATIC{h2}
    load_assignment:
      cluster_name: {name}
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: {address[0]}, port_value: {address[1]} }} }} }}"""

    return (
        "admin:\n  address: { socket_address: { address: 127.0.0.1, port_value: 0 } }\n"
        "static_resources:\n  listeners:"
        + listener("bare_http", http_port, "triton_http", "AUTO")
        + listener("bare_grpc", grpc_port, "triton_grpc", "HTTP2")
        + "\n  clusters:"
        + cluster("triton_http", triton_http, False)
        + cluster("triton_grpc", triton_grpc, True)
        + "\n"
    )
