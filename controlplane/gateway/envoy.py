"""Envoy, the client-facing KServe v2 gateway: its bootstrap, and the gateway built from the settings
(``EnvoyGateway``; running the Envoy process itself is ``envoy_process``).

Warm traffic never touches Python: Envoy proxies inference to Triton. A request for a sleeping
model gets Triton's "not found" (HTTP 404, grpc-status 5) and Envoy's retry policy re-sends it,
body included, to priority 1 of the same cluster, the activator (``activator.py``), which wakes the
model and forwards the request. ``wake_buffer_bytes`` bounds the HTTP body Envoy keeps for that retry;
gRPC requests carry no content-length a route could match, so the gRPC listener keeps any message
Triton accepts (``GRPC_RETRY_BUFFER_BYTES``) and a unary ``ModelInfer`` meets no Lua at all. Requests
that cannot be retried, streams (gRPC ``ModelStreamInfer``, HTTP ``generate_stream``) and HTTP bodies
over ``wake_buffer_bytes``, are woken by the wake filter (``wake_lua.py``) before their body moves on,
and hold their model in use until they end.

A request that met a dead python stub (Triton's whole message ``Stub process '<instance>' is not
healthy.``, defined once in ``controlplane.triton.dead_stub``: gRPC INTERNAL with it as grpc-message;
HTTP 500 with it as the body's error, which a Lua filter on the upstream side of the ``infer_http``
cluster marks with a header, since a retry policy cannot read bodies) is retried to the activator
too. Every inference request carries an ``x-request-id`` (Envoy's own, kept across the retry: a UUID
when the client sent none), which Triton forwards to the model's process; with it the activator tells a
request that was running when the process died (refused: it never runs twice) from one that only met
the dead process (sent again after recovery). A model's own errors are never retried: the runtime
starts each with ``[snooze:<kind>] model '<id>':``, so none is Triton's whole message.

Gateway metrics are Envoy's own stats: ``EnvoyGateway.prometheus_url`` (loopback only). Useful series:
``envoy_http_downstream_rq_xx{envoy_http_conn_manager_prefix="kserve_http|kserve_grpc"}``,
``envoy_http_downstream_rq_time``, ``envoy_cluster_upstream_rq_retry{envoy_cluster_name="infer_http|infer_grpc"}``
(wake retries), ``envoy_cluster_retry_or_shadow_abandoned`` (HTTP requests over ``wake_buffer_bytes``) and
``envoy_http_api_key_auth_*`` / 401 counts for auth refusals. The router keeps no per-response-code cluster
series (``dynamic_stats: false``: ``upstream_rq_2xx``, ``upstream_rq_time`` and the like cost a name lookup per
answer); the listeners' ``downstream_rq_xx`` count the same answers.

The snapshot gate: the first route of each listener answers every request with 503 (HTTP: the KServe
JSON error shape; gRPC: UNAVAILABLE) while the runtime key ``GATE_RUNTIME_KEY`` is at 100%.
``EnvoyGateway.close_gate()`` / ``open_gate()`` set it through the admin ``/runtime_modify`` (the
bootstrap has an admin runtime layer for this). Unlike a listener drain it also holds for connections
opened before: a route is chosen per request. Open, it costs one runtime lookup per request.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

import jinja2

from controlplane.errors import GatewayError
from controlplane.gateway import grpc_names
from controlplane.gateway.envoy_process import EnvoyProcess
from controlplane.gateway.lua import lua_string, program
from controlplane.gateway.wake_lua import (
    METADATA_KEY,
    METADATA_NAMESPACE,
    grpc_wake_chain,
    held_log_path,
    http_wake_lua,
    ready_dir_path,
)
from controlplane.modes import AuthMode
from controlplane.settings import Settings
from controlplane.triton.dead_stub import GRPC_MESSAGE_REGEX, LUA_HTTP_BODY_PATTERN
from controlplane.triton.miss import GRPC_MESSAGE_REGEXES as MISS_MESSAGE_REGEXES
from controlplane.triton.miss import LUA_HTTP_BODY_PATTERNS as MISS_LUA_PATTERNS

# gRPC answers retried to the activator: Triton's own words for a model it does not serve now (asleep, unloading; not
# the status alone, which a model's own error may carry after it ran) and for a dead stub.
GRPC_RETRY_HEADERS = (
    *({"name": "grpc-message", "string_match": {"safe_regex": {"regex": r}}} for r in MISS_MESSAGE_REGEXES),
    {"name": "grpc-message", "string_match": {"safe_regex": {"regex": GRPC_MESSAGE_REGEX}}},
)
# The gRPC retry buffer: the largest message Triton's gRPC server and tritonclient accept (INT32_MAX), so
# every unary ModelInfer can be re-sent to the activator with no Lua reading its frame size. Envoy keeps a
# copy of a request only while it runs, as large as the request itself.
GRPC_RETRY_BUFFER_BYTES = 2**31 - 1
# HTTP: Triton's 500 for a dead stub and its 404 / 503 for a model it does not serve now, marked by the Lua filter
# on the infer_http cluster (retry_mark.lua) from the whole body.
DEAD_STUB_HEADER = "x-snooze-dead-stub"
MISS_HEADER = "x-snooze-triton-miss"
HTTP_RETRY_HEADERS = tuple({"name": h, "present_match": True} for h in (MISS_HEADER, DEAD_STUB_HEADER))
# Triton's own words for a restricted API first (its --http-restricted-api answer), then snoozeml's.
UNAUTHORIZED_MESSAGE = (
    "This API is restricted, expecting header 'x-api-key': snoozeml: missing or invalid API key: "
    "send it as the X-API-Key header or 'Authorization: Bearer <key>' (gRPC metadata x-api-key or authorization)"
)
MAX_UPSTREAM = 100_000
WAKE_FILTER_NAME = "snoozeml.wake"  # the first wake filter (HTTP's only one; gRPC's first stage)
GATE_RUNTIME_KEY = "snooze.gateway.closed"
GATE_CLOSED_MESSAGE = (
    "snoozeml is not admitting requests: a snapshot of this workload is being taken; retry once it is restored"
)


@dataclass(frozen=True)
class Upstream:
    """One upstream address."""

    host: str
    port: int

    @classmethod
    def parse(cls, address: str) -> Upstream:
        """``http://host:port``, ``host:port``."""
        parts = urlsplit(address if "//" in address else f"//{address}")
        if not parts.hostname or not parts.port:
            raise GatewayError(f"upstream address {address!r} needs a host and a port", hint="e.g. 127.0.0.1:8001")
        return cls(parts.hostname, parts.port)

    @property
    def is_ip(self) -> bool:
        """An IP address (Envoy STATIC) rather than a name to resolve (STRICT_DNS): compose's ``triton``."""
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True


@dataclass(frozen=True)
class ApiKey:
    key: str
    client: str


def gateway_keys(settings: Settings) -> list[ApiKey]:
    """Every key Envoy accepts (inference and admin scope); empty when auth is off."""
    if settings.auth == AuthMode.OFF:
        return []
    keys = [ApiKey(k.get_secret_value(), f"api-{i}") for i, k in enumerate(settings.api_keys)]
    keys += [ApiKey(k.get_secret_value(), f"admin-{i}") for i, k in enumerate(settings.admin_keys)]
    if not keys:
        raise GatewayError(
            "auth is on but no API keys are configured",
            hint="set SNOOZE_API_KEYS / SNOOZE_ADMIN_KEYS, or SNOOZE_AUTH=off for local use only",
        )
    return keys


def render_template(package: str, name: str, **values: object) -> str:
    """An Envoy bootstrap template of ``package`` rendered with ``values`` (every name must be given)."""
    template = resources.files(package).joinpath(name).read_text(encoding="utf-8")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    return env.from_string(template).render(**values)


def render_bootstrap(
    *,
    host: str,
    http_port: int,
    grpc_port: int,
    admin_port: int,
    triton_http: Upstream,
    triton_grpc: Upstream,
    activator_http: Upstream,
    activator_grpc: Upstream,
    wake_buffer_bytes: int,
    api_keys: Sequence[ApiKey] = (),
    held_log: Path | str = os.devnull,
    ready_dir: Path | str | None = None,
) -> str:
    """The Envoy bootstrap YAML. No ``api_keys`` = no auth filter (auth off). ``held_log``: the access log
    of held requests' ends, which the activator tails (``held_log_path``). ``ready_dir``: the ready flags
    (``ready_dir_path``); None: every stream waits for the activator's answer before it moves on."""
    if wake_buffer_bytes <= 0:
        raise GatewayError(f"wake_buffer_bytes must be positive, got {wake_buffer_bytes}")
    flags = None if ready_dir is None else str(ready_dir)
    grpc_wake = grpc_wake_chain(flags)
    hints_dir = lua_string("" if flags is None else flags.rstrip("/") + "/")
    marks = [(LUA_HTTP_BODY_PATTERN, DEAD_STUB_HEADER), *((p, MISS_HEADER) for p in MISS_LUA_PATTERNS)]
    retry_mark_lua = program(
        "retry_mark", marks="{" + ", ".join(f"{{{lua_string(p)}, {lua_string(h)}}}" for p, h in marks) + "}"
    )
    return render_template(
        "controlplane.gateway",
        "envoy.yaml.j2",
        host=host,
        http_port=http_port,
        grpc_port=grpc_port,
        admin_port=admin_port,
        triton_http=triton_http,
        triton_grpc=triton_grpc,
        activator_http=activator_http,
        activator_grpc=activator_grpc,
        wake_buffer_bytes=wake_buffer_bytes,
        grpc_retry_buffer_bytes=GRPC_RETRY_BUFFER_BYTES,
        api_keys=list(api_keys),
        activator_grpc_methods=grpc_names.ACTIVATOR_ROUTED,
        grpc_service=grpc_names.SERVICE,
        grpc_retry_headers=GRPC_RETRY_HEADERS,
        http_retry_headers=HTTP_RETRY_HEADERS,
        unauthorized_message=UNAUTHORIZED_MESSAGE,
        max_upstream=MAX_UPSTREAM,
        gate_runtime_key=GATE_RUNTIME_KEY,
        gate_closed_message=GATE_CLOSED_MESSAGE,
        http_wake_lua=[http_wake_lua(wake_buffer_bytes, flags)],
        grpc_wake_lua=grpc_wake,
        wake_filter_names=[WAKE_FILTER_NAME] + [f"snoozeml.stream_wake.{i}" for i in range(2, len(grpc_wake) + 1)],
        hold_namespace=METADATA_NAMESPACE,
        hold_key=METADATA_KEY,
        held_log=str(held_log),
        **_on_error_filters(program("error_hints", ready_dir=hints_dir), retry_mark_lua),
    )


def _on_error_filters(hints_lua: str, retry_mark_lua: str) -> dict[str, list[tuple[str, ...]]]:
    """The Lua filters made only for an error answer (header, value, filter name, source): the shape hint
    (gRPC: on its listener, for a trailers-only INVALID_ARGUMENT; HTTP: on the Triton clusters' upstream side,
    for a 400) and the retry marker (infer_http's upstream side, for a 500, 404 or 503)."""
    return {
        "grpc_hints": [("grpc-status", "3", "snoozeml.hints_lua", hints_lua)],
        "http_hints": [(":status", "400", "snoozeml.hints_lua", hints_lua)],
        "retry_marks": [(":status", "500|404|503", "snoozeml.retry_mark_lua", retry_mark_lua)],
    }


class EnvoyGateway(EnvoyProcess):
    """The snoozeml gateway: Envoy with the rendered bootstrap, listening on ``settings.host``.

    ``triton_*`` and ``activator_*`` are ``host:port`` (or ``http://host:port``) addresses; the
    activator must be listening before ``start()`` only for the wake path to work, not for Envoy.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        triton_http: str,
        triton_grpc: str,
        activator_http: str,
        activator_grpc: str,
        work_dir: Path | None = None,
        concurrency: int = 2,
        binary: Path | None = None,
    ) -> None:
        self.host = settings.host
        self.http_port = settings.http_port
        self.grpc_port = settings.grpc_port
        bootstrap = render_bootstrap(
            host=settings.host,
            http_port=settings.http_port,
            grpc_port=settings.grpc_port,
            admin_port=settings.envoy_admin_port,
            triton_http=Upstream.parse(triton_http),
            triton_grpc=Upstream.parse(triton_grpc),
            activator_http=Upstream.parse(activator_http),
            activator_grpc=Upstream.parse(activator_grpc),
            wake_buffer_bytes=settings.wake_buffer_bytes,
            held_log=held_log_path(settings),
            ready_dir=ready_dir_path(settings),
            api_keys=gateway_keys(settings),
        )
        connect_host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
        super().__init__(
            bootstrap,
            work_dir or settings.work_dir / "envoy",
            listen=[(connect_host, settings.http_port), (connect_host, settings.grpc_port)],
            concurrency=concurrency,
            log_level="debug" if settings.log_level == "debug" else "warning",
            binary=binary,
            name="gateway",
        )

    def close_gate(self) -> None:
        """Answer every request with 503 (gRPC UNAVAILABLE) from now on, on open connections too."""
        self._admin("POST", "/runtime_modify", {GATE_RUNTIME_KEY: "100"})

    def open_gate(self) -> None:
        self._admin("POST", "/runtime_modify", {GATE_RUNTIME_KEY: "0"})

    def gate_closed(self) -> bool:
        """What Envoy's runtime says now (the bootstrap's default, 0%, is open)."""
        entry = self._admin_get("/runtime?format=json").json().get("entries", {}).get(GATE_RUNTIME_KEY, {})
        return entry.get("final_value", "0") not in ("", "0")

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """``host:port``, the form tritonclient.grpc expects."""
        return f"{self.host}:{self.grpc_port}"

    def __enter__(self) -> EnvoyGateway:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
