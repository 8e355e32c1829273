"""The bench's route variants (bench/gateway_filters.py, ``ROUTE_EDITS``) are the served bootstrap less one thing.

Each edit must match the template as it is (else the bench would measure the gateway twice under two names), take
out only its part, and leave a bootstrap Envoy accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bench.gateway_filters import ROUTE_EDITS, _without
from controlplane.gateway.envoy import Upstream, render_bootstrap
from controlplane.gateway.envoy_process import EnvoyProcess


def _served() -> str:
    return render_bootstrap(
        host="127.0.0.1", http_port=1, grpc_port=2, admin_port=0, wake_buffer_bytes=1024,
        triton_http=Upstream("127.0.0.1", 3), triton_grpc=Upstream("127.0.0.1", 4),
        activator_http=Upstream("127.0.0.1", 5), activator_grpc=Upstream("127.0.0.1", 6),
    )  # fmt: skip


def _routes(bootstrap: str) -> list[dict]:
    listeners = yaml.safe_load(bootstrap)["static_resources"]["listeners"]
    return [
        route
        for listener in listeners
        for f in listener["filter_chains"][0]["filters"]
        for host in f["typed_config"]["route_config"]["virtual_hosts"]
        for route in host["routes"]
    ]


def _hcms(bootstrap: str) -> list[dict]:
    listeners = yaml.safe_load(bootstrap)["static_resources"]["listeners"]
    return [f["typed_config"] for listener in listeners for f in listener["filter_chains"][0]["filters"]]


# What each edit takes away, read from the parsed bootstrap: (served count, count after the edit).
PARTS = {
    "no_request_id": lambda b: sum(h["generate_request_id"] for h in _hcms(b)),
    "no_retry": lambda b: sum("retry_policy" in r.get("route", {}) for r in _routes(b)),
    "no_gate": lambda b: sum("runtime_fraction" in r["match"] for r in _routes(b)),
    "no_access_log": lambda b: sum("access_log" in h for h in _hcms(b)),
}


@pytest.mark.parametrize("variant", sorted(ROUTE_EDITS))
def test_each_route_edit_takes_out_its_part_only(variant: str, tmp_path: Path) -> None:
    served = _served()
    edited = _without(served, variant)
    assert PARTS[variant](served) > 0 and PARTS[variant](edited) == 0, variant
    for other in set(PARTS) - {variant}:
        assert PARTS[other](edited) == PARTS[other](served), (variant, other)
    assert len(_routes(edited)) == len(_routes(served)) - (PARTS["no_gate"](served) if variant == "no_gate" else 0)
    EnvoyProcess(edited, tmp_path).validate()


def test_an_edit_that_no_longer_matches_is_an_error() -> None:
    with pytest.raises(ValueError, match="no_gate: its pattern no longer matches"):
        _without("static_resources: {}", "no_gate")
