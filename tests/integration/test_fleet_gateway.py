"""`snoozectl fleet gateway --node ...` in front of two `snoozectl serve` nodes that share one model store.

What the Kubernetes fleet overlay runs (a gateway Deployment in front of a StatefulSet's pods), on one
machine: the nodes are separate serve processes over one store folder (each its own embedded Triton),
named by DNS name (``localhost``) so the gateway's Envoy resolves them (STRICT_DNS) and the fleet API
calls them by name, as in a cluster. Auth on, standard tritonclient clients. Each model is served
through the gateway and loaded on exactly one node (asked of the nodes themselves, not the fleet
API). Sized for 2 cores: two nodes, tiny models.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from controlplane.child_processes import wait_gone
from controlplane.triton.launcher import free_port
from harness.probes import grpc_infer, http_infer, until
from harness.serve import SNOOZECTL, Serve, write_package

pytestmark = pytest.mark.integration

API_KEY, ADMIN_KEY = "fleetgw-infer-key-6a0c", "fleetgw-admin-key-e93b"
MODELS = ["alpha", "bravo", "charlie", "delta", "echo"]


class GatewayProcess:
    """`snoozectl fleet gateway` as a subprocess on free ports."""

    def __init__(self, root: Path, args: list[str], env: dict[str, str]) -> None:
        self.http_port, self.grpc_port, self.api_port = free_port(), free_port(), free_port()
        self.log = root / "fleet-gateway.log"
        cmd = [
            SNOOZECTL, "fleet", "gateway", *args, "--work-dir", str(root / "gateway"),
            "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port), "--api-port", str(self.api_port),
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.api = httpx.Client(base_url=f"http://127.0.0.1:{self.api_port}", headers={"X-API-Key": ADMIN_KEY})

    def live(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text(errors="replace")[-3000:]
        with contextlib.suppress(httpx.HTTPError):
            return self.api.get("/health/live").status_code == 200
        return False

    def stop(self) -> None:
        """SIGTERM (it stops its Envoy), then SIGKILL of what is left; asserts its Envoy is gone."""
        children = self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.api.close()
        _, left = wait_gone(children, 10)
        for p in left:  # Envoy runs in a session of its own
            with contextlib.suppress(psutil.Error):
                p.kill()
        assert not left, f"outlived the fleet gateway: {left}"

    def children(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.proc.pid).children(recursive=True)
        return []

    def envoy(self) -> psutil.Process:
        [envoy] = [p for p in self.children() if p.name() == "envoy"]
        return envoy


X = np.full((1, 2), 1.5, np.float32)  # every model answers [[3.0, 3.0]]


def infer(port: int, model: str, key: str = API_KEY) -> np.ndarray:
    return http_infer(f"127.0.0.1:{port}", model, X, headers={"X-API-Key": key}, timeout=120)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Serve]]:
    root = tmp_path_factory.mktemp("fleetgw")
    package = write_package(root / "scale")
    models = root / "models"
    models.mkdir()
    (models / "models.toml").write_text(
        "".join(f'[[models]]\nid = "{m}"\npath = "{package}"\nidle_timeout_secs = 600\n' for m in MODELS)
    )
    env = {
        **os.environ, "SNOOZE_API_KEYS": json.dumps([API_KEY]), "SNOOZE_ADMIN_KEYS": json.dumps([ADMIN_KEY]),
        "SNOOZE_MODEL_REPOSITORY": str(root / "store"), "SNOOZE_STORE_POLL_SECS": "0.5",
    }  # fmt: skip
    # The first node publishes the models into the store; the second serves what it finds there.
    fleet = [
        Serve(root / "node-a", env, models=models, admin_key=ADMIN_KEY),
        Serve(root / "node-b", env, admin_key=ADMIN_KEY),
    ]
    try:
        for node in fleet:
            node.start(timeout=180, ready=True)
        yield fleet
    finally:
        for node in fleet:
            node.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, nodes: list[Serve]) -> Iterator[GatewayProcess]:
    env = {**os.environ, "SNOOZE_API_KEYS": json.dumps([API_KEY]), "SNOOZE_ADMIN_KEYS": json.dumps([ADMIN_KEY])}
    # By DNS name, as a StatefulSet's pods are: Envoy resolves `localhost` (STRICT_DNS), and so does the fleet API.
    args = [
        arg for name, n in zip(("node-a", "node-b"), nodes, strict=True)
        for arg in ("--node", f"{name}=localhost:{n.http_port}:{n.grpc_port}:{n.api_port}")
    ]  # fmt: skip
    gw = GatewayProcess(tmp_path_factory.mktemp("fleetgw_gateway"), args, env)
    try:
        until(gw.live, "the fleet gateway to come up", timeout=60)
        yield gw
    finally:
        gw.stop()


def loaded_on(nodes: list[Serve], model: str) -> list[str]:
    """The nodes (by work dir name) whose own control API says ``model`` is ready."""
    return [n.work_dir.name for n in nodes if n.status(model)["state"] == "ready"]


def test_the_gateway_renders_dns_clusters_and_sees_both_nodes(gateway: GatewayProcess):
    bootstrap = (gateway.log.parent / "gateway" / "fleet-gateway.yaml").read_text()
    assert bootstrap.count("type: STRICT_DNS") == 2 and "type: STATIC" not in bootstrap
    nodes = until(lambda: (r := gateway.api.get("/v1/nodes")).status_code == 200 and r.json(), "the node list")
    assert [n["name"] for n in nodes] == ["node-a", "node-b"]
    until(lambda: all(n["ready"] for n in gateway.api.get("/v1/nodes").json()), "both nodes ready", timeout=30)
    assert gateway.api.get("/health/ready").json()["ready_nodes"] == ["node-a", "node-b"]


def stream_infer(client: grpcclient.InferenceServerClient, model: str, x: grpcclient.InferInput) -> Any:
    """One request on a new gRPC stream; its answer."""
    answers: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put(error or result), headers={"x-api-key": API_KEY})
    try:
        client.async_stream_infer(model, [x])
        answer = answers.get(timeout=120)
    finally:
        client.stop_stream()
    assert not isinstance(answer, InferenceServerException), answer
    return answer


def test_each_model_is_served_through_the_gateway_and_lands_on_one_node(gateway: GatewayProcess, nodes: list[Serve]):
    until(lambda: all(n["ready"] for n in gateway.api.get("/v1/nodes").json()), "both nodes ready", timeout=30)
    for model in MODELS:
        for _ in range(2):
            np.testing.assert_allclose(infer(gateway.http_port, model), [[3.0, 3.0]])
        with grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.grpc_port}") as client:
            y = grpc_infer(client, model, X, headers={"x-api-key": API_KEY}, timeout=120)
            np.testing.assert_allclose(y, [[3.0, 3.0]])
            x = grpcclient.InferInput("x", [1, 2], "FP32")
            x.set_data_from_numpy(X)
            for _ in range(3):  # a ModelStreamInfer stream goes to the model's owner too (its first message's model)
                np.testing.assert_allclose(stream_infer(client, model, x).as_numpy("y"), [[3.0, 3.0]])
    placement = {m: loaded_on(nodes, m) for m in MODELS}
    assert all(len(held) == 1 for held in placement.values()), placement  # HTTP, gRPC, streams agree on the owner
    assert {held[0] for held in placement.values()} == {"node-a", "node-b"}, placement  # the ring uses both
    merged = {m: sorted(gateway.api.get(f"/v1/models/{m}").json()["status"]["nodes"]) for m in MODELS}
    assert merged == placement


def test_the_gateway_checks_keys(gateway: GatewayProcess):
    with pytest.raises(InferenceServerException, match="401|[Uu]nauthorized|key"):
        infer(gateway.http_port, MODELS[0], key="not-a-key")
    assert gateway.api.get("/v1/nodes", headers={"X-API-Key": API_KEY}).status_code == 403  # inference scope


def test_a_statefulsets_pods_before_they_exist_then_envoy_killed(tmp_path: Path):
    """`--statefulset` as the Kubernetes overlay runs it, before any pod is in DNS (a cold cluster): it
    starts, routes to the pods' DNS names, is live but not ready; its Envoy killed, it exits 1 (the
    kubelet then restarts it)."""
    pods = ["--statefulset", "snooze-node", "--service", "snooze-nodes", "--replicas", "3", "--namespace", "snooze"]
    gw = GatewayProcess(tmp_path, [*pods, "--no-auth"], dict(os.environ))
    try:
        until(gw.live, "the fleet gateway to come up", timeout=60)
        nodes = gw.api.get("/v1/nodes").json()
        assert [(n["name"], n["api_url"], n["ready"]) for n in nodes] == [
            (f"snooze-node-{i}", f"http://snooze-node-{i}.snooze-nodes.snooze.svc:8080", False) for i in range(3)
        ]
        bootstrap = (tmp_path / "gateway" / "fleet-gateway.yaml").read_text()
        assert bootstrap.count('address: "snooze-node-2.snooze-nodes.snooze.svc", port_value: 8001') == 1
        r = gw.api.get("/health/ready")
        assert r.status_code == 503 and "no node" in r.json()["error"]
        gw.envoy().kill()
        started = time.monotonic()
        gw.proc.wait(20)
        assert gw.proc.returncode == 1, gw.log.read_text(errors="replace")
        assert time.monotonic() - started < 10
        assert "Envoy exited" in gw.log.read_text(errors="replace")
    finally:
        gw.stop()
