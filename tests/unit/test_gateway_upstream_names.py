"""The gateway's Envoy reaches a Triton named by host name (compose's ``http://triton:8100``).

Envoy's STATIC clusters take IP addresses only: with ``--triton-url http://triton:8100`` (the shipped
docker-compose.yml) Envoy refused the bootstrap ("malformed IP address: triton") and the stack never served.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from controlplane.gateway.envoy import Upstream, render_bootstrap
from controlplane.gateway.envoy_process import EnvoyProcess


def _clusters(bootstrap: str) -> dict[str, dict]:
    return {c["name"]: c for c in yaml.safe_load(bootstrap)["static_resources"]["clusters"]}


def test_a_named_triton_is_resolved_by_envoy(tmp_path: Path) -> None:
    bootstrap = render_bootstrap(
        host="0.0.0.0", http_port=1, grpc_port=2, admin_port=0, wake_buffer_bytes=1024,
        triton_http=Upstream.parse("http://triton:8100"), triton_grpc=Upstream.parse("triton:8101"),
        activator_http=Upstream("127.0.0.1", 5), activator_grpc=Upstream("127.0.0.1", 6),
    )  # fmt: skip
    clusters = _clusters(bootstrap)
    named = [
        c
        for c in clusters.values()
        if any(
            ep["endpoint"]["address"]["socket_address"]["address"] == "triton"
            for p in c["load_assignment"]["endpoints"]
            for ep in p["lb_endpoints"]
        )
    ]
    assert named, "no cluster reaches triton"
    for c in named:
        assert c["type"] == "STRICT_DNS" and c["dns_lookup_family"] == "V4_ONLY", c["name"]
    # Clusters of IP addresses only stay STATIC (no resolver on the hot path of the embedded stack).
    assert all(c["type"] == "STATIC" for c in clusters.values() if c not in named)
    EnvoyProcess(bootstrap, tmp_path).validate()


def test_upstream_is_ip() -> None:
    assert Upstream("127.0.0.1", 1).is_ip and Upstream("::1", 1).is_ip
    assert not Upstream("triton", 1).is_ip and not Upstream("localhost", 1).is_ip
