"""The checkpoint/restore workload contract end to end: `snoozectl snapshot-entrypoint` as a real
subprocess (embedded tritonserver, Envoy, control API on free ports), a simulated snapshot agent
(the test writes restore-complete), and checks against Triton's own HTTP and metrics ports.

The simulated agent cannot checkpoint: the captured process goes on from its wait for
restore-complete as a restored one would, and a restore placeholder is a second entrypoint process
with the same control folder and ports, beside it as the restored process is in a restore pod."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from controlplane.triton.client import parse_pending_request_counts
from controlplane.triton.launcher import free_port
from harness.probes import http_infer, until

pytestmark = pytest.mark.integration

MODEL_PY = """
import numpy as np


class Model:
    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        return {{"y": (inputs["x"] * {factor}).astype(np.float32)}}
"""
# Appends a line to a marker file per execution: what ran in the model, whichever way it got there.
# The slow load keeps the gateway up before the capture long enough for a client to connect.
COUNTED_MODEL_PY = """
import time

import numpy as np


class Model:
    def load(self, model_dir, device):
        time.sleep(3)

    def predict(self, inputs):
        with open({marker!r}, "a") as f:
            f.write("executed\\n")
        return {{"y": (inputs["x"] * 2).astype(np.float32)}}
"""
MANIFEST = {
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [2]}],
    "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
}
START_TIMEOUT = 180  # a 2-core machine: tritonserver + python stubs + Envoy


def _package(models: Path, name: str, factor: int, source: str | None = None) -> None:
    folder = models / name
    folder.mkdir(parents=True)
    (folder / "snooze_model.py").write_text(textwrap.dedent(source or MODEL_PY.format(factor=factor)))
    (folder / "snooze_model.json").write_text(json.dumps(MANIFEST))


def _wait(what: str, check: Callable[[], bool], timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Until ``check()``; fails at once if ``proc`` (the entrypoint) exits meanwhile."""

    def done() -> bool:
        if check():
            return True
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the entrypoint exited ({proc.returncode}) while waiting for {what}")
        return False

    until(done, what, timeout)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class Entrypoint:
    """One `snoozectl snapshot-entrypoint` subprocess with fixed free ports; always killed."""

    def __init__(self, root: Path, models: Path, *, standby: bool = False, ports: dict[str, int] | None = None) -> None:
        self.control = root / "control"
        self.control.mkdir(exist_ok=True)
        self.work = root / "work"
        self.log = root / ("standby.log" if standby else "entrypoint.log")
        names = ("http", "grpc", "api", "triton_http", "triton_grpc", "triton_metrics")
        self.ports = ports = ports or {name: free_port() for name in names}
        snoozectl = shutil.which("snoozectl", path=str(Path(sys.executable).parent))
        assert snoozectl, "snoozectl is not installed next to this interpreter"
        self.command = [
            snoozectl, "snapshot-entrypoint", "--models", str(models), "--work-dir", str(self.work), "--no-auth",
            "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]), "--api-port", str(ports["api"]),
            "--quiesce-timeout", "30",
        ]  # fmt: skip
        self.env = {
            **os.environ,
            "SNAPSHOT_CONTROL_DIR": str(self.control),
            "SNAPSHOT_RESTORE_STANDBY": "1" if standby else "0",
            "SNOOZE_TRITON_HTTP_PORT": str(ports["triton_http"]),
            "SNOOZE_TRITON_GRPC_PORT": str(ports["triton_grpc"]),
            "SNOOZE_TRITON_METRICS_PORT": str(ports["triton_metrics"]),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Entrypoint:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.command, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for child in family:  # tritonserver, its stubs and Envoy, whatever the entrypoint left
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass

    def file(self, name: str) -> Path:
        return self.control / name

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for(self, name: str, timeout: float = START_TIMEOUT) -> None:
        try:
            _wait(name, self.file(name).exists, timeout, self.proc)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- entrypoint log ---\n{self.log_text()[-6000:]}") from None

    def triton_stats(self, model: str) -> dict:
        r = httpx.get(f"http://127.0.0.1:{self.ports['triton_http']}/v2/models/{model}/stats", timeout=5)
        r.raise_for_status()
        return r.json()["model_stats"][0]

    def pending(self) -> dict[str, float]:
        text = httpx.get(f"http://127.0.0.1:{self.ports['triton_metrics']}/metrics", timeout=5).text
        return parse_pending_request_counts(text)

    def infer_through_gateway(self, model: str) -> np.ndarray:
        return http_infer(f"127.0.0.1:{self.ports['http']}", model, np.array([[1.0, 2.0]], dtype=np.float32))


@pytest.fixture
def models(tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    _package(folder, "double", 2)
    return folder


@pytest.fixture
def entrypoint(tmp_path: Path, models: Path) -> Iterator[Callable[..., Entrypoint]]:
    started: list[Entrypoint] = []

    def make(*, standby: bool = False, ports: dict[str, int] | None = None) -> Entrypoint:
        ep = Entrypoint(tmp_path, models, standby=standby, ports=ports)
        started.append(ep)
        return ep

    yield make
    for ep in started:
        ep.stop()


def test_capture_then_restore(entrypoint: Callable[..., Entrypoint], models: Path) -> None:
    _package(models, "triple", 3)
    ep = entrypoint()
    ep.file("ready-for-snapshot").write_text("stale\n")
    ep.file("triton-restore-ready").write_text("stale\n")
    ep.start()
    _wait("the stale ready-for-snapshot to go", lambda: not ep.file("ready-for-snapshot").exists(), 30, ep.proc)
    assert not ep.file("triton-restore-ready").exists(), "a stale readiness sentinel must not survive a start"

    ep.wait_for("ready-for-snapshot")
    # Only now: every model loaded and warmed up with one real inference, nothing in flight.
    for model in ("double", "triple"):
        assert ep.triton_stats(model)["inference_count"] >= 1, f"{model} was not warmed up"
    assert ep.pending() and all(n == 0 for n in ep.pending().values())
    assert not _accepts(ep.ports["http"]), "the gateway must stop admitting before the snapshot"
    fingerprint = json.loads(ep.file("snapshot-fingerprint.json").read_text())
    assert set(fingerprint["parts"]["published"]) == {"double", "triple"}
    assert not ep.file("triton-restore-ready").exists()

    ep.file("restore-complete").write_text("")  # the agent: the process runs again
    ep.wait_for("triton-restore-ready", timeout=60)
    ready = json.loads(ep.file("triton-restore-ready").read_text())
    assert sorted(ready["models_checked"]) == ["double", "triple"]
    assert ready["fingerprint"] == fingerprint["digest"]
    np.testing.assert_allclose(ep.infer_through_gateway("triple"), [[3.0, 6.0]])
    assert httpx.get(f"http://127.0.0.1:{ep.ports['api']}/health/ready", timeout=5).status_code == 200
    assert not ep.file("restore-failed").exists()


def _inert(ep: Entrypoint) -> None:
    """No child process (tritonserver, Envoy), no listening socket, no sentinel of its own."""
    assert ep.proc is not None and ep.proc.poll() is None, "the placeholder must not exit on its own"
    process = psutil.Process(ep.proc.pid)
    assert process.children(recursive=True) == [], "standby must not start tritonserver or Envoy"
    assert [c for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN] == []


def test_standby_placeholder_stays_inert_beside_the_restored_process(entrypoint: Callable[..., Entrypoint]) -> None:
    placeholder = entrypoint(standby=True)
    placeholder.file("ready-for-snapshot").write_text("stale\n")
    placeholder.start()
    _wait("the stale ready-for-snapshot to go", lambda: not placeholder.file("ready-for-snapshot").exists(), 30)
    time.sleep(2)  # long enough for a start-up to show (tritonserver is a child within ~1 s)
    _inert(placeholder)
    assert not any(_accepts(port) for port in placeholder.ports.values())
    assert not placeholder.work.exists(), "standby must not touch the work dir"

    # The captured process, on the same ports and control folder, goes on as the restored sibling.
    captured = entrypoint(ports=placeholder.ports).start()
    captured.wait_for("ready-for-snapshot")
    captured.file("restore-complete").write_text("")  # the agent
    captured.wait_for("triton-restore-ready", timeout=60)
    _wait("the placeholder to see restore-complete", lambda: "restore-complete seen" in placeholder.log_text(), 30)
    time.sleep(3)  # a cold start (the old behaviour) had tritonserver and Envoy up well within this
    _inert(placeholder)
    np.testing.assert_allclose(captured.infer_through_gateway("double"), [[2.0, 4.0]])
    assert not captured.file("restore-failed").exists()
    assert "address already in use" not in (placeholder.log_text() + captured.log_text()).lower()

    placeholder.proc.send_signal(signal.SIGTERM)
    assert placeholder.proc.wait(timeout=30) == 0
    np.testing.assert_allclose(captured.infer_through_gateway("double"), [[2.0, 4.0]])


def _gate_closed(ep: Entrypoint) -> bool:
    """Envoy's runtime value of the snapshot gate, read from its admin endpoint."""
    admin = (ep.work / "envoy" / "gateway.admin").read_text().strip()
    entries = httpx.get(f"http://{admin}/runtime?format=json", timeout=5).json()["entries"]
    return entries.get("snooze.gateway.closed", {}).get("final_value", "0") not in ("", "0")


def test_no_request_runs_between_ready_for_snapshot_and_restore_complete(
    entrypoint: Callable[..., Entrypoint], models: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "executions.txt"
    _package(models, "counted", 2, COUNTED_MODEL_PY.format(marker=str(marker)))
    ep = entrypoint().start()

    def executions() -> int:
        return len(marker.read_text().splitlines()) if marker.exists() else 0

    # Connect while the capture still loads models: a keep-alive HTTP connection and a gRPC channel.
    _wait("the gateway to listen", lambda: _accepts(ep.ports["http"]) and _accepts(ep.ports["grpc"]), 120, ep.proc)
    keep_alive = http.client.HTTPConnection("127.0.0.1", ep.ports["http"], timeout=30)
    keep_alive.request("GET", "/v2/health/live")
    assert keep_alive.getresponse().read() == b"" and keep_alive.sock is not None
    channel = grpcclient.InferenceServerClient(f"127.0.0.1:{ep.ports['grpc']}")
    assert channel.is_server_live()

    ep.wait_for("ready-for-snapshot")
    assert executions() == 1  # the warm-up
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]})
    keep_alive.request("POST", "/v2/models/counted/infer", body, {"Content-Type": "application/json"})
    answer = keep_alive.getresponse()
    assert answer.status == 503 and "snapshot" in json.loads(answer.read())["error"]
    x = grpcclient.InferInput("x", [1, 2], "FP32")
    x.set_data_from_numpy(np.array([[1.0, 2.0]], dtype=np.float32))
    with pytest.raises(InferenceServerException) as info:
        channel.infer("counted", [x])
    assert info.value.status() == "StatusCode.UNAVAILABLE"
    assert not _accepts(ep.ports["http"]), "the gateway admits no new connection either"
    time.sleep(3)  # past several sweep intervals: nothing may run late or in the background either
    assert executions() == 1 and ep.triton_stats("counted")["inference_stats"]["success"]["count"] == 1
    assert ep.pending() and all(n == 0 for n in ep.pending().values())

    ep.file("restore-complete").write_text("")
    ep.wait_for("triton-restore-ready", timeout=60)
    assert executions() == 2, "only the post-restore check ran: nothing sent while paused was run late"
    assert not _gate_closed(ep)
    np.testing.assert_allclose(channel.infer("counted", [x]).as_numpy("y"), [[2.0, 4.0]])  # the same channel
    np.testing.assert_allclose(ep.infer_through_gateway("counted"), [[2.0, 4.0]])
    assert executions() == 4
    channel.close()
    keep_alive.close()


def test_changed_configuration_refuses_to_resume(entrypoint: Callable[..., Entrypoint], models: Path) -> None:
    ep = entrypoint().start()
    ep.wait_for("ready-for-snapshot")
    # Between capture and restore the model's deployment changes: the restored process must notice.
    (models / "models.toml").write_text('[[models]]\nid = "double"\npath = "double"\nmax_batch_size = 4\n')
    ep.file("restore-complete").write_text("")
    ep.wait_for("restore-failed", timeout=60)
    assert ep.proc.wait(timeout=60) == 1
    reason = ep.file("restore-failed").read_text()
    assert "differs from the one the snapshot was taken with" in reason
    assert "sources.double.config: changed" in reason and "sources.double.deployment: changed" in reason
    assert not ep.file("triton-restore-ready").exists()
    assert "restore-failed" in ep.log_text() and "sources.double.config" in ep.log_text()
