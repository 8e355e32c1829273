"""The Envoys the gateway is measured against: the bare hop (a router to Triton and nothing else) and the client's
ceiling (an Envoy that answers every request itself). Written by hand, not rendered from the gateway's template:
they must not change when the gateway does."""

from __future__ import annotations

import json


def _listener(name: str, port: int, codec: str, route: str, *, buffer: bool = False, key: str | None = None) -> str:
    # A direct response sent before the request body is read makes Envoy close an HTTP/1.1 connection:
    # the buffer filter reads the whole request first, as a real server does.
    buffer_filter = (
        """
          - name: envoy.filters.http.buffer
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer
              max_request_bytes: 1048576"""
        if buffer
        else ""
    )
    if key is not None:  # the same key check as the gateway's (api_key_auth, both key sources)
        buffer_filter += f"""
          - name: envoy.filters.http.api_key_auth
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.api_key_auth.v3.ApiKeyAuth
              credentials: [{{ key: {json.dumps(key)}, client: bench }}]
              key_sources: [{{ header: x-api-key }}, {{ header: authorization }}]"""
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
          http_filters:{buffer_filter}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: / }}{route}"""


def _cluster(name: str, address: tuple[str, int], http2: bool) -> str:
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


_ADMIN = "admin:\n  address: { socket_address: { address: 127.0.0.1, port_value: 0 } }\nstatic_resources:\n  listeners:"


def bare_envoy_bootstrap(
    *,
    http_port: int,
    grpc_port: int,
    triton_http: tuple[str, int],
    triton_grpc: tuple[str, int],
    key: str | None = None,
) -> str:
    """The reference hop: Envoy proxying both ports to Triton, no retry, no auth, no local-reply mapping; with
    ``key``, Envoy's API key check in front of its router (the reference for a gateway with keys)."""
    return (
        _ADMIN
        + _listener(
            "bare_http", http_port, "AUTO", "\n                route: { cluster: triton_http, timeout: 0s }", key=key
        )
        + _listener(
            "bare_grpc", grpc_port, "HTTP2", "\n                route: { cluster: triton_grpc, timeout: 0s }", key=key
        )
        + "\n  clusters:"
        + _cluster("triton_http", triton_http, False)
        + _cluster("triton_grpc", triton_grpc, True)
        + "\n"
    )


def ceiling_bootstrap(*, http_port: int, grpc_port: int) -> str:
    """The client's ceiling: Envoy answering every request itself (direct response, no upstream).

    HTTP gets a small 200 JSON body; gRPC gets a trailers-only OK (grpc-status 0 in the headers). The
    load loop against it does everything it does against Triton except wait for a model."""
    http_route = """
                direct_response: { status: 200, body: { inline_string: '{"model_name":"ceiling","outputs":[]}' } }
                response_headers_to_add:
                - header: { key: content-type, value: application/json }
                  append_action: OVERWRITE_IF_EXISTS_OR_ADD"""
    grpc_route = """
                direct_response: { status: 200 }
                response_headers_to_add:
                - header: { key: content-type, value: application/grpc }
                  append_action: OVERWRITE_IF_EXISTS_OR_ADD
                - header: { key: grpc-status, value: "0" }"""
    return (
        _ADMIN
        + _listener("ceiling_http", http_port, "AUTO", http_route, buffer=True)
        + _listener("ceiling_grpc", grpc_port, "HTTP2", grpc_route, buffer=True)
        + "\n"
    )
