"""`snoozectl fleet up --nodes 3`: a dozen models over three nodes behind the model-affine fleet gateway.

As users run it: the fleet command in a subprocess (auth on), standard tritonclient clients on the fleet
gateway, the fleet API for state. Each model lives on one node; a storm on one model spills it onto
another node and the spilled copy goes when the storm ends; a publish through the fleet reaches every
node and a delete leaves every node; a killed node's models answer again within seconds from the next
node of the ring, and the node rejoins. Sized for 2 cores: one fleet for the module, tiny models.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from controlplane.triton.launcher import free_port
from harness.probes import grpc_infer_async, http_infer, until, until_async
from harness.reliability import report
from harness.serve import SNOOZECTL, write_package

pytestmark = pytest.mark.integration

API_KEY, ADMIN_KEY = "fleet-infer-key-3b7e", "fleet-admin-key-91d4"
MODELS = [f"m{i:02d}" for i in range(12)]
HOT_IDLE_SECS = 6


class Fleet:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.http_port, self.grpc_port, self.api_port = free_port(), free_port(), free_port()
        self.log = root / "fleet.log"
        self.proc: subprocess.Popen[bytes] | None = None
        base = f"http://127.0.0.1:{self.api_port}"
        self.api = httpx.Client(base_url=base, headers={"X-API-Key": ADMIN_KEY}, timeout=60)

    def start(self, models: Path) -> None:
        env = {**os.environ, "SNOOZE_API_KEYS": json.dumps([API_KEY]), "SNOOZE_ADMIN_KEYS": json.dumps([ADMIN_KEY]),
               "SNOOZE_SWEEP_INTERVAL_SECS": "0.5", "SNOOZE_STORE_POLL_SECS": "0.5"}  # fmt: skip
        cmd = [
            SNOOZECTL, "fleet", "up", "--nodes", "3", "--models", str(models), "--work-dir", str(self.root / "work"),
            "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port), "--api-port", str(self.api_port),
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        until(self._ready, "the fleet to come up", timeout=240, interval=0.5)

    def _ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text(errors="replace")[-3000:]
        with contextlib.suppress(httpx.HTTPError):
            nodes = self.api.get("/v1/nodes").json()
            return len(nodes) == 3 and all(n["ready"] for n in nodes)
        return False

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(90)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        left = [p for p in psutil.process_iter(["cmdline"]) if str(self.root) in " ".join(p.info["cmdline"] or [])]
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        assert not left, f"processes outlived the fleet: {[p.pid for p in left]}"

    def holders(self, model: str) -> list[str]:
        """Nodes that hold ``model`` loaded (ready)."""
        status = self.api.get(f"/v1/models/{model}").json()["status"]
        return sorted(n for n, s in status["nodes"].items() if s["state"] == "ready")

    def node_serve(self, name: str) -> psutil.Process:
        marker = str(self.root / "work" / name)
        for p in psutil.process_iter(["cmdline"]):
            argv = p.info["cmdline"] or []
            if "serve" in argv and marker in argv:
                return p
        raise AssertionError(f"no serve process for {name}")

    def infer_http(self, model: str, value: float = 1.0, key: str = API_KEY) -> np.ndarray:
        x = np.full((1, 2), value, np.float32)
        return http_infer(f"127.0.0.1:{self.http_port}", model, x, headers={"X-API-Key": key})


ONES = np.ones((1, 2), np.float32)
GRPC_KEY = {"x-api-key": API_KEY}


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_package(tmp_path_factory.mktemp("fleet_pkg") / "scale")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, package: Path) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fleet")
    models = root / "models"
    models.mkdir()
    entries = [f'[[models]]\nid = "{m}"\npath = "{package}"\nidle_timeout_secs = 600\n' for m in MODELS]
    entries.append(f'[[models]]\nid = "hot"\npath = "{package}"\nidle_timeout_secs = {HOT_IDLE_SECS}\n')
    (models / "models.toml").write_text("\n".join(entries))
    fleet = Fleet(root)
    try:
        fleet.start(models)
        yield fleet
    finally:
        fleet.stop()


async def test_each_model_lives_on_one_node(fleet: Fleet):
    # asleep everywhere first: a failover (the killed-node test) leaves copies on the survivors for their idle time
    for model in MODELS:
        r = await asyncio.to_thread(fleet.api.post, f"/v1/models/{model}/unload")
        assert r.status_code == 200, r.text
    assert all(fleet.holders(m) == [] for m in MODELS)
    async with grpcaio.InferenceServerClient(f"127.0.0.1:{fleet.grpc_port}") as client:
        for model in MODELS:
            for _ in range(3):
                np.testing.assert_allclose(await grpc_infer_async(client, model, ONES, headers=GRPC_KEY), [[2.0, 2.0]])
                np.testing.assert_allclose(await asyncio.to_thread(fleet.infer_http, model), [[2.0, 2.0]])
    placement = {m: fleet.holders(m) for m in MODELS}
    report("fleet placement", **{m: ",".join(n) for m, n in placement.items()})
    assert all(len(nodes) == 1 for nodes in placement.values()), placement  # gRPC and HTTP agree on the owner
    assert len({nodes[0] for nodes in placement.values()}) >= 2, placement  # the ring spreads the models


async def test_a_storm_spills_a_hot_model_and_the_spilled_copy_goes_when_it_cools(fleet: Fleet):
    counts = {"ok": 0, "failed": 0}

    async def client_loop(client: grpcaio.InferenceServerClient, until_t: float) -> None:
        while time.monotonic() < until_t:
            try:
                await grpc_infer_async(client, "hot", ONES, headers=GRPC_KEY)
                counts["ok"] += 1
            except InferenceServerException:
                counts["failed"] += 1

    async with grpcaio.InferenceServerClient(f"127.0.0.1:{fleet.grpc_port}") as client:
        await grpc_infer_async(client, "hot", ONES, headers=GRPC_KEY)
        [owner] = fleet.holders("hot")
        end = time.monotonic() + 5
        await asyncio.gather(*(client_loop(client, end) for _ in range(48)))
        spread = fleet.holders("hot")
        # Cooling down: one client, well under the owner's share; the spilled copies idle out.
        settled = time.monotonic()
        while fleet.holders("hot") != [owner]:
            assert time.monotonic() - settled < 4 * HOT_IDLE_SECS, fleet.holders("hot")
            await grpc_infer_async(client, "hot", ONES, headers=GRPC_KEY)
            await asyncio.sleep(0.2)
        cooled = time.monotonic() - settled
    report("hot model storm", requests=counts["ok"], failed=counts["failed"], spread=spread, owner=owner,
           back_to_one_node_secs=round(cooled, 1))  # fmt: skip
    assert counts["failed"] == 0
    assert len(spread) >= 2 and owner in spread, spread


def test_a_publish_through_the_fleet_reaches_every_node_and_a_delete_leaves_them(fleet: Fleet, package: Path):
    traffic = BackgroundTraffic(fleet, MODELS[:4])  # other models keep serving through the publishes
    r = fleet.api.post("/v1/models:from-path", json={"id": "late", "path": str(package), "params": {"scale": 3.0}})
    assert r.status_code == 201, r.text
    published = time.monotonic()
    nodes = fleet.api.get("/v1/nodes").json()

    def listed(node: dict[str, Any]) -> bool:
        models = httpx.get(f"{node['api_url']}/v1/models", headers={"X-API-Key": ADMIN_KEY}).json()
        return any(m["id"] == "late" for m in models)

    def everywhere() -> bool:
        return all(listed(n) for n in nodes)

    until(everywhere, "every node to list the new model", timeout=10, interval=0.1)
    seen_secs = time.monotonic() - published
    np.testing.assert_allclose(fleet.infer_http("late"), [[3.0, 3.0]])
    [owner] = fleet.holders("late")
    # Republished with another scale: the node that holds it loaded reloads it from the store.
    r = fleet.api.post("/v1/models:from-path", json={"id": "late", "path": str(package), "params": {"scale": 5.0}})
    assert r.status_code == 201, r.text
    until(lambda: fleet.infer_http("late")[0, 0] == 5.0, "the new version to be served", timeout=15, interval=0.2)
    assert fleet.holders("late") == [owner]
    r = fleet.api.delete("/v1/models/late")
    assert r.status_code == 204, r.text
    until(lambda: fleet.api.get("/v1/models/late").status_code == 404, "every node to forget it", timeout=10)
    ok, failures = traffic.stop()
    report("publish through the fleet", visible_on_every_node_secs=round(seen_secs, 2), traffic_ok=ok,
           traffic_failed=len(failures))  # fmt: skip
    assert seen_secs <= 2.0
    assert ok > 0 and failures == [], failures[:3]


def test_the_fleet_checks_keys(fleet: Fleet):
    with pytest.raises(InferenceServerException) as info:
        fleet.infer_http("m00", key="wrong")
    assert info.value.status() == "401"
    r = httpx.get(f"http://127.0.0.1:{fleet.api_port}/v1/models", headers={"X-API-Key": API_KEY})
    assert r.status_code == 403, r.text  # an inference key cannot administer the fleet
    assert httpx.get(f"http://127.0.0.1:{fleet.api_port}/v1/models").status_code == 401


async def test_a_killed_node_is_replaced_by_the_ring_then_rejoins(fleet: Fleet):
    failed, answered_all = 0, None
    async with grpcaio.InferenceServerClient(f"127.0.0.1:{fleet.grpc_port}") as client:
        for model in MODELS:  # warm, through the ring
            await grpc_infer_async(client, model, ONES, headers=GRPC_KEY)
        # Placement is read after every model is warm: earlier tests on this fleet may have left
        # some asleep or spilled, and the victim must be the node that holds them now.
        placement = {m: fleet.holders(m) for m in MODELS}
        victim = max({n[0] for n in placement.values() if n},
                     key=lambda node: sum(p == [node] for p in placement.values()))  # fmt: skip
        owned = [m for m, nodes in placement.items() if nodes == [victim]]
        serve = fleet.node_serve(victim)
        serve.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        while answered_all is None:
            ok = 0
            for model in MODELS:
                try:
                    np.testing.assert_allclose(
                        await grpc_infer_async(client, model, ONES, headers=GRPC_KEY), [[2.0, 2.0]]
                    )
                    ok += 1
                except InferenceServerException:
                    failed += 1
            if ok == len(MODELS):
                answered_all = time.monotonic() - killed
            assert time.monotonic() - killed < 30, f"models still failing 30 s after the kill ({failed} failures)"
        # What the survivors' loads of the dead node's models cost, read before the node rejoins.
        wakes = {m: fleet.api.get(f"/v1/models/{m}").json()["status"]["last_cold_start_secs"] or 0.0 for m in owned}
        # The fleet starts the node again; once it is healthy its models come back to it.
        rejoin = await until_async(lambda: fleet.node_serve(victim).pid != serve.pid and _node_ready(fleet, victim),
                                   "the node to rejoin", timeout=120)  # fmt: skip
        back = time.monotonic()
        while not all(victim in fleet.holders(m) for m in owned):
            assert time.monotonic() - back < 30, {m: fleet.holders(m) for m in owned}
            for model in owned:
                await grpc_infer_async(client, model, ONES, headers=GRPC_KEY)
            await asyncio.sleep(0.5)
    report("node killed", node=victim, models_owned=len(owned), failed_requests=failed,
           every_model_answers_after_secs=round(answered_all, 2), rejoined_after_secs=round(rejoin, 1))  # fmt: skip
    # Bounded by what the failover must do: notice the dead node (a few seconds of health checks)
    # and wake the models it owned elsewhere, which costs what those loads cost in this run (a loaded
    # machine makes every load slower, and a fixed bound then fails for no fault of the ring).
    assert answered_all < 10 + sum(wakes.values()), (answered_all, wakes)
    assert failed <= len(owned)  # at most one failure per model the dead node owned


class BackgroundTraffic:
    """Sequential HTTP requests over ``models`` in a thread until stop(): (answered, errors)."""

    def __init__(self, fleet: Fleet, models: list[str]) -> None:
        self.ok, self.failures = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fleet, models), daemon=True)
        self._thread.start()

    def _run(self, fleet: Fleet, models: list[str]) -> None:
        while not self._stop.is_set():
            for model in models:
                try:
                    fleet.infer_http(model)
                    self.ok += 1
                except InferenceServerException as e:
                    self.failures.append(f"{model}: {e}")

    def stop(self) -> tuple[int, list[str]]:
        self._stop.set()
        self._thread.join(60)
        return self.ok, self.failures


def _node_ready(fleet: Fleet, name: str) -> bool:
    nodes: list[dict[str, Any]] = fleet.api.get("/v1/nodes").json()
    return any(n["name"] == name and n["ready"] for n in nodes)
