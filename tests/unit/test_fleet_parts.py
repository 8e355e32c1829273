"""The fleet's pure parts: merging the nodes' status, and the gateway bootstrap Envoy accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.errors import GatewayError
from controlplane.fleet.api import merge_status
from controlplane.fleet.gateway import MODEL_HEADER, NodeAddress, render_fleet_bootstrap
from controlplane.gateway.envoy import ApiKey
from controlplane.gateway.envoy_process import EnvoyProcess

NODES = [NodeAddress(f"node-{i}", "127.0.0.1", 9000 + i, 9100 + i, 9200 + i) for i in (1, 2, 3)]


def status(state: str, **kw: object) -> dict[str, object]:
    return {"id": "m", "state": state, "reason": None, "instances": 0, "last_access": None, "memory_bytes": None,
            "last_cold_start_secs": None, "load_count": 0, **kw}  # fmt: skip


def test_merge_status_lists_the_nodes_holding_the_model():
    merged = merge_status({
        "node-1": status("ready", instances=1, memory_bytes=100, last_access=5.0, load_count=1),
        "node-2": status("unloaded", last_access=9.0, load_count=2),
        "node-3": status("loading", instances=2, last_cold_start_secs=0.4),
    })  # fmt: skip
    assert merged["state"] == "ready"
    assert merged["instances"] == 3 and merged["memory_bytes"] == 100 and merged["load_count"] == 3
    assert merged["last_access"] == 9.0 and merged["last_cold_start_secs"] == 0.4
    assert list(merged["nodes"]) == ["node-1", "node-3"]
    assert merged["nodes"]["node-3"]["state"] == "loading"


def test_merge_status_of_a_sleeping_or_failed_model():
    assert merge_status({"a": status("unloaded"), "b": status("unloaded")})["nodes"] == {}
    failed = merge_status({"a": status("unloaded"), "b": status("failed", reason="broken")})
    assert failed["state"] == "failed" and failed["reason"] == "broken" and list(failed["nodes"]) == ["b"]


@pytest.mark.parametrize("dns", [False, True])
def test_the_fleet_bootstrap_is_valid_for_envoy(tmp_path: Path, dns: bool):
    keys = [ApiKey("k", "api-0")]
    bootstrap = render_fleet_bootstrap(NODES, host="127.0.0.1", http_port=1, grpc_port=2, api_keys=keys, dns=dns)
    assert bootstrap.count(MODEL_HEADER) >= 2 and "hash_balance_factor" in bootstrap
    assert all(f'hostname: "{n.name}"' in bootstrap for n in NODES)
    assert "filters.http.lua" not in bootstrap  # the ring's key comes from Envoy's own filters: no Lua per request
    EnvoyProcess(bootstrap, tmp_path).validate()


def test_the_round_robin_bootstrap_ignores_the_model_and_is_valid_for_envoy(tmp_path: Path):
    bootstrap = render_fleet_bootstrap(NODES, host="127.0.0.1", http_port=1, grpc_port=2, lb_policy="round_robin")
    affine = render_fleet_bootstrap(NODES, host="127.0.0.1", http_port=1, grpc_port=2)
    assert bootstrap.count("load_balancing_policies.round_robin.v3.RoundRobin") == 2  # HTTP and gRPC clusters
    assert "ring_hash" not in bootstrap and "hash_balance_factor" not in bootstrap
    assert affine.count("ring_hash.v3.RingHash") == 2 and "round_robin" not in affine
    EnvoyProcess(bootstrap, tmp_path).validate()


def test_an_unknown_lb_policy_is_named_with_the_choices():
    with pytest.raises(GatewayError, match="'least_request'") as err:
        render_fleet_bootstrap(NODES, host="127.0.0.1", http_port=1, grpc_port=2, lb_policy="least_request")
    assert "ring_hash" in err.value.hint and "round_robin" in err.value.hint


def test_a_fleet_needs_nodes():
    with pytest.raises(GatewayError, match="at least one node"):
        render_fleet_bootstrap([], host="127.0.0.1", http_port=1, grpc_port=2)


async def test_fleet_api_docs_need_no_internet() -> None:
    import httpx

    from controlplane.fleet.api import create_fleet_app
    from controlplane.settings import Settings

    app = create_fleet_app(Settings(), lambda: [], gateway_http_url="http://127.0.0.1:1")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fleet") as client:
        page = (await client.get("/docs")).text
        assert "https://" not in page and "/docs-assets/swagger-ui-bundle.js" in page
        assert (await client.get("/docs-assets/swagger-ui-bundle.js")).status_code == 200
