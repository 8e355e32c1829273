"""LifecycleManager against a real embedded tritonserver: wake, idle unload, LRU, OOM, recovery, rescale.

The module runs its own tritonserver over its own repository (models published through ModelStore),
so that killing and restarting it cannot disturb other test modules. The tests where the model's
process matters (memory, crashes, load failures, unloads) run for both workers: the model in its stub,
and in a worker forked from a preloaded parent (``worker = "preforked"``; its id ends in ``-pf``).
Logic that needs no real Triton (the snapshot pause, the autoscaling rule's cycle) is checked over the fake
Triton in tests/model/test_lifecycle_logic.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from unittest import mock

import httpx
import psutil
import pytest

from controlplane.errors import ConflictError, NotFoundError, UnavailableError
from controlplane.lifecycle.manager import LifecycleManager
from controlplane.lifecycle.memory.gpu_memory import GpuDevice, GpuProcessUse
from controlplane.lifecycle.state import ModelState
from controlplane.lifecycle.workers import alive, workers_of
from controlplane.render import embedded_target
from controlplane.settings import Settings
from controlplane.spec import DeploymentSpec, resolve
from controlplane.store import ModelStore
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.dead_stub import is_dead_stub_http_body
from controlplane.triton.launcher import EmbeddedTriton
from controlplane.warmup_samples import LEARNED_FILE, read_note
from harness.probes import until_async

pytestmark = pytest.mark.integration

DEADLINE = 30.0
MIB = 1024 * 1024  # generous: a 2-core machine under load

MODEL_PY = """
import time


class Model:
    def __init__(self, scale=2.0, predict_sleep=0.0, load_sleep=0.0, unload_sleep=0.0, load_error="", ballast_mb=0):
        self.scale, self.predict_sleep, self.unload_sleep = scale, predict_sleep, unload_sleep
        self.load_sleep, self.load_error, self.ballast_mb = load_sleep, load_error, ballast_mb

    def load(self, model_dir, device):
        self.ballast = bytearray(self.ballast_mb * 1024 * 1024)
        self.ballast[::4096] = b"x" * len(self.ballast[::4096])  # every page written: resident, the model's own
        time.sleep(self.load_sleep)
        if self.load_error == "memory":
            raise MemoryError("simulated: cannot allocate the weights")
        if self.load_error == "runtime":
            raise RuntimeError("simulated: broken weights")
        if self.load_error == "cuda":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

    def predict(self, inputs):
        time.sleep(self.predict_sleep)
        return {"y": inputs["x"] * self.scale}

    def unload(self):
        time.sleep(self.unload_sleep)
"""

MANIFEST = {
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [2]}],
    "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
    "params_schema": {
        "scale": {"type": "float", "default": 2.0},
        "predict_sleep": {"type": "float", "default": 0.0},
        "load_sleep": {"type": "float", "default": 0.0},
        "unload_sleep": {"type": "float", "default": 0.0},
        "load_error": {"type": "str", "default": ""},
        "ballast_mb": {"type": "int", "default": 0},
    },
}
WORKERS = ("in-stub", "preforked")


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lifecycle_pkg")
    (folder / "snooze_model.py").write_text(textwrap.dedent(MODEL_PY))
    (folder / "snooze_model.json").write_text(json.dumps(MANIFEST))
    return folder


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    root = tmp_path_factory.mktemp("lifecycle_triton")
    (root / "repo").mkdir()
    server = EmbeddedTriton(root / "repo", root / "work")
    try:
        # As a Triton started without PYTHONPYCACHEPREFIX (one a user runs): its stubs and the preforked parents
        # then write no bytecode at all. Nothing but publishing writes into the repository: a file written there
        # is a change of the model to Triton, which loads it anew when a load next names it.
        with mock.patch.dict(os.environ, {"PYTHONPYCACHEPREFIX": "", "PYTHONDONTWRITEBYTECODE": ""}):
            server.start()
        yield server
    finally:
        server.stop()
    written = [str(p) for p in (root / "repo").rglob("*.pyc")]
    assert not written, f"Triton's processes wrote into the model repository: {written[:5]}"


@pytest.fixture(scope="module")
def store(triton: EmbeddedTriton) -> ModelStore:
    return ModelStore(triton.model_repository, embedded_target())


@pytest.fixture
def publish(store: ModelStore, package: Path) -> Callable[..., str]:
    """Publish the test package; a preforked model's id gets ``-pf`` (one id per worker kind)."""

    def publish(model_id: str, params: dict | None = None, **deployment: object) -> str:
        if deployment.get("worker") == "preforked" and not model_id.endswith("-pf"):
            model_id = f"{model_id}-pf"
        store.publish(resolve(DeploymentSpec(id=model_id, path=package, params=params or {}, **deployment)))
        return model_id

    return publish


def model_pids(triton: EmbeddedTriton, model: str) -> list[int]:
    """The processes running the model's code: its stubs, or (preforked) their live workers."""
    stubs = triton.processes().stubs(model)
    workers = [w for w in workers_of(triton.journal_dir, stubs) if alive(w.pid, w.start_ticks)]
    return sorted(w.pid for w in workers) if workers else [s.pid for s in stubs]


@pytest.fixture
async def make_manager(
    triton: EmbeddedTriton, store: ModelStore
) -> AsyncIterator[Callable[..., Awaitable[LifecycleManager]]]:
    """Started managers over the module's Triton; afterwards every model is unloaded again."""
    made: list[tuple[LifecycleManager, TritonAdminClient]] = []

    async def make(gpu_reader: object = None, **settings: object) -> LifecycleManager:
        admin = TritonAdminClient(triton.http_url, triton.metrics_url)
        extra = {} if gpu_reader is None else {"gpu_reader": gpu_reader, "gpu_pid_map": IdentityPidMap()}
        manager = LifecycleManager(
            Settings(**{"sweep_interval_secs": 0.2, **settings}), store, admin, triton_process=triton, **extra
        )
        made.append((manager, admin))
        await manager.start()
        return manager

    yield make
    for manager, admin in made:
        await manager.stop()
        if triton.is_running():
            for entry in await admin.repository_index(ready_only=True):
                await admin.unload(entry.name)
        await admin.aclose()


async def infer(triton: EmbeddedTriton, model: str, x: list[float] | None = None) -> httpx.Response:
    body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": x or [1.0, 2.0]}]}
    async with httpx.AsyncClient(timeout=DEADLINE) as http:
        return await http.post(f"{triton.http_url}/v2/models/{model}/infer", json=body)


async def output(triton: EmbeddedTriton, model: str) -> list[float]:
    r = await infer(triton, model)
    assert r.status_code == 200, r.text
    return r.json()["outputs"][0]["data"]


# The manager's state, read on its own loop (not from a thread) every 50 ms, for DEADLINE seconds unless told.
loop_until = functools.partial(until_async, timeout=DEADLINE, interval=0.05, in_thread=False)


def sample(manager: LifecycleManager, name: str, **labels: str) -> float:
    return manager.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("worker", WORKERS)
async def test_wake_single_flight(make_manager, publish, triton, worker):
    model = publish("wake", worker=worker)
    manager = await make_manager()
    assert manager.status(model).state is ModelState.UNLOADED

    await asyncio.gather(*(manager.ensure_ready(model) for _ in range(50)))

    status = manager.status(model)
    assert status.state is ModelState.READY and status.load_count == 1 and status.instances == 1
    assert sample(manager, "snooze_cold_starts_total", model=model, trigger="request") == 1
    assert status.last_cold_start_secs and status.last_cold_start_secs > 0
    assert status.memory_bytes and status.memory_bytes > 0  # RSS of the stub (plus its worker's USS)
    assert len(triton.stub_pids(model)) == 1 and len(model_pids(triton, model)) == 1
    assert status.worker == worker
    assert await output(triton, model) == [2.0, 4.0]
    with pytest.raises(NotFoundError, match="not-published"):
        await manager.ensure_ready("not-published")


async def test_a_preforked_workers_memory_is_its_models_and_leaves_with_its_unload(make_manager, publish, triton):
    model = publish("heavy", params={"ballast_mb": 64}, worker="preforked")
    manager = await make_manager()
    await manager.ensure_ready(model)
    [stub] = triton.processes().stubs(model)
    [worker] = workers_of(triton.journal_dir, [stub])
    own = psutil.Process(worker.pid).memory_full_info().uss
    worker_pss = psutil.Process(worker.pid).memory_full_info().pss
    stub_pss = psutil.Process(stub.pid).memory_full_info().pss
    [parent] = [p for p in manager.runtime()["preloaded_parents"] if worker.pid in
                {c.pid for c in psutil.Process(p["pid"]).children()}]  # fmt: skip
    status = manager.status(model)
    assert own >= 64 * MIB  # what load() allocated is the worker's own (USS)
    # charged: its stub's and its worker's proportional memory (Pss): the worker's own pages whole, the pages it
    # shares with its parent (and the stub with the other processes) split among them
    assert 64 * MIB <= status.memory_bytes - stub_pss * 1.1, (status, own, stub_pss)
    assert abs(status.memory_bytes - (stub_pss + worker_pss)) < 8 * MIB, (status, stub_pss, worker_pss)
    assert parent["memory_bytes"] > 0 and manager.loader.budget.overhead >= parent["memory_bytes"]
    assert set(parent["warm_secs"]) == {"numpy"}  # what it warmed before forking, for /v1/runtime

    await manager.unload(model)
    assert not psutil.pid_exists(worker.pid)  # the worker, and its memory, left with the unload
    assert psutil.pid_exists(parent["pid"])  # the parent stays for the next cold start


async def test_wake_deadline_then_the_load_completes(make_manager, publish):
    model = publish("slow-wake", params={"load_sleep": 1.5})
    manager = await make_manager()
    with pytest.raises(UnavailableError, match="slow-wake.*not ready") as info:
        await manager.ensure_ready(model, timeout=0.1)
    assert info.value.retry_after and info.value.status_code == 503
    await manager.ensure_ready(model)  # joins the load that kept running
    assert manager.status(model).load_count == 1


@pytest.mark.parametrize("worker", WORKERS)
async def test_idle_unload_and_wake_again(make_manager, publish, triton, worker):
    model = publish("idle", idle_timeout_secs=1, worker=worker)
    manager = await make_manager()
    await manager.ensure_ready(model)
    [process] = model_pids(triton, model)
    before = time.time()
    assert await output(triton, model) == [2.0, 4.0]
    await loop_until(lambda: (manager.status(model).last_access or 0) >= before - 1, "Triton's last_inference")

    await loop_until(lambda: manager.status(model).state is ModelState.UNLOADED, "the idle unload")
    assert manager.status(model).reason == "idle"
    assert triton.stub_pids(model) == [] and not psutil.pid_exists(process)
    assert sample(manager, "snooze_idle_unloads_total", model=model) == 1
    assert (await infer(triton, model)).status_code == 404  # what the gateway retries to the activator

    await manager.ensure_ready(model)
    assert await output(triton, model) == [2.0, 4.0] and manager.status(model).load_count == 2


async def test_wake_waits_for_an_unload_in_progress(make_manager, publish, triton):
    model = publish("unloading", params={"unload_sleep": 1.0})
    manager = await make_manager()
    await manager.ensure_ready(model)
    unloading = asyncio.create_task(manager.unload(model))
    await loop_until(lambda: manager.status(model).state is ModelState.UNLOADING, "the unload to start")
    await manager.ensure_ready(model)
    assert (await unloading).state in (ModelState.UNLOADED, ModelState.READY)
    assert manager.status(model).state is ModelState.READY and manager.status(model).load_count == 2
    assert await output(triton, model) == [2.0, 4.0]


@pytest.mark.parametrize("worker", WORKERS)
async def test_lru_eviction_under_memory_budget(make_manager, publish, triton, worker):
    a, b, c = (publish(f"lru-{n}", worker=worker) for n in "abc")
    manager = await make_manager(eviction_policy="lru")  # gdsf's choices: tests/model/test_lifecycle_budget.py
    await manager.ensure_ready(a)
    await manager.ensure_ready(b)
    await output(triton, b)  # b is used last: a is the least recently used
    sizes = [manager.status(m).memory_bytes or 0 for m in (a, b)]
    assert all(sizes)
    parents = manager.loader.budget.overhead  # preforked: the preloaded parent, counted once
    assert (parents > 0) == (worker == "preforked")
    server = manager.budget.server  # tritonserver's own memory counts too
    assert server > 0
    manager.settings.memory_budget_mb = (sum(sizes) * 1.25 + parents + server) / (1024 * 1024)  # two fit, not three

    await manager.ensure_ready(c)

    assert manager.status(a).state is ModelState.UNLOADED and triton.stub_pids(a) == []  # the least recently used
    # b stays, unless tritonserver's own growth as c loaded took the quarter of a model to spare (seen once of about
    # ten runs beside a loaded machine): then b goes too, for memory, after a
    assert manager.status(b).state is ModelState.READY or manager.status(b).reason == "memory"
    assert manager.status(c).state is ModelState.READY
    assert sample(manager, "snooze_evictions_total", model=a, reason="memory") == 1
    assert await output(triton, c) == [2.0, 4.0]


@pytest.mark.parametrize("worker", WORKERS)
async def test_load_failure_is_reported_then_fixed(make_manager, publish, triton, worker):
    model = publish("broken", params={"load_error": "runtime"}, worker=worker)
    manager = await make_manager()
    for attempt in (1, 2):  # every request retries the load of a failed model
        with pytest.raises(UnavailableError, match="broken.*simulated: broken weights"):
            await manager.ensure_ready(model)
        status = manager.status(model)
        assert status.state is ModelState.FAILED and "simulated: broken weights" in status.reason
        assert sample(manager, "snooze_load_failures_total", model=model, kind="error") == attempt

    publish(model, worker=worker)  # fixed
    await manager.published(model)
    assert manager.status(model).state is ModelState.UNLOADED
    await manager.ensure_ready(model)
    assert await output(triton, model) == [2.0, 4.0]


@pytest.mark.parametrize("worker", WORKERS)
async def test_out_of_memory_load_evicts_and_retries_once(make_manager, publish, triton, worker):
    victim = publish("oom-victim", worker=worker)
    hog = publish("oom-hog", params={"load_error": "memory"}, worker=worker)
    manager = await make_manager()
    await manager.ensure_ready(victim)

    with pytest.raises(UnavailableError, match=f"{hog}.*out of memory even after unloading {victim}") as info:
        await manager.ensure_ready(hog)

    assert info.value.hint and "memory" in info.value.hint
    assert manager.status(hog).state is ModelState.FAILED
    assert manager.status(victim).state is ModelState.UNLOADED and triton.stub_pids(victim) == []
    assert sample(manager, "snooze_evictions_total", model=victim, reason="oom") == 1
    assert sample(manager, "snooze_load_failures_total", model=hog, kind="oom") == 1
    with pytest.raises(UnavailableError, match="no idle model could be unloaded"):
        await manager.ensure_ready(hog)  # nothing left to evict: fails without a second attempt


@pytest.mark.parametrize("worker", WORKERS)
async def test_dead_stub_is_detected_and_recovered(make_manager, publish, triton, worker):
    model = publish("crashy", worker=worker)
    manager = await make_manager(sweep_interval_secs=3600, watch_interval_secs=3600)  # passes by hand
    await manager.ensure_ready(model)
    [process] = model_pids(triton, model)  # preforked: its worker, whose death takes the stub along
    os.kill(process, signal.SIGKILL)
    await loop_until(lambda: triton.stub_pids(model) == [], "the stub to die")

    r = await infer(triton, model)  # Triton 2.51 keeps the model READY with a dead stub
    # ... and answers with the one signature the gateway retries (controlplane/triton/dead_stub.py).
    assert r.status_code == 500 and is_dead_stub_http_body(r.content), r.content
    assert r.json()["error"] == f"Stub process '{model}_0_0' is not healthy."

    await manager.watch()
    # The transition's end, not the READY state: the load sets READY, then measures the server, then the
    # recovery counts itself (a READY seen in between read 0 recoveries once, under load).
    rec = manager.states.records[model]
    await loop_until(lambda: rec.op is None, "the recovery")
    assert manager.status(model).state is ModelState.READY
    assert sample(manager, "snooze_recoveries_total", model=model, cause="dead_stub") == 1
    assert "SIGKILL" in (manager.status(model).last_crash or "")
    assert await output(triton, model) == [2.0, 4.0]

    # The activator's path: a request failed with "not healthy", then it calls recover().
    os.kill(model_pids(triton, model)[0], signal.SIGKILL)
    await loop_until(lambda: triton.stub_pids(model) == [], "the stub to die")
    r = await infer(triton, model)
    assert r.status_code == 500 and "is not healthy" in r.json()["error"]
    await manager.recover(model, "stub_unhealthy")
    assert await output(triton, model) == [2.0, 4.0]
    loads = manager.status(model).load_count
    await manager.recover(model, "stub_unhealthy")  # a late duplicate does not reload again
    assert manager.status(model).load_count == loads == 3


@pytest.mark.parametrize("worker", WORKERS)
async def test_api_load_with_instances_and_unload(make_manager, publish, triton, worker):
    model = publish("api-model", max_instances=3, worker=worker)
    manager = await make_manager()
    status = await manager.load(model, instances=2)
    assert (status.state, status.instances) == (ModelState.READY, 2) and len(triton.stub_pids(model)) == 2
    processes = model_pids(triton, model)
    assert len(processes) == 2
    assert (await manager.load(model, instances=1)).instances == 1
    await loop_until(lambda: len(triton.stub_pids(model)) == 1, "one stub")
    with pytest.raises(ConflictError, match="api-model.*1..3"):
        await manager.load(model, instances=4)
    status = await manager.unload(model)
    assert status.state is ModelState.UNLOADED and status.instances == 0 and status.memory_bytes is None
    await loop_until(lambda: triton.stub_pids(model) == [], "the stubs to exit")
    assert not any(psutil.pid_exists(p) for p in processes)


async def test_republish_reloads_and_a_failed_reload_keeps_the_old_model(make_manager, publish, triton):
    model = publish("repub")
    manager = await make_manager()
    await manager.ensure_ready(model)
    assert await output(triton, model) == [2.0, 4.0]

    publish(model, params={"scale": 3.0})
    await manager.published(model)
    assert await output(triton, model) == [3.0, 6.0] and manager.status(model).load_count == 2

    publish(model, params={"load_error": "runtime"})
    await manager.published(model)
    status = manager.status(model)
    assert status.state is ModelState.READY and "previous version" in status.reason
    assert await output(triton, model) == [3.0, 6.0]

    await manager.forget(model)
    assert triton.stub_pids(model) == [] and model not in {s.id for s in manager.statuses() if s.state == "ready"}


async def test_start_adopts_models_triton_has_loaded(make_manager, publish, triton):
    model = publish("adopted", instances=2)
    async with TritonAdminClient(triton.http_url) as admin:
        await admin.load(model)
    manager = await make_manager()
    status = manager.status(model)
    assert (status.state, status.instances, status.load_count) == (ModelState.READY, 2, 0)
    assert status.memory_bytes and status.memory_bytes > 0


async def test_triton_killed_is_restarted_and_resynced(make_manager, publish, triton):
    model = publish("phoenix")
    manager = await make_manager()
    await manager.ensure_ready(model)
    old_pid = triton.pid
    os.kill(old_pid, signal.SIGKILL)

    await loop_until(lambda: sample(manager, "snooze_triton_restarts_total") == 1, "the restart", timeout=90)
    # Until the resync has read the new Triton's index, a wake-up is refused at once (503, "restarting")
    await loop_until(
        lambda: manager.sync.up.is_set() and manager.status(model).state is ModelState.UNLOADED, "the resync"
    )
    assert triton.is_running() and triton.pid != old_pid

    await manager.ensure_ready(model)
    assert await output(triton, model) == [2.0, 4.0]


# ------------------------------------------------------------------------------------------------
# GPU memory. No GPU here: NVML is replaced at its boundary by a reader that reports, for the real stub
# processes of this Triton, the video memory each model's processes would hold on GPU 0. Everything
# else (loads, evictions, the OOM retry) is the real lifecycle against the real tritonserver.

GPU_MB = 600


class IdentityPidMap:
    """NVML's pids are ours (the control plane in the host's PID namespace)."""

    reason = None

    def visible_pid(self, nvml_pid: int) -> int:
        return nvml_pid


class FakeNvml:
    """GpuProcessReader: one 16 GiB GPU; each stub of a model named ``gpu-*`` holds GPU_MB on it."""

    def __init__(self, triton: EmbeddedTriton) -> None:
        self.triton = triton

    def _uses(self) -> list[GpuProcessUse]:
        return [
            GpuProcessUse(0, "GPU-fake-0", stub.pid, GPU_MB * MIB)
            for stub in self.triton.processes().stubs()
            if stub.model.startswith("gpu-")
        ]

    def devices(self) -> list[GpuDevice]:
        used = sum(u.used_bytes or 0 for u in self._uses())
        return [GpuDevice(0, "GPU-fake-0", 16 * 1024 * MIB, used)]

    def processes(self) -> list[GpuProcessUse]:
        return self._uses()


async def test_gpu_memory_budget_evicts_the_least_recently_used_model_per_gpu(make_manager, publish, triton):
    a, b, c = publish("gpu-a"), publish("gpu-b"), publish("gpu-c")
    # lru named: the GPU budget evicts in the host budget's order, which the setting picks (gdsf by default)
    manager = await make_manager(
        gpu_reader=FakeNvml(triton), gpu_memory_budget_mb=2 * GPU_MB + 100, eviction_policy="lru"
    )
    for model in (a, b):
        await manager.ensure_ready(model)
        assert manager.status(model).gpu_memory_bytes == {"0": GPU_MB * MIB}
    await output(triton, a)  # b is now the least recently used
    await asyncio.sleep(1.1)  # Triton's last_inference has a resolution of its stats refresh
    await manager.ensure_ready(c)  # its first load: measured afterwards, then the budget is enforced
    await loop_until(lambda: manager.status(b).state is ModelState.UNLOADED, "b evicted for c")
    assert manager.status(b).reason == "gpu_memory" and manager.status(b).gpu_memory_bytes is None
    assert {manager.status(m).state for m in (a, c)} == {ModelState.READY}
    await manager.ensure_ready(b)  # measured before: a (now least recent) is evicted before b loads
    assert manager.status(a).state is ModelState.UNLOADED and manager.status(a).reason == "gpu_memory"
    assert sample(manager, "snooze_model_gpu_memory_bytes", model=b, gpu="0") == GPU_MB * MIB
    assert sample(manager, "snooze_evictions_total", model=a, reason="gpu_memory") == 1


async def test_cuda_out_of_memory_at_load_evicts_on_the_gpu_and_retries_once(make_manager, publish, triton):
    victim, hog = publish("gpu-victim"), publish("gpu-hog", params={"load_error": "cuda"})
    manager = await make_manager(gpu_reader=FakeNvml(triton))
    await manager.ensure_ready(victim)
    with pytest.raises(UnavailableError, match="gpu-hog.*out of memory even after unloading gpu-victim") as info:
        await manager.ensure_ready(hog)
    assert info.value.hint and "GPU" in info.value.hint
    assert manager.status(victim).state is ModelState.UNLOADED and manager.status(victim).reason == "gpu_oom"
    assert sample(manager, "snooze_load_failures_total", model=hog, kind="oom") == 1


# ------------------------------------------------------------------------------------------------
# Adaptive keep-alive. The policy's history is given by hand (a caller every 5 s whose last request came 4 s
# ago) so that the pre-warm is due at once; the periodic caller in real time is tests/integration/
# test_keepalive_live.py.

PERIOD = 5.0


def learned_periodic_caller(manager: LifecycleManager, model: str) -> None:
    """The model's policy has seen a request every PERIOD s, the last one 4 s ago: its pre-warm is due."""
    now = time.time()
    for k in range(4, 0, -1):
        manager.warmth.request(manager.states.record(model), now - 4 - (k - 1) * PERIOD)
    assert manager.status(model).keep_alive["pattern"]


async def test_prewarm_loads_ahead_of_the_request_counted_apart_then_unloads_between_requests(
    make_manager, publish, triton
):
    model = publish("prewarmed", keep_alive="adaptive", idle_timeout_secs=1)
    manager = await make_manager(keep_alive_min_samples=3, keep_alive_min_unloaded_secs=0.5)
    learned_periodic_caller(manager, model)

    await loop_until(lambda: manager.status(model).state is ModelState.READY, "the pre-warm")
    status = manager.status(model)
    assert status.keep_alive["prewarmed_unused"] and status.keep_alive["prewarm_loads"] == 1
    # counted once the pre-warm's load is done: READY comes a few awaits before (its memory measured between)
    await loop_until(lambda: sample(manager, "snooze_prewarm_loads_total", model=model) == 1, "the pre-warm counted")
    assert sample(manager, "snooze_cold_starts_total", model=model, trigger="request") == 0

    assert await output(triton, model) == [2.0, 4.0]  # the predicted request, straight to Triton: warm
    await loop_until(lambda: manager.status(model).state is ModelState.UNLOADED, "the unload until the next pre-warm")
    assert manager.status(model).reason == "idle"
    assert sample(manager, "snooze_prewarm_outcomes_total", model=model, outcome="used") == 1
    assert sample(manager, "snooze_prewarm_outcomes_total", model=model, outcome="wasted") == 0
    assert manager.status(model).keep_alive["samples"] == 4  # the request was heard once


async def test_prewarm_uses_free_budget_only_and_an_unused_prewarm_is_evicted_first(make_manager, publish, triton):
    idle, newcomer = publish("budget-idle"), publish("budget-new")
    bet = publish("budget-bet", keep_alive="adaptive", idle_timeout_secs=60)
    manager = await make_manager(keep_alive_min_samples=3, keep_alive_min_unloaded_secs=0.5)
    await manager.ensure_ready(idle)
    size = manager.status(idle).memory_bytes
    assert size
    server = manager.budget.server  # tritonserver's own memory counts too
    manager.settings.memory_budget_mb = (1.5 * size + server) / MIB  # the pre-warm would need idle's memory
    learned_periodic_caller(manager, bet)
    for _ in range(5):  # sweeps pass (every 0.2 s) and leave everything as it is
        await manager.sweep()
    assert manager.status(bet).state is ModelState.UNLOADED and manager.status(idle).state is ModelState.READY
    assert sample(manager, "snooze_prewarm_loads_total", model=bet) == 0
    assert sample(manager, "snooze_evictions_total", model=idle, reason="memory") == 0

    manager.settings.memory_budget_mb = (2.5 * size + server) / MIB  # room for one more: the pre-warm goes ahead
    await loop_until(lambda: manager.status(bet).state is ModelState.READY, "the pre-warm")
    assert manager.status(idle).state is ModelState.READY

    await manager.ensure_ready(newcomer)  # a third does not fit: the unused pre-warm goes, not the older idle model
    assert manager.status(bet).state is ModelState.UNLOADED and manager.status(idle).state is ModelState.READY
    assert sample(manager, "snooze_evictions_total", model=bet, reason="memory") == 1
    assert sample(manager, "snooze_prewarm_outcomes_total", model=bet, outcome="wasted") == 1


async def test_a_model_adopted_at_start_is_unloaded_by_its_policy(make_manager, publish, triton):
    model = publish("adopted-adaptive", keep_alive="adaptive", idle_timeout_secs=1)
    async with TritonAdminClient(triton.http_url) as admin:
        await admin.load(model)
    manager = await make_manager()
    assert manager.status(model).state is ModelState.READY
    await loop_until(lambda: manager.status(model).state is ModelState.UNLOADED, "the idle unload of the adopted model")
    assert manager.status(model).keep_alive["reason"].startswith("learning")


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``folder``: (size, mtime in ns), what Triton's modification check reads."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


async def test_what_traffic_taught_a_loaded_model_is_kept_before_its_next_load(make_manager, publish, triton, store):
    """The shapes a model's first request showed replace its generated warm-up at its next load. They are written into
    its folder before that load, never while Triton holds the model: a file written into a loaded model's folder is a
    change of the model to Triton, which then loads it anew (its instances replaced) when a load next names it, an
    ensemble's over it included (a CI run's ensemble test met that)."""
    model = publish("learns")
    manager = await make_manager()
    await manager.ensure_ready(model)
    folder = store.get(model).path
    before = _files(folder)
    assert (await infer(triton, model)).status_code == 200
    rec = manager.states.records[model]

    def noted() -> bool:
        notes = [read_note(triton.journal_dir, s.pid, s.start_ticks) for s in rec.procs.stubs]
        return any(n and n.get("learned") for n in notes)

    await loop_until(noted, "the model process to note its request's shapes")
    await asyncio.sleep(1.0)  # five sweeps, each of which reads that note
    assert _files(folder) == before  # nothing written while Triton holds it
    await manager.unload(model)
    await manager.ensure_ready(model)
    assert (folder / LEARNED_FILE).is_file()
    assert manager.status(model).warmup == "learned"
