"""The shipped docker-compose.yml, run for real (``make compose-test``; marker ``compose``).

A Docker engine (deploy/docker/engine.sh starts one as root), the images built offline
(deploy/docker/build-images.sh: debootstrap base, a CPU Triton 2.51 from the nvidia-pytriton wheel with the
official image's layout, the control-plane Dockerfile), and the shipped file plus
tests/compose/docker-compose.test.yml, which changes only the images and the networking (host network,
ports from the environment). Clients are the real tritonclient HTTP and gRPC clients through the gateway.

The checks run in file order on one stack (module scope): each leaves the stack serving.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest

from controlplane.triton.launcher import free_port
from harness.compose_stack import ComposeStack, build_images, compose_binary, docker, ensure_engine
from harness.probes import grpc_infer, http_infer, until
from harness.serve import SNOOZECTL, write_package

pytestmark = pytest.mark.compose

API_KEY, ADMIN_KEY = "compose-test-client", "compose-test-admin"
PROJECT = "snoozeml-compose-test"
IDLE_SECS = 6
# Bounds the checks state (the stack's own start-up: Triton ~5 s, the control plane ~15 s on 2 cores).
HEALTHY_WITHIN = 180
RECOVER_WITHIN = 180
WAKE_WITHIN = 60


@pytest.fixture(scope="module")
def images(figure: Callable[[str], None]) -> dict[str, str]:
    ok, message = ensure_engine()
    if not ok:
        pytest.skip(message)
    if compose_binary() is None:
        pytest.skip("no compose binary: docker compose v2, or docker-compose (apt-get install docker-compose)")
    t0 = time.monotonic()
    built = build_images()
    figure(f"images ready in {time.monotonic() - t0:.1f} s: {built}")
    return built


LOAD_TIMEOUT = 3
# Two ~190 MiB models (150 MiB ballast + the stub) and the small ones fit under the budget beside tritonserver's own
# memory (~50 MiB: the budget is for the whole Triton tree), a third does not.
BALLAST_MB, BUDGET_MB = 150, 500
TRIGGERS = "/run/snooze/triggers"  # in the Triton container: the shared tmpfs (the host writes it as root)


def _models(folder: Path) -> Path:
    write_package(folder / "packages" / "scale")
    write_package(folder / "packages" / "hang", load_timeout_secs=LOAD_TIMEOUT)
    (folder / "models.toml").write_text(
        textwrap.dedent(f"""
        [[models]]
        id = "scale"
        path = "packages/scale"
        max_batch_size = 4
        idle_timeout_secs = {IDLE_SECS}

        [[models]]
        id = "resident"
        path = "packages/scale"
        max_batch_size = 4
        idle_timeout_secs = 3600

        [[models]]
        id = "crash"
        path = "packages/scale"
        params = {{ crash = "segv", crash_file = "{TRIGGERS}/segv" }}

        [[models]]
        id = "poison"
        path = "packages/scale"
        params = {{ crash = "poison", calls = "{TRIGGERS}/calls-poison" }}

        [[models]]
        id = "hang"
        path = "packages/hang"
        params = {{ load_sleep = 600.0 }}

        [[models]]
        id = "big-a"
        path = "packages/scale"
        params = {{ ballast_mb = {BALLAST_MB} }}

        [[models]]
        id = "big-b"
        path = "packages/scale"
        params = {{ ballast_mb = {BALLAST_MB} }}

        [[models]]
        id = "big-c"
        path = "packages/scale"
        params = {{ ballast_mb = {BALLAST_MB} }}

        [[models]]
        id = "pre"
        path = "packages/scale"
        worker = "preforked"
        params = {{ scale = 7.0 }}
    """)
    )
    folder.chmod(0o755)
    for p in folder.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return folder


class Stack:
    def __init__(self, compose: ComposeStack, env: dict[str, str]) -> None:
        self.compose, self.env = compose, env
        self.http_port, self.grpc_port, self.api_port = (
            int(env[k]) for k in ("GATEWAY_HTTP_PORT", "GATEWAY_GRPC_PORT", "API_PORT")
        )

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def snoozectl(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "SNOOZE_API_URL": self.api_url, "SNOOZE_API_KEY": ADMIN_KEY, "COLUMNS": "200"}
        return subprocess.run([SNOOZECTL, *args], capture_output=True, text=True, env=env, timeout=180)

    def models(self) -> dict[str, dict]:
        proc = self.snoozectl("status", "--json")
        assert proc.returncode == 0, proc.stderr
        data = json.loads(proc.stdout)
        items = data["models"] if isinstance(data, dict) else data
        return {m["id"]: m for m in items}

    def state(self, model: str) -> str | None:
        try:
            return self.models()[model]["status"]["state"]
        except (AssertionError, json.JSONDecodeError, KeyError):
            return None

    def infer_http(self, model: str, x: np.ndarray) -> np.ndarray:
        return http_infer(f"127.0.0.1:{self.http_port}", model, x, headers={"x-api-key": API_KEY}, timeout=120)

    def infer_grpc(self, model: str, x: np.ndarray) -> np.ndarray:
        return grpc_infer(f"127.0.0.1:{self.grpc_port}", model, x, headers={"x-api-key": API_KEY}, timeout=120)

    def run_volume(self) -> Path:
        """The shared /run/snooze tmpfs as the host sees it (mounted while a container uses it)."""
        [found] = [v for v in self.compose.volumes() if v.endswith("_snooze-run")]
        return Path(json.loads(docker("volume", "inspect", found))[0]["Mountpoint"])

    def triggers(self) -> Path:
        """TRIGGERS on the host: made (owned by uid 10001) on first use."""
        folder = self.run_volume() / Path(TRIGGERS).name
        folder.mkdir(exist_ok=True)
        os.chown(folder, 10001, 10001)
        return folder

    def in_triton(self, *cmd: str) -> str:
        return self.compose.exec("triton", *cmd)

    def triton_processes(self) -> list[psutil.Process]:
        """The processes of the Triton container's PID namespace, seen from the host."""
        init = psutil.Process(self.compose.host_pid("triton"))
        return [init, *init.children(recursive=True)]

    def stubs(self, model: str) -> list[psutil.Process]:
        found = []
        for p in self.triton_processes():
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if "triton_python_backend_stub" in cmd and f"/{model}/" in cmd:
                found.append(p)
        return found


@pytest.fixture(scope="module")
def stack(
    images: dict[str, str], tmp_path_factory: pytest.TempPathFactory, figure: Callable[[str], None]
) -> Iterator[Stack]:
    models = _models(tmp_path_factory.mktemp("compose_models"))
    ports = {
        k: str(free_port())
        for k in (
            "GATEWAY_HTTP_PORT",
            "GATEWAY_GRPC_PORT",
            "API_PORT",
            "TRITON_HTTP_PORT",
            "TRITON_GRPC_PORT",
            "TRITON_METRICS_PORT",
        )
    }
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        **images,
        **ports,
        "SNOOZE_TRITON_ADMIN_KEY": secrets.token_hex(16),
        "SNOOZE_API_KEYS": json.dumps([API_KEY]),
        "SNOOZE_ADMIN_KEYS": json.dumps([ADMIN_KEY]),
        "SNOOZE_MODELS_DIR": str(models),
        "SNOOZE_MEMORY_BUDGET_MB": str(BUDGET_MB),
    }
    compose = ComposeStack(env, PROJECT)
    compose.compose("down", "-v", "--remove-orphans", check=False)  # a previous run's leftovers
    try:
        t0 = time.monotonic()
        compose.compose("up", "-d", timeout=600)
        figure(f"compose up -d returned after {time.monotonic() - t0:.1f} s")
        yield Stack(compose, env)
    finally:
        compose.compose("down", "-v", "--remove-orphans", "-t", "10", check=False, timeout=300)
        compose.close()


def test_both_healthchecks_turn_healthy(stack: Stack, figure: Callable[[str], None]) -> None:
    took = stack.compose.wait_healthy(["triton", "controlplane"], HEALTHY_WITHIN)
    figure(f"both healthy {took:.1f} s after up -d returned")
    cp = stack.compose.inspect("controlplane")
    triton = stack.compose.inspect("triton")
    # The shipped wiring, as it runs: uid 10001 in both, the control plane in Triton's PID namespace.
    assert cp["Config"]["User"] == triton["Config"]["User"] == "10001:10001"
    pidns = stack.compose.inspect("pidns")
    assert cp["HostConfig"]["PidMode"] == triton["HostConfig"]["PidMode"] == f"container:{pidns['Id']}"
    assert stack.compose.inspect("repository-init")["State"]["ExitCode"] == 0
    # It sees Triton's processes and the stubs' request journal on the shared tmpfs.
    log = " ".join(stack.compose.logs("controlplane", tail=400).split())  # rich wraps lines
    assert "Triton's processes are visible" in log, log
    assert "request journal: /run/snooze/journal" in log, log


def test_the_triton_image_has_the_official_layout(stack: Stack) -> None:
    # What the shipped file and the control plane expect of nvcr.io's image (docs/deploy.md lists what differs).
    for path in (
        "/opt/tritonserver/bin/tritonserver",
        "/opt/tritonserver/backends/python/libtriton_python.so",
        "/opt/tritonserver/backends/python/triton_python_backend_stub",
        "/opt/tritonserver/caches/local/libtritoncache_local.so",
    ):
        stack.in_triton("test", "-f", path)


def test_sleeping_model_wakes_answers_and_sleeps(stack: Stack, figure: Callable[[str], None]) -> None:
    stack.compose.wait_healthy(["triton", "controlplane"], HEALTHY_WITHIN)
    assert stack.state("scale") == "unloaded"
    assert stack.stubs("scale") == []
    x = np.array([[1.0, 2.0]], dtype=np.float32)
    t0 = time.monotonic()
    y = stack.infer_http("scale", x)
    wake = time.monotonic() - t0
    figure(f"wake through the gateway (HTTP, compose): {wake:.2f} s")
    np.testing.assert_allclose(y, x * 2.0)
    np.testing.assert_allclose(stack.infer_grpc("scale", x * 3), x * 6.0)
    assert stack.state("scale") == "ready"
    stubs = stack.stubs("scale")
    assert stubs, "no python-backend stub of 'scale' in the Triton container after the wake"
    assert {p.uids().real for p in stubs} == {10001}
    # Idle: unloaded after its timeout, and its stub processes are gone from the Triton container.
    until(lambda: stack.state("scale") == "unloaded", "scale unloaded after its idle timeout", timeout=IDLE_SECS + 60)
    until(lambda: stack.stubs("scale") == [], "scale's stubs gone from the Triton container", timeout=30)
    # And it wakes again, over gRPC this time.
    np.testing.assert_allclose(stack.infer_grpc("scale", x), x * 2.0)


def test_status_shows_measured_memory(stack: Stack, figure: Callable[[str], None]) -> None:
    x = np.array([[1.0, 1.0]], dtype=np.float32)
    stack.infer_http("resident", x)
    status = stack.models()["resident"]["status"]
    assert status["state"] == "ready"
    assert status.get("memory_source") == "measured", status
    assert status["memory_bytes"] and status["memory_bytes"] > 10 * 2**20, status
    # The figure is the stub's RSS as the host sees it (within a factor: the two reads are moments apart).
    rss = sum(p.memory_info().rss for p in stack.stubs("resident"))
    figure(
        f"resident: status {status['memory_bytes'] / 2**20:.1f} MiB (measured), stub RSS from the host "
        f"{rss / 2**20:.1f} MiB"
    )
    assert 0.5 * rss <= status["memory_bytes"] <= 2 * rss
    table = stack.snoozectl("status")
    assert table.returncode == 0, table.stderr
    line = next(ln for ln in table.stdout.splitlines() if "resident" in ln)
    assert "declared" not in line and re.search(r"\d+(\.\d+)? ?[MG]i?B", line), line


def _error(call, *args) -> str:
    try:
        call(*args)
    except Exception as e:  # tritonclient's InferenceServerException (HTTP and gRPC)
        return str(e)
    raise AssertionError(f"{call.__name__}{args[:1]}: succeeded")


def test_a_crashed_model_process_is_recovered(stack: Stack, figure: Callable[[str], None]) -> None:
    x = np.array([[1.0, 2.0]], dtype=np.float32)
    np.testing.assert_allclose(stack.infer_grpc("crash", x), x * 2.0)
    [old] = [p.pid for p in stack.stubs("crash")]
    trigger = stack.triggers() / "segv"
    trigger.touch()
    os.chown(trigger, 10001, 10001)
    t0 = time.monotonic()
    _error(stack.infer_grpc, "crash", x)  # this request's process segfaults: its client is told
    assert not trigger.exists()

    def served() -> bool:
        try:
            return bool(np.allclose(stack.infer_http("crash", x), x * 2.0))
        except Exception:
            return False

    until(served, "crash served again", timeout=RECOVER_WITHIN, interval=0.5)
    figure(f"crashed model process: serves again after {time.monotonic() - t0:.2f} s")
    assert [p.pid for p in stack.stubs("crash")] not in ([], [old])
    status = stack.models()["crash"]["status"]
    assert status["state"] == "ready" and "SIGSEGV" in (status["last_crash"] or ""), status


def test_a_poison_request_runs_once(stack: Stack) -> None:
    calls = stack.triggers() / "calls-poison"
    x = np.array([[1.0, 1.0]], dtype=np.float32)
    np.testing.assert_allclose(stack.infer_http("poison", x), x * 2.0)
    error = _error(stack.infer_http, "poison", np.array([[-1.0, 1.0]], dtype=np.float32))
    time.sleep(1.0)  # a second run, had there been one, would have logged by now
    rows = calls.read_text().split()
    assert rows.count("-1") == 1, rows  # the journal on the shared tmpfs: not retried
    for words in ("died while running this request", "not retried"):
        assert words in error, error
    np.testing.assert_allclose(stack.infer_grpc("poison", x * 3), x * 6.0)


def test_a_hanging_load_is_killed(stack: Stack, figure: Callable[[str], None]) -> None:
    t0 = time.monotonic()
    error = _error(stack.infer_grpc, "hang", np.ones((1, 2), np.float32))
    took = time.monotonic() - t0
    assert f"load exceeded load_timeout_secs={LOAD_TIMEOUT:g}" in error, error
    until(lambda: stack.stubs("hang") == [], "the hanging load's stub killed in the Triton container", timeout=15)
    figure(f"hanging load: answered after {took:.2f} s, its stub killed")
    status = stack.models()["hang"]["status"]
    assert status["state"] == "failed" and f"load_timeout_secs={LOAD_TIMEOUT:g}" in status["reason"], status


def test_a_preforked_model_runs_in_the_triton_container(stack: Stack, figure: Callable[[str], None]) -> None:
    x = np.array([[1.0, 2.0]], dtype=np.float32)
    np.testing.assert_allclose(stack.infer_grpc("pre", x), x * 7.0)
    np.testing.assert_allclose(stack.infer_http("pre", x), x * 7.0)
    r = httpx.get(f"{stack.api_url}/v1/runtime", headers={"X-API-Key": ADMIN_KEY}, timeout=30)
    assert r.status_code == 200, r.text
    [parent] = r.json()["preloaded_parents"]
    assert parent["workers"] >= 1 and parent["memory_bytes"], parent
    # Its pid is in the shared namespace: a process of the Triton container, run by the stub's interpreter.
    cmdline = stack.in_triton("cat", f"/proc/{parent['pid']}/cmdline").replace("\0", " ")
    assert "python" in cmdline, cmdline
    figure(
        f"preforked parent pid {parent['pid']} ({parent['python']}), "
        f"{parent['memory_bytes'] / 2**20:.0f} MiB, {parent['workers']} worker(s)"
    )
    journal = stack.run_volume() / "journal"
    workers = [json.loads(n.read_text()) for n in journal.glob("*.worker")]
    mine = [w for w in workers if w.get("model") == "pre"]
    assert mine, workers
    status = stack.in_triton("cat", f"/proc/{mine[-1]['pid']}/status")
    assert re.search(r"^Uid:\s+10001\b", status, re.MULTILINE), status


def _kill_main(stack: Stack, service: str) -> None:
    """SIGKILL the service's main process (a crash, an OOM kill): its container exits, restart applies."""
    main = psutil.Process(stack.compose.host_pid(service))
    # With init: true the container's PID 1 is docker-init; kill tritonserver (orphans of the shared
    # namespace, such as a preforked parent, are docker-init's children too).
    name = {"triton": "tritonserver", "controlplane": "snoozectl"}[service]

    def runs(p: psutil.Process) -> bool:
        try:
            return name in " ".join(p.cmdline()[:2])
        except psutil.Error:  # a zombie (the hanging load's killed stub, until Triton exits), gone
            return False

    found = [p for p in [main, *main.children(recursive=True)] if runs(p)]
    assert found, f"{service}: no {name} under host pid {main.pid}"
    found[0].kill()


def _restarted(stack: Stack, service: str, count_before: int, pid_before: int, within: float) -> None:
    """Wait for the service's container to run again after its main process was killed, so that the
    figures after a kill time the restarted container, not what may be left of the old one for a moment
    (the killed control plane's Envoy, until the runtime ends the rest of the container's processes)."""

    def again() -> bool:
        found = stack.compose.inspect(service)
        state = found["State"]
        return found["RestartCount"] > count_before and state["Running"] and state["Pid"] not in (0, pid_before)

    until(again, f"the {service} container restarted", timeout=within, interval=0.2)


def _serves_again(stack: Stack, model: str, within: float) -> float:
    x = np.array([[2.0, 5.0]], dtype=np.float32)
    t0 = time.monotonic()

    def answers() -> bool:
        try:
            np.testing.assert_allclose(stack.infer_http(model, x), x * 2.0)
            return True
        except Exception:
            return False

    try:
        until(answers, f"{model} answers through the gateway again", timeout=within, interval=1.0)
    except AssertionError as e:
        state = docker("ps", "-a", "--format", "{{.Names}} {{.Status}}")
        logs = "\n".join(f"--- {s}\n{stack.compose._safe_logs(s)}" for s in ("triton", "controlplane"))
        raise AssertionError(f"{e}\n{state}\n{logs}") from None
    return time.monotonic() - t0


def test_killed_triton_container_comes_back(stack: Stack, figure: Callable[[str], None]) -> None:
    stack.infer_http("resident", np.ones((1, 2), np.float32))
    before = stack.compose.inspect("triton")["RestartCount"]
    pid_before = stack.compose.host_pid("triton")
    cp_before = stack.compose.inspect("controlplane")["RestartCount"]
    t0 = time.monotonic()
    _kill_main(stack, "triton")
    _restarted(stack, "triton", before, pid_before, RECOVER_WITHIN)
    restarted = time.monotonic() - t0
    _serves_again(stack, "resident", RECOVER_WITHIN)
    figure(
        f"Triton killed: its container runs again after {restarted:.1f} s, resident answers through the "
        f"gateway again {time.monotonic() - t0:.1f} s after the kill"
    )
    # The control plane lived on (the namespace is pidns's): it saw Triton go and come back, and
    # measures the new Triton's processes.
    assert stack.compose.inspect("controlplane")["RestartCount"] == cp_before
    status = stack.models()["resident"]["status"]
    assert status["state"] == "ready" and status.get("memory_source") == "measured", status
    stack.compose.wait_healthy(["triton", "controlplane"], RECOVER_WITHIN)


def test_killed_controlplane_container_comes_back_and_readopts(stack: Stack, figure: Callable[[str], None]) -> None:
    x = np.ones((1, 2), np.float32)
    stack.infer_http("resident", x)
    stubs_before = {p.pid for p in stack.stubs("resident")}
    assert stubs_before
    before = stack.compose.inspect("controlplane")["RestartCount"]
    pid_before = stack.compose.host_pid("controlplane")
    triton_before = stack.compose.inspect("triton")["RestartCount"]
    t0 = time.monotonic()
    _kill_main(stack, "controlplane")
    _restarted(stack, "controlplane", before, pid_before, RECOVER_WITHIN)
    restarted = time.monotonic() - t0
    _serves_again(stack, "resident", RECOVER_WITHIN)
    answers = time.monotonic() - t0

    def api_ready() -> bool:
        try:
            return httpx.get(f"{stack.api_url}/health/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    until(api_ready, "the restarted control plane's API ready", timeout=RECOVER_WITHIN, interval=0.5)
    figure(
        f"control plane killed: its container runs again after {restarted:.1f} s, resident answers through "
        f"the restarted gateway {answers:.1f} s and its API is ready {time.monotonic() - t0:.1f} s after the kill"
    )
    assert stack.compose.inspect("triton")["RestartCount"] == triton_before  # Triton lived on
    # Re-adopted: the same stub serves (no reload), and the restarted control plane knows it is ready.
    assert {p.pid for p in stack.stubs("resident")} == stubs_before
    assert stack.state("resident") == "ready"
    stack.compose.wait_healthy(["triton", "controlplane"], RECOVER_WITHIN)


def test_the_memory_budget_evicts(stack: Stack, figure: Callable[[str], None]) -> None:
    x = np.ones((1, 2), np.float32)
    for name in ("big-a", "big-b", "big-c"):
        np.testing.assert_allclose(stack.infer_grpc(name, x), x * 2.0)
    models = stack.models()
    statuses = {m: v["status"] for m, v in models.items()}
    evicted = sorted(m for m, s in statuses.items() if s["state"] == "unloaded" and s.get("reason") == "memory")
    loaded = {m: s.get("memory_bytes") or 0 for m, s in statuses.items() if s["state"] == "ready"}
    figure(
        "budget: "
        + ", ".join(
            f"{m} {s['state']} {(s.get('memory_bytes') or 0) / 2**20:.0f} MiB"
            for m, s in statuses.items()
            if m.startswith("big")
        )
        + f"; evicted for memory: {', '.join(evicted)}; loaded {sum(loaded.values()) / 2**20:.0f} MiB "
        f"of {BUDGET_MB} MiB"
    )
    # Which idle models make room is the eviction policy's choice (SNOOZE_EVICTION_POLICY, gdsf by default:
    # tested in the fake tier); here: room was made by unloading, the last load is in, measured, and what
    # the loaded models hold fits the budget.
    assert evicted, statuses
    assert statuses["big-c"]["state"] == "ready" and statuses["big-c"]["memory_source"] == "measured", statuses["big-c"]
    assert statuses["big-c"]["memory_bytes"] >= BALLAST_MB * 2**20, statuses["big-c"]
    assert sum(loaded.values()) <= BUDGET_MB * 2**20, loaded
    for m in evicted:
        assert stack.stubs(m) == [], f"{m}: evicted, but its stub still runs in the Triton container"


def test_publish_survives_restart_and_down_leaves_nothing(stack: Stack, tmp_path: Path) -> None:
    pkg = write_package(tmp_path / "late", params={"scale": 5.0})
    proc = stack.snoozectl("publish", str(pkg), "--id", "late")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # down without -v keeps the named volumes: the published model is still there after up.
    stack.compose.compose("down", "-t", "10", timeout=300)
    assert stack.compose.containers() == []
    stack.compose.compose("up", "-d", timeout=600)
    stack.compose.wait_healthy(["triton", "controlplane"], HEALTHY_WITHIN)
    x = np.array([[1.0, 2.0]], dtype=np.float32)
    np.testing.assert_allclose(stack.infer_http("late", x), x * 5.0)
    # down -v: no container, no process of the stack, no volume of the project.
    triton_pid = stack.compose.host_pid("triton")
    procs = [psutil.Process(triton_pid), *psutil.Process(triton_pid).children(recursive=True)]
    stack.compose.compose("down", "-v", "-t", "10", timeout=300)
    assert stack.compose.containers() == []
    assert stack.compose.volumes() == []
    assert [p for p in procs if p.is_running() and p.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)] == []
    dangling = docker("volume", "ls", "-q", "--filter", "dangling=true").split()
    assert not [v for v in dangling if len(v) == 64], f"anonymous volumes left: {dangling}"
