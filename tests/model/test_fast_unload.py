"""Unloads that end the model's processes once Triton has let go (``controlplane/lifecycle/unloading.py``), and
loads side by side: the lifecycle's logic over the fake Triton, in virtual time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.lifecycle.memory.gpu_memory import GpuDevice
from controlplane.lifecycle.state import ModelState
from harness.fake_triton import MIB
from harness.lifecycle_world import BUDGET_MB, LifecycleWorld

TRITON_UNLOAD_SECS = 1.2  # the python backend's 1 s health probe, then the stub's finalize and exit


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LifecycleWorld]:
    logging.getLogger("snoozeml").setLevel(logging.CRITICAL)
    w = LifecycleWorld(tmp_path, monkeypatch=monkeypatch)
    w.triton.unload_delay = TRITON_UNLOAD_SECS
    yield w
    w.close()  # answers every call and checks the invariants once more
    logging.getLogger("snoozeml").setLevel(logging.NOTSET)


def answers(world: LifecycleWorld, what: str = "request") -> list[Any]:
    return [c.answer for c in world.answered if c.what == what]


def test_an_eviction_ends_the_processes_before_triton_finishes_its_unload(world):
    for model in ("m0", "m1", "m2"):
        world.step(world.publish(model, 150), 0.1)
    world.step(world.request("m0"), 0.5)
    world.step(world.request("m1"), 0.5)
    evicted = list(world.triton.models["m0"].stubs)
    world.step(world.request("m2"), 0.3)  # the budget holds two: m0, least recently used, makes room
    assert world.triton.models["m0"].state == "UNLOADING"  # Triton is still in its health probe
    assert not any(s.alive for s in evicted)  # but m0's memory is free already
    assert world.manager.status("m2").state is ModelState.READY
    assert world.manager.status("m0").state is ModelState.UNLOADED and world.manager.status("m0").last_crash is None
    world.step(world.tick(2.0), 0.1)  # Triton finishes its unload: no recovery, no crash seen
    assert world.manager.status("m0").state is ModelState.UNLOADED
    assert world.manager.metrics.recoveries.labels(model="m0", cause="dead_stub")._value.get() == 0


def test_a_process_running_a_request_is_not_ended(world):
    world.triton.exec_delay = 0.5
    world.step(world.publish("m0", 100), 0.1)
    world.step(world.request("m0"), 1.0)
    world.step(world.request("m0"), 0.1)  # runs for 0.5 s
    [stub] = world.triton.models["m0"].stubs
    assert stub.running is not None
    world.step(world.api_unload("m0"), 3.0)  # finds it busy: Triton's own unload, after the request
    assert answers(world) == ["200", "200"] and max(world.triton.executions.values()) == 1
    assert world.manager.status("m0").state is ModelState.UNLOADED
    assert stub.exit_status == 0  # ended by Triton, not killed


def test_a_declared_unload_keeps_tritons_unload(world):
    world.triton.declares_unload.add("m0")
    world.step(world.publish("m0", 100), 0.1)
    world.step(world.request("m0"), 1.0)
    [stub] = world.triton.models["m0"].stubs
    world.step(world.api_unload("m0"), 0.5)
    assert stub.alive  # its unload() runs: Triton finalizes it
    world.step(world.tick(1.0), 0.1)
    assert stub.exit_status == 0 and world.manager.status("m0").state is ModelState.UNLOADED


def test_an_unload_that_overruns_its_bound_is_ended(world):
    world.triton.declares_unload.add("m0")
    world.step(world.publish("m0", 100), 0.1)
    world.step(world.request("m0"), 1.0)
    [stub] = world.triton.models["m0"].stubs
    world.step(world.unload_hang("m0", 100.0), 0)
    world.step(world.api_unload("m0"), 1.0 + world.settings.unload_finalize_secs + 1.0)
    assert not stub.alive and world.manager.status("m0").state is ModelState.UNLOADED
    assert answers(world, "unload") == ["unloaded"]


def test_a_request_handed_to_a_stopped_process_runs_once_after_a_wake(world, monkeypatch):
    """The one corner of an early end: a request reaches Triton directly between the idle check and the unload,
    and Triton hands it to the stopped stub. It never ran: its dead-stub answer goes to the activator, which
    sends it once the model is awake again."""
    world.step(world.publish("m0", 100), 0.1)
    world.step(world.request("m0"), 1.0)
    unloader = world.manager.unloader
    end = unloader._end

    async def a_request_slips_in(*args: Any) -> str:
        await world.request("m0")  # handed to the stopped stub
        await asyncio.sleep(0)
        return await end(*args)

    monkeypatch.setattr(unloader, "_end", a_request_slips_in)
    world.step(world.api_unload("m0"), 0.1)
    monkeypatch.setattr(unloader, "_end", end)
    world.step(world.tick(5.0), 0.1)
    assert answers(world) == ["200", "200"]
    assert max(world.triton.executions.values()) == 1 and len(world.triton.executions) == 2
    assert world.manager.status("m0").state is ModelState.READY  # woken again by that request


def peak_loads_of_three(world: LifecycleWorld) -> tuple[int, int]:
    """Three models requested at once, each load taking a second: the most loads at once, the most memory held."""
    peak_loads = peak_held = 0
    for model in ("m0", "m1", "m2"):
        world.step(world.publish(model, 100), 0.1)
        world.step(world.script_load(model, "ok", 1.0), 0)
    for model in ("m0", "m1", "m2"):
        world.step(world.request(model), 0)
    for _ in range(30):
        world.step(world.tick(0.1), 0)
        peak_loads = max(peak_loads, sum(world.triton.loads_in_flight.values()))
        peak_held = max(peak_held, sum(world.triton.holding().values()))
    world.step(world.tick(3.0), 0)
    assert answers(world) == ["200", "200", "200"]
    return peak_loads, peak_held


def test_loads_run_side_by_side_within_the_budget(world):
    peak_loads, peak_held = peak_loads_of_three(world)
    assert peak_loads == world.settings.max_concurrent_loads == 2
    assert peak_held <= BUDGET_MB * MIB


class OneGpu:
    """``GpuProcessReader`` of a machine with one GPU (no model uses it)."""

    def devices(self) -> list[GpuDevice]:
        return [GpuDevice(0, "GPU-0", 16 << 30, 0)]

    def processes(self) -> list[Any]:
        return []


def test_loads_run_one_at_a_time_on_a_machine_with_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A load's GPU memory may be measured as what the GPU's used memory grew by: nothing may load beside it."""
    logging.getLogger("snoozeml").setLevel(logging.CRITICAL)
    w = LifecycleWorld(tmp_path, monkeypatch=monkeypatch, gpu_reader=OneGpu())
    try:
        assert peak_loads_of_three(w)[0] == 1
    finally:
        w.close()
        logging.getLogger("snoozeml").setLevel(logging.NOTSET)


def test_a_load_that_must_evict_waits_for_the_load_in_flight(world):
    """Side by side only where memory allows: m1 fits beside m0 and loads; m2 needs room and waits for m1 (its
    reservation would otherwise crowd out what the policy keeps), then evicts and loads."""
    world.step(world.publish("m0", 150, idle_timeout_secs=3600), 0.1)
    world.step(world.request("m0"), 1.0)
    peak_loads = 0
    for model in ("m1", "m2"):
        world.step(world.publish(model, 100, idle_timeout_secs=3600), 0.1)
        world.step(world.script_load(model, "ok", 1.0), 0)
    world.step(world.request("m1"), 0)
    world.step(world.request("m2"), 0)
    for _ in range(40):
        world.step(world.tick(0.1), 0)
        peak_loads = max(peak_loads, sum(world.triton.loads_in_flight.values()))
    assert peak_loads == 1
    assert answers(world) == ["200", "200", "200"]
    assert world.manager.status("m2").state is ModelState.READY
