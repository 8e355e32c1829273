"""The shipped docker-compose.yml, run for real: a Docker engine, the offline images, a compose runner.

Used by tests/compose (``make compose-test``) and by the structural compose tests (which compose binary
can read the shipped file).

Compose runner: compose v2 (``docker compose`` or a v2 ``docker-compose``) where the machine has it;
otherwise the Python ``docker-compose`` 1.29 (Debian's package, PyPI), which reads the same file except
its top-level ``name`` (a compose v2 key it refuses): for 1.x the runner passes that name as ``-p`` and
hands compose a copy of the file without that one line, next to the original (relative paths unchanged).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
TEST_OVERRIDE = ROOT / "tests" / "compose" / "docker-compose.test.yml"
ENGINE_SCRIPT = ROOT / "deploy" / "docker" / "engine.sh"
BUILD_SCRIPT = ROOT / "deploy" / "docker" / "build-images.sh"
# engine.sh's exit codes (deploy/docker/engine.sh)
ENGINE_EXIT = {
    10: "not root",
    11: "no dockerd and it cannot be installed",
    12: "dockerd did not answer",
    13: "no docker client",
}


def compose_binary() -> tuple[list[str], bool] | None:
    """(command, legacy): compose v2 when available (legacy False), else docker-compose 1.x (True); None."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"], False
    legacy = shutil.which("docker-compose")
    if legacy:
        proc = subprocess.run([legacy, "version", "--short"], capture_output=True, text=True)
        if proc.returncode == 0:
            return [legacy], not proc.stdout.strip().lstrip("v").startswith("2")
    return None


def project_name(compose_file: Path = COMPOSE_FILE) -> str:
    m = re.search(r"^name:\s*(\S+)\s*$", compose_file.read_text(), re.MULTILINE)
    assert m, f"{compose_file}: no top-level name"
    return m.group(1)


def legacy_copy(compose_file: Path, host_network: Sequence[str] = ()) -> Path:
    """What docker-compose 1.x can read of ``compose_file``, beside it: without the top-level ``name``
    (1.x refuses the key) and, for the services in ``host_network`` (an override puts them on the host
    network), without ``ports``: compose v2 passes them on and the engine discards them for a host-network
    container, but 1.x (docker-py) refuses the pair, and a 1.x override cannot remove list items."""
    text = compose_file.read_text()
    stripped, n = re.subn(r"^name:.*\n", "", text, count=1, flags=re.MULTILINE)
    assert n == 1, f"{compose_file}: no top-level name line"
    if host_network:
        import yaml

        data = yaml.safe_load(stripped)
        for service in host_network:
            data["services"][service].pop("ports", None)
        stripped = yaml.safe_dump(data, sort_keys=False, width=1000)
    copy = compose_file.with_name(f".{compose_file.stem}.compose1-{os.getpid()}.yml")
    copy.write_text(stripped)
    return copy


def host_network_services(override: Path) -> list[str]:
    import yaml

    services = (yaml.safe_load(override.read_text()) or {}).get("services") or {}
    return [name for name, svc in services.items() if (svc or {}).get("network_mode") == "host"]


def ensure_engine() -> tuple[bool, str]:
    """Start a Docker engine if none answers (deploy/docker/engine.sh); (ok, what happened)."""
    proc = subprocess.run([str(ENGINE_SCRIPT)], capture_output=True, text=True, timeout=600)
    if proc.returncode == 0:
        return True, proc.stderr.strip()
    why = ENGINE_EXIT.get(proc.returncode, f"exit {proc.returncode}")
    return False, f"no Docker engine ({why}): {proc.stderr.strip()}"


def build_images() -> dict[str, str]:
    """deploy/docker/build-images.sh (cached by content): {SNOOZE_*_IMAGE: image}."""
    proc = subprocess.run([str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, f"build-images.sh failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return dict(line.split("=", 1) for line in proc.stdout.split() if "=" in line)


def docker(*args: str, check: bool = True, timeout: float = 120) -> str:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {proc.returncode}\n{proc.stderr}")
    return proc.stdout


class ComposeStack:
    """One compose project of the shipped file + the test override, driven by the machine's compose."""

    def __init__(self, env: dict[str, str], project: str, files: Sequence[Path] = (COMPOSE_FILE, TEST_OVERRIDE)):
        found = compose_binary()
        assert found, "no compose binary (docker compose v2, or docker-compose: apt-get install docker-compose)"
        self.cmd, self.legacy = found
        self.env, self.project = env, project
        host = [s for f in files if f != COMPOSE_FILE for s in host_network_services(f)]
        self._copies = [legacy_copy(f, host) if self.legacy and f == COMPOSE_FILE else f for f in files]

    def compose(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        files = [a for f in self._copies for a in ("-f", str(f))]
        proc = subprocess.run(
            [*self.cmd, "--project-directory", str(ROOT), "-p", self.project, *files, *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            cwd=ROOT,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc

    def close(self) -> None:
        for f in self._copies:
            if f.name.startswith(".") and ".compose1-" in f.name:
                f.unlink(missing_ok=True)

    def containers(self, all_: bool = True) -> list[str]:
        """Ids of this project's containers (running or not)."""
        label = f"label=com.docker.compose.project={self.project}"
        out = docker("ps", *(["-a"] if all_ else []), "-q", "--filter", label)
        return out.split()

    def container(self, service: str) -> str:
        out = docker(
            "ps",
            "-a",
            "-q",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
            "--filter",
            f"label=com.docker.compose.service={service}",
        )
        ids = out.split()
        assert len(ids) == 1, f"service {service}: containers {ids}"
        return ids[0]

    def inspect(self, service: str) -> dict:
        return json.loads(docker("inspect", self.container(service)))[0]

    def health(self, service: str) -> str | None:
        state = self.inspect(service)["State"]
        return (state.get("Health") or {}).get("Status")

    def host_pid(self, service: str) -> int:
        return int(self.inspect(service)["State"]["Pid"])

    def logs(self, service: str, tail: int = 80) -> str:
        proc = subprocess.run(
            ["docker", "logs", "--tail", str(tail), self.container(service)], capture_output=True, text=True, timeout=60
        )
        return proc.stdout + proc.stderr

    def exec(self, service: str, *cmd: str, user: str | None = None, timeout: float = 60) -> str:
        return docker("exec", *(["-u", user] if user else []), self.container(service), *cmd, timeout=timeout)

    def volumes(self) -> list[str]:
        return docker("volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={self.project}").split()

    def wait_healthy(self, services: Sequence[str], timeout: float) -> float:
        """Seconds until every service's healthcheck says healthy."""
        t0 = time.monotonic()
        while True:
            states = {}
            for s in services:
                try:
                    states[s] = self.health(s)
                except AssertionError:
                    states[s] = None
            if all(v == "healthy" for v in states.values()):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise AssertionError(
                    f"not healthy within {timeout:g} s: {states}\n"
                    + "\n".join(f"--- {s}\n{self._safe_logs(s)}" for s in services)
                )
            time.sleep(1)

    def _safe_logs(self, service: str) -> str:
        try:
            return self.logs(service)
        except AssertionError as e:
            return str(e)
