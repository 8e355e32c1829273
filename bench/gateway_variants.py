"""The gateway less one part, for the benches that measure what each part costs (gateway_filters, envoy_cpu).

Production renders one bootstrap (``controlplane.gateway.envoy.render_bootstrap``); the bench parses it and takes a
part out of the data: a Lua filter (``FILTER_VARIANTS``) or something the routes do (``ROUTE_EDITS``). An edit that
finds nothing to take out is an error naming the variant, so a change to the template fails the bench rather than
measuring the gateway twice under two names. The edited bootstrap is written as JSON, which Envoy reads as YAML.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from typing import Any

import yaml

from controlplane.gateway.envoy import WAKE_FILTER_NAME

Bootstrap = Callable[[tuple[int, int]], str]  # an Envoy's bootstrap for its (HTTP, gRPC) ports
Config = dict[str, Any]

HCM = "envoy.filters.network.http_connection_manager"
# The gateway's Lua filters by part: its listener filters and the actions of its on-error composites.
STREAM_WAKE_PREFIX = "snoozeml.stream_wake."
ON_ERROR = {"hints": "snoozeml.hints_lua", "retry_marks": "snoozeml.retry_mark_lua"}
LISTENER_FILTERS = {"hints": ("snoozeml.hints",), "wake": (WAKE_FILTER_NAME,)}
FILTERS = ("hints", "wake", "retry_marks")
# Each filter left out in turn; no_auth: rendered without keys; no_filters: without keys and without any filter (what
# the routes alone cost: retry, gate, request id).
FILTER_VARIANTS: dict[str, tuple[str, ...]] = {
    "no_auth": (),
    **{f"no_{name}": (name,) for name in FILTERS},
    "no_filters": FILTERS,
}
VARIANTS = tuple(FILTER_VARIANTS)
# Rendered without keys (as ``make serve`` runs the gateway, --no-auth): their clients send none either.
KEYLESS_VARIANTS = ("no_auth", "no_filters")


class EditError(ValueError):
    """A variant's edit found nothing to take out of the gateway's bootstrap."""

    def __init__(self, variant: str, what: str) -> None:
        super().__init__(
            f"{variant}: no {what} in the gateway's bootstrap any more; its edit no longer matches the template "
            "(controlplane/gateway/envoy.yaml.j2): update bench/gateway_variants.py"
        )


def _hcms(config: Config) -> Iterator[Config]:
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                if f["name"] == HCM:
                    yield f["typed_config"]


def _routes(config: Config) -> Iterator[tuple[list[Config], Config]]:
    for hcm in _hcms(config):
        for host in hcm["route_config"]["virtual_hosts"]:
            for route in host["routes"]:
                yield host["routes"], route


def _no_request_id(config: Config) -> int:
    hcms = [h for h in _hcms(config) if h.get("generate_request_id")]
    for hcm in hcms:  # Envoy's x-request-id not generated (Triton forwards it to the stub, which journals it)
        hcm["generate_request_id"] = False
    return len(hcms)


def _no_retry(config: Config) -> int:
    return sum(route["route"].pop("retry_policy", None) is not None for _, route in _routes(config) if "route" in route)


def _no_gate(config: Config) -> int:
    gates = [(routes, route) for routes, route in _routes(config) if "runtime_fraction" in route["match"]]
    for routes, route in gates:
        routes.remove(route)
    return len(gates)


def _no_access_log(config: Config) -> int:
    return sum(hcm.pop("access_log", None) is not None for hcm in _hcms(config))


# What the routes do besides filters, each taken out of the served bootstrap in turn (section gateway_routes):
# the request id, the retry to the activator (and the request copy it keeps), the snapshot gate (a runtime_fraction
# route ahead of every other), the access log of held requests (a metadata filter per request).
ROUTE_EDITS: dict[str, Callable[[Config], int]] = {
    "no_request_id": _no_request_id,
    "no_retry": _no_retry,
    "no_gate": _no_gate,
    "no_access_log": _no_access_log,
}
ROUTE_VARIANTS = tuple(ROUTE_EDITS)


def _without_filter(config: Config, part: str) -> int:
    """Take one Lua filter out: from the listeners' filter chains (and the routes that turn it on), and from the
    upstream on-error composites (the composite and the upstream filter chain go when nothing is left in them)."""
    names = LISTENER_FILTERS.get(part, ())
    taken = 0
    for hcm in _hcms(config):
        kept = [f for f in hcm["http_filters"] if not _is_filter(f["name"], part, names)]
        taken += len(hcm["http_filters"]) - len(kept)
        hcm["http_filters"] = kept
    for _, route in _routes(config):
        per_filter = route.get("typed_per_filter_config", {})
        for name in [n for n in per_filter if _is_filter(n, part, names)]:
            del per_filter[name]
        if "typed_per_filter_config" in route and not per_filter:
            del route["typed_per_filter_config"]
    if part in ON_ERROR:
        taken += sum(_without_on_error(cluster, ON_ERROR[part]) for cluster in config["static_resources"]["clusters"])
    return taken


def _is_filter(name: str, part: str, names: tuple[str, ...]) -> bool:
    return name in names or (part == "wake" and name.startswith(STREAM_WAKE_PREFIX))


def _without_on_error(cluster: Config, action: str) -> int:
    options = cluster.get("typed_extension_protocol_options", {})
    for key, protocol in list(options.items()):
        filters = protocol.get("http_filters", [])
        for f in [f for f in filters if f["name"] == "snoozeml.on_error"]:
            matchers = f["typed_config"]["xds_matcher"]["matcher_list"]["matchers"]
            kept = [m for m in matchers if m["on_match"]["action"]["name"] != action]
            if len(kept) == len(matchers):
                continue
            if kept:
                f["typed_config"]["xds_matcher"]["matcher_list"]["matchers"] = kept
            else:
                filters.remove(f)
            if all(f["name"] == "envoy.filters.http.upstream_codec" for f in filters):
                del protocol["http_filters"]  # no upstream filter left: Envoy's own upstream codec alone
                if protocol["explicit_http_config"] == {"http_protocol_options": {}}:
                    del options[key]  # HTTP/1.1 and no filter: Envoy's defaults, as the template writes them
            if not options:
                del cluster["typed_extension_protocol_options"]
            return 1
    return 0


def without(bootstrap: str, variant: str) -> str:
    """The served ``bootstrap`` less what ``variant`` takes out (``FILTER_VARIANTS`` but for keys, which the
    caller renders without, or ``ROUTE_EDITS``); ``EditError`` when there is nothing to take out."""
    config = yaml.safe_load(bootstrap)
    if variant in ROUTE_EDITS:
        if not ROUTE_EDITS[variant](config):
            raise EditError(variant, variant.removeprefix("no_").replace("_", " "))
    else:
        for part in FILTER_VARIANTS[variant]:
            if not _without_filter(config, part):
                raise EditError(variant, f"{part} filter")
    return json.dumps(config, indent=1)


def with_grpc_retry_buffer(bootstrap: str, limit: int, *, served: int) -> str:
    """The served ``bootstrap`` whose gRPC listener keeps requests up to ``limit`` bytes for the retry (``served``:
    the limit it is rendered with)."""
    config = yaml.safe_load(bootstrap)
    hosts = [
        host
        for hcm in _hcms(config)
        if hcm["stat_prefix"] == "kserve_grpc"
        for host in hcm["route_config"]["virtual_hosts"]
        if host.get("request_body_buffer_limit") == served
    ]
    if not hosts:
        raise EditError(f"a gRPC retry buffer of {limit}", f"gRPC listener keeping {served} bytes")
    for host in hosts:
        host["request_body_buffer_limit"] = limit
    return json.dumps(config, indent=1)


def check_variants(variants: tuple[str, ...]) -> None:
    """``ValueError`` naming the known variants for any other."""
    if unknown := set(variants) - set(FILTER_VARIANTS) - set(ROUTE_EDITS):
        raise ValueError(f"unknown gateway variants {sorted(unknown)}: one of {', '.join((*VARIANTS, *ROUTE_EDITS))}")


def variant_bootstraps(
    bootstrap_of: Callable[..., str], variants: tuple[str, ...], *, twin: bool
) -> dict[str, Bootstrap]:
    """The twin (the served bootstrap again) and each variant of ``bootstrap_of(ports, keys=...)``: a filter left
    out (``FILTER_VARIANTS``) or a part of the routes (``ROUTE_EDITS``)."""
    check_variants(variants)
    out: dict[str, Bootstrap] = {"gateway_twin": bootstrap_of} if twin else {}
    for variant in variants:
        keys = variant not in KEYLESS_VARIANTS
        out[f"gateway_{variant}"] = functools.partial(_variant_of, bootstrap_of, variant, keys)
    return out


def _variant_of(bootstrap_of: Callable[..., str], variant: str, keys: bool, ports: tuple[int, int]) -> str:
    return _variant(bootstrap_of(ports, keys=keys), variant)


def _variant(bootstrap: str, variant: str) -> str:
    return bootstrap if variant == "no_auth" else without(bootstrap, variant)
