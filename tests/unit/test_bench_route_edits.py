"""The bench's gateway variants (bench/gateway_variants.py) are the served bootstrap less one thing.

Each edit works on the bootstrap production renders (``render_bootstrap``, with no bench-only parameter): it must
find its part in the template as it is (else the bench would measure the gateway twice under two names), take out
only that part, and leave a bootstrap Envoy accepts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from bench.gateway_variants import FILTER_VARIANTS, ROUTE_EDITS, EditError, with_grpc_retry_buffer, without
from controlplane.gateway.envoy import GRPC_RETRY_BUFFER_BYTES, ApiKey, Upstream, render_bootstrap
from controlplane.gateway.envoy_process import EnvoyProcess


def _served(tmp_path: Path | None = None) -> str:
    return render_bootstrap(
        host="127.0.0.1", http_port=1, grpc_port=2, admin_port=0, wake_buffer_bytes=1024,
        triton_http=Upstream("127.0.0.1", 3), triton_grpc=Upstream("127.0.0.1", 4),
        activator_http=Upstream("127.0.0.1", 5), activator_grpc=Upstream("127.0.0.1", 6),
        api_keys=[ApiKey("bench-key", "bench")], ready_dir=tmp_path,
    )  # fmt: skip


def _listeners(bootstrap: str) -> list[dict]:
    return yaml.safe_load(bootstrap)["static_resources"]["listeners"]


def _routes(bootstrap: str) -> list[dict]:
    return [
        route
        for listener in _listeners(bootstrap)
        for f in listener["filter_chains"][0]["filters"]
        for host in f["typed_config"]["route_config"]["virtual_hosts"]
        for route in host["routes"]
    ]


def _hcms(bootstrap: str) -> list[dict]:
    return [f["typed_config"] for listener in _listeners(bootstrap) for f in listener["filter_chains"][0]["filters"]]


def _lua(bootstrap: str, prefix: str) -> int:
    """Lua filters named ``prefix``...: in the listeners' chains and in the clusters' on-error composites."""
    listeners = sum(f["name"].startswith(prefix) for h in _hcms(bootstrap) for f in h["http_filters"])
    clusters = sum(
        m["on_match"]["action"]["name"].startswith(prefix)
        for c in yaml.safe_load(bootstrap)["static_resources"]["clusters"]
        for o in c.get("typed_extension_protocol_options", {}).values()
        for f in o.get("http_filters", [])
        if f["name"] == "snoozeml.on_error"
        for m in f["typed_config"]["xds_matcher"]["matcher_list"]["matchers"]
    )
    return listeners + clusters


# What each edit takes away, read from the parsed bootstrap.
PARTS: dict[str, Callable[[str], int]] = {
    "no_request_id": lambda b: sum(h["generate_request_id"] for h in _hcms(b)),
    "no_retry": lambda b: sum("retry_policy" in r.get("route", {}) for r in _routes(b)),
    "no_gate": lambda b: sum("runtime_fraction" in r["match"] for r in _routes(b)),
    "no_access_log": lambda b: sum("access_log" in h for h in _hcms(b)),
    "no_hints": lambda b: _lua(b, "snoozeml.hints"),
    "no_wake": lambda b: _lua(b, "snoozeml.wake") + _lua(b, "snoozeml.stream_wake"),
    "no_retry_marks": lambda b: _lua(b, "snoozeml.retry_mark"),
}


@pytest.mark.parametrize("variant", sorted(ROUTE_EDITS))
def test_each_route_edit_takes_out_its_part_only(variant: str, tmp_path: Path) -> None:
    served = _served()
    edited = without(served, variant)
    assert PARTS[variant](served) > 0 and PARTS[variant](edited) == 0, variant
    for other in set(PARTS) - {variant}:
        assert PARTS[other](edited) == PARTS[other](served), (variant, other)
    assert len(_routes(edited)) == len(_routes(served)) - (PARTS["no_gate"](served) if variant == "no_gate" else 0)
    EnvoyProcess(edited, tmp_path).validate()


@pytest.mark.parametrize("variant", ["no_hints", "no_wake", "no_retry_marks", "no_filters"])
def test_each_filter_variant_takes_out_its_filters_only(variant: str, tmp_path: Path) -> None:
    served = _served(tmp_path / "ready")
    edited = without(served, variant)
    gone = {f"no_{part}" for part in FILTER_VARIANTS[variant]}
    for part in ("no_hints", "no_wake", "no_retry_marks"):
        assert PARTS[part](served) > 0, part
        assert PARTS[part](edited) == (0 if part in gone else PARTS[part](served)), (variant, part)
    for part in ROUTE_EDITS:
        assert PARTS[part](edited) == PARTS[part](served), (variant, part)
    assert len(_routes(edited)) == len(_routes(served))
    if "no_wake" in gone:  # no route turns on a wake filter that is not there
        assert not [r for r in _routes(edited) if "wake" in str(r.get("typed_per_filter_config", {}))]
    EnvoyProcess(edited, tmp_path).validate()


def test_the_grpc_retry_buffer_edit_changes_only_the_grpc_listener(tmp_path: Path) -> None:
    served = _served()
    edited = with_grpc_retry_buffer(served, 1024, served=GRPC_RETRY_BUFFER_BYTES)
    limits = {
        h["stat_prefix"]: [v["request_body_buffer_limit"] for v in h["route_config"]["virtual_hosts"]]
        for h in _hcms(edited)
    }
    assert limits == {"kserve_http": [1024], "kserve_grpc": [1024]}
    with pytest.raises(EditError, match="gRPC listener keeping"):
        with_grpc_retry_buffer(edited, 1024, served=GRPC_RETRY_BUFFER_BYTES)
    EnvoyProcess(edited, tmp_path).validate()


def test_an_edit_that_no_longer_matches_is_an_error() -> None:
    no_gate = without(_served(), "no_gate")
    with pytest.raises(EditError, match="no_gate: no gate in the gateway's bootstrap any more"):
        without(no_gate, "no_gate")
    no_hints = without(_served(), "no_hints")
    with pytest.raises(EditError, match="no_hints: no hints filter"):
        without(no_hints, "no_hints")
