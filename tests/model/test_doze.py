"""Dozing in the lifecycle (``controlplane/lifecycle/dozing.py``) over the fake Triton, in virtual time: an idle
preforked model dozes before its idle timeout unloads it, a request wakes it without a Triton load, and the budget
charges what a dozing stub holds."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.lifecycle.loading import LOAD_ABANDON_SECS
from controlplane.lifecycle.state import ModelState
from controlplane.modes import Worker
from harness.fake_triton import MIB
from harness.lifecycle_world import BUDGET_MB, LOAD_TIMEOUT, LifecycleWorld

DOZE_AFTER = 1.0
IDLE_TIMEOUT = 6.0


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LifecycleWorld]:
    logging.getLogger("snoozeml").setLevel(logging.CRITICAL)
    w = LifecycleWorld(tmp_path, monkeypatch=monkeypatch, doze_after_secs=DOZE_AFTER)
    yield w
    w.close()  # answers every call and checks the invariants once more
    logging.getLogger("snoozeml").setLevel(logging.NOTSET)


def wakes(world: LifecycleWorld, model: str, origin: str) -> float:
    return float(world.manager.metrics.wakes.labels(model=model, origin=origin)._value.get())


def answers(world: LifecycleWorld) -> list[object]:
    return [c.answer for c in world.answered if c.what == "request"]


def dozing_beside_an_idle_one(world: LifecycleWorld, dozing: tuple[str, ...], idle: str, idle_worker: str) -> None:
    """``dozing`` (preforked, 150 MiB each awake) loaded and dozed, then ``idle`` (150 MiB, ``idle_worker``) loaded
    beside them, awake and idle."""
    for model in dozing:
        world.step(world.publish(model, 150, 1, "preforked"), 0.05)
        world.step(world.request(model, None), 0.3)
    world.step(world.tick(DOZE_AFTER + 1.5), 0.1)
    assert [world.manager.status(m).level for m in dozing] == ["dozing"] * len(dozing)
    world.step(world.publish(idle, 150, 1, idle_worker), 0.05)
    world.step(world.request(idle, None), 0.3)
    assert world.manager.status(idle).level == "awake"


def loaded_preforked(world: LifecycleWorld, model: str = "m0", size_mb: float | None = None) -> None:
    world.triton.memory[model] = 120 * MIB  # what each stub holds awake (measured: none declared)
    world.step(world.publish(model, size_mb, worker=Worker.PREFORKED, idle_timeout_secs=IDLE_TIMEOUT), 0.1)
    world.step(world.request(model), 0.5)
    assert world.manager.status(model).level == "awake"


def test_an_idle_preforked_model_dozes_then_its_idle_timeout_unloads_it(world):
    loaded_preforked(world)
    [stub] = world.triton.models["m0"].stubs
    world.step(world.tick(DOZE_AFTER + 1.5), 0.1)
    status = world.manager.status("m0")
    assert status.state is ModelState.READY and status.level == "dozing"
    assert world.triton.models["m0"].state == "READY" and world.triton.models["m0"].stubs == [stub] and stub.alive
    assert status.memory_bytes == world.triton.dozing_bytes  # charged what the dozing stub holds
    assert world.manager.metrics.dozes.labels(model="m0")._value.get() == 1

    world.step(world.tick(IDLE_TIMEOUT), 0.1)  # idle_timeout_secs keeps its meaning
    status = world.manager.status("m0")
    assert status.state is ModelState.UNLOADED and status.level == "unloaded" and not stub.alive


def test_a_request_wakes_a_dozing_model_without_a_load_and_the_wake_is_counted(world):
    loaded_preforked(world)
    loads = world.manager.status("m0").load_count
    world.step(world.tick(DOZE_AFTER + 1.5), 0.1)
    assert world.manager.status("m0").level == "dozing"

    world.step(world.burst("m0", 4), 0.5)  # concurrent first requests: the stub wakes once
    [stub] = world.triton.models["m0"].stubs
    assert answers(world) == ["200"] * 5 and stub.wakes == 1
    world.step(world.tick(1.0), 0.1)  # the next sweep hears the wake
    status = world.manager.status("m0")
    assert status.level == "awake" and status.load_count == loads  # no Triton load
    assert status.memory_bytes is not None and status.memory_bytes >= 120 * MIB  # charged awake again
    assert wakes(world, "m0", "doze") == 1 and wakes(world, "m0", "unloaded") == 1


def test_a_model_woken_from_doze_stays_awake_its_doze_time_though_triton_counted_the_request_after_the_sweep_read(
    world,
):
    """A sweep hears a wake while the waking batch runs (Triton's statistics count a batch when it ends); the batch
    ends before the same sweep's doze pass. Idle is counted from the wake heard, not from the stale statistics: the
    model stays awake (seen in CI: it dozed again 30 ms after its wake)."""
    loaded_preforked(world)
    world.step(world.tick(DOZE_AFTER + 1.5), 0.1)
    assert world.manager.status("m0").level == "dozing"
    world.step(world.pause(), 0.1)  # the sweep's passes are run by hand below, in its order
    rec = world.manager.states.get("m0")
    assert rec is not None
    world.triton.exec_delay = 0.5
    world.step(world.request("m0"), 0.2)  # the stub woke and runs the batch
    [stub] = world.triton.models["m0"].stubs
    assert stub.wakes == 1 and stub.running is not None
    world.run(world.manager.dozing.hear([rec]))  # the sweep's first pass: the wake heard, the request not yet counted
    assert rec.level == "awake"
    world.step(world.tick(0.5), 0.1)  # the batch ends
    assert answers(world)[-1] == "200" and stub.running is None
    world.run(world.manager.dozing.doze_idle([rec], {"m0"}, world.manager.dozing.clock.time()))  # the sweep's last pass
    assert rec.level == "awake"
    world.step(world.resume(), 0.1)
    world.step(world.tick(DOZE_AFTER + 1.5), 0.1)  # idle for its doze time after the wake: it dozes
    assert world.manager.status("m0").level == "dozing"


def test_a_failed_reload_of_a_model_a_request_woke_unheard_is_measured_at_the_next_sweep(world):
    """Found by the dozing machine (seed 799608125): m3 dozed (2 stubs); while paused a request woke one stub, and a
    republish's reload in place hung and failed (Triton kept the previous version). The state change ended the
    record's doze, its footprint still the dozing stubs': the next sweep asks the stubs again and measures what they
    hold (one awake, one dozing)."""
    s, w = world.step, world
    s(w.publish("m2", 60, 1, "preforked"), 0.05)
    s(w.script_load("m1", "error", 0.05), 0.01)
    s(w.publish("m3", 100, 2, "preforked"), 1.0)
    s(w.api_load("m2", None), 0.0)
    s(w.doze("m3"), 0.05)
    s(w.request("m3", 0.3), 0.0)
    s(w.publish("m2", 60, 2, "preforked"), 0.0)
    s(w.pause(), 0.0)
    s(w.remote_delete("m1"), 1.0)
    s(w.republish_while_waiting("m3", "hang", 1), 0.05)
    s(w.tick(LOAD_TIMEOUT + 1.0), 0.05)  # the reload fails (Triton keeps the version it holds); still paused
    rec = world.manager.states.get("m3")
    stubs = world.triton.models["m3"].stubs
    assert rec is not None and rec.state is ModelState.READY and rec.op is None
    assert sorted(s.awake_memory is None for s in stubs) == [False, True]  # one woke, one dozes
    assert rec.memory.footprint != world.triton.holding()["m3"]  # what the record knew: the doze's reading
    world.run(world.manager.dozing.hear([rec]))  # the next sweep's first pass
    assert rec.memory.footprint == world.triton.holding()["m3"] and rec.level == "dozing"
    s(w.resume(), 0.05)


def test_a_wake_of_an_older_publish_adopted_dozing_is_not_learned_as_growth_of_the_published_one(world):
    """Found by the dozing machine (seed 2182929700): a restart adopted m0 dozing as an older publish (preforked), and
    its reload to the one published (in-stub) hung and failed; a request woke the old stub, and the sweep learned the
    wake (20 -> 60 MiB) as growth, which the published version's load then counted ahead (140 MiB for the 100 its
    stub held). What an adoption measures of an older publish now learns no growth and carries none over."""
    s, w = world.step, world
    s(w.publish("m0", 60, 1, "preforked"), 0.05)
    s(w.request("m0", None), 0.3)
    s(w.pause(), 0.3)
    s(w.script_load("m0", "oom", 0.5), 1.0)
    s(w.publish("m2", 100, 1, "preforked"), 0.0)
    s(w.request("m2", None), 0.05)
    s(w.publish("m3", 150, 1, "in-stub"), 0.0)
    s(w.remote_publish("m2", 150), 0.0)
    s(w.publish("m0", 100, 1, "in-stub"), 0.01)
    s(w.script_load("m3", "error", 0.05), 0.05)
    s(w.republish_while_waiting("m3", "ok", 4), 0.05)
    s(w.script_load("m0", "hang", 0.5), 0.01)
    s(w.publish_ensemble_api(("m2",), 20), 0.01)
    s(w.request("e0", None), 0.3)
    s(w.doze("m0"), 1.0)
    s(w.restart(), 0.3)
    s(w.request("m0", None), 0.05)
    s(w.request("m2", None), 1.0)
    s(w.publish("m0", 100, 1, "in-stub"), 0.05)
    s(w.request("m1", None), 0.05)
    s(w.remote_publish("m1", 60), 0.0)
    rec = world.manager.states.get("m0")
    assert rec is not None and rec.memory.footprint == world.triton.holding()["m0"]  # the world checks every step


def test_a_wake_from_doze_beside_models_all_in_use_waits_for_room_then_goes_ahead_within_the_budget(world):
    """Found by the dozing machine (seed 2487831979): m0 and m3 held by streams, m2 dozing and held, then a request
    straight to Triton woke m2: 350 MiB of 300, nothing evictable while all three were in use. Its stub now asks
    room before it forks, and the wake waits for memory as a load would (the wake queue's bound): once the streams
    end, an idle model is evicted for it and the request is answered, within the budget all along."""
    s, w = world.step, world
    s(w.publish("m2", 60, 1, "preforked"), 0.05)
    s(w.publish("m3", 60, 1, "preforked"), 0.05)
    s(w.pause(), 0.3)
    s(w.api_load("m2", None), 0.0)
    s(w.publish("m3", 150, 1, "preforked"), 0.05)
    s(w.restart(), 1.0)
    s(w.remote_publish("m0", 100), 0.05)
    s(w.publish("m2", 100, 1, "preforked"), 0.05)
    s(w.hold("m0"), 0.0)
    s(w.hold("m3"), 1.0)
    s(w.hold("m2"), 0.01)
    s(w.request("m2", None), 0.05)
    s(w.tick(3.0), 1.0)

    def used() -> int:
        return world.triton.server_bytes() + sum(world.triton.holding().values())

    [stub] = world.triton.models["m2"].stubs
    assert stub.awake_memory is not None and stub.running  # its batch waits for room, not yet woken
    assert all(world.manager.states.records[m].in_use for m in ("m0", "m2", "m3"))
    assert world.triton.peak <= BUDGET_MB * MIB
    for _ in range(3):
        s(w.release(), 0.0)
    s(w.tick(2.5), 0.1)
    assert stub.wakes == 1 and [c.task.result() for c in world.answered if c.what == "request"] == ["200"]
    assert used() <= BUDGET_MB * MIB and world.triton.peak <= BUDGET_MB * MIB


def test_a_wake_of_a_dozing_model_during_its_reload_does_not_overcommit_the_budget(world):
    """Found by the dozing machine (seed 219470420): m2 dozing (2 stubs, 300 MiB awake, 40 dozing) is republished;
    its reload started with the doze record reset and counted the old version at 40 MiB beside the new one; a burst
    woke the old stubs on the warm path (450 MiB held), and a load of m3 admitted beside them left the tree at 680
    MiB for a 300 MiB budget. The reload now counts the old version at what it holds awake."""
    s, w = world.step, world
    s(w.publish("m2", 60, 1, "preforked"), 0.05)
    s(w.request("m2", None), 0.3)
    s(w.publish("m1", 100, 1, "preforked"), 0.01)
    s(w.publish("m2", 150, 2, "preforked"), 0.01)
    s(w.request("m1", 2.0), 0.05)
    s(w.stop_during_hung_load("m2", "stop"), 1.0)
    s(w.publish("m2", 150, 1, "in-stub"), 0.3)
    s(w.api_load("m1", 2), 0.0)
    s(w.publish("m3", 60, 1, "preforked"), 0.3)
    s(w.publish("m1", 150, 2, "in-stub"), 0.3)
    s(w.burst("m2", 2), 1.0)
    s(w.unload_hang("m2"), 1.0)
    s(w.tick(0.5), 0.0)
    s(w.request("m3", 2.0), 1.0)  # the world checks the tree's peak against the budget at each step


def test_an_in_stub_model_never_dozes(world):
    world.triton.memory["m0"] = 120 * MIB
    world.step(world.publish("m0", None, idle_timeout_secs=IDLE_TIMEOUT), 0.1)
    world.step(world.request("m0"), 0.5)
    world.step(world.tick(IDLE_TIMEOUT - 1.0), 0.1)
    assert world.manager.status("m0").level == "awake" and not world.stub_control.asked
    world.step(world.tick(2.0), 0.1)
    assert world.manager.status("m0").level == "unloaded"


def test_a_doze_time_not_below_the_idle_timeout_means_no_doze(world):
    world.triton.memory["m0"] = 120 * MIB
    world.step(world.publish("m0", None, worker=Worker.PREFORKED, idle_timeout_secs=DOZE_AFTER), 0.1)
    world.step(world.request("m0"), 0.5)
    world.step(world.tick(DOZE_AFTER + 1.5), 0.1)
    assert world.manager.status("m0").level == "unloaded" and not world.stub_control.asked


def test_a_busy_stub_is_asked_again_at_a_later_sweep(world):
    loaded_preforked(world)
    [stub] = world.triton.models["m0"].stubs
    stub.queued = 1  # as if a batch waited for it: it says busy
    world.step(world.tick(DOZE_AFTER + 1.5), 0.1)
    assert world.manager.status("m0").level == "awake" and world.stub_control.asked
    stub.queued = 0
    world.step(world.tick(1.2), 0.1)
    assert world.manager.status("m0").level == "dozing"


def test_a_dozing_model_whose_stub_dies_is_recovered_awake(world):
    loaded_preforked(world)
    world.step(world.tick(DOZE_AFTER + 1.5), 0.1)
    [dozed] = world.triton.models["m0"].stubs
    assert world.manager.status("m0").level == "dozing"
    world.step(world.crash("m0"), 0.6)  # recovery reloads it: new stubs, awake
    rec = world.manager.states.get("m0")
    assert rec is not None and rec.state is ModelState.READY and dozed not in world.triton.models["m0"].stubs
    assert rec.level == "awake" and not rec.doze.stubs
    world.step(world.request("m0"), 0.5)
    assert answers(world)[-1] == "200"


def evictions(world: LifecycleWorld, model: str) -> float:
    return sum(
        float(world.manager.metrics.evictions.labels(model=model, reason=r)._value.get())
        for r in ("memory", "oom", "gpu_memory", "gpu_oom")
    )


def test_under_memory_pressure_an_awake_model_that_can_doze_dozes_before_any_is_unloaded(tmp_path, monkeypatch):
    # doze_after_secs far off: only the pressure dozes; the budget (300 MiB) holds two awake models, not three
    world = LifecycleWorld(tmp_path, monkeypatch=monkeypatch, doze_after_secs=500)
    try:
        for model in ("m0", "m1", "m2"):
            world.triton.memory[model] = 120 * MIB
        world.step(world.publish("m0", None, worker=Worker.PREFORKED, idle_timeout_secs=1000), 0.1)
        world.step(world.publish("m1", None, idle_timeout_secs=1000), 0.1)
        world.step(world.publish("m2", None, idle_timeout_secs=1000), 0.1)
        world.step(world.request("m0"), 1.5)
        world.step(world.request("m1"), 1.5)
        world.step(world.request("m2"), 1.5)  # room for m2: m0 dozes (120 -> 20 MiB), nothing is unloaded
        statuses = {m: world.manager.status(m) for m in ("m0", "m1", "m2")}
        assert [s.level for s in statuses.values()] == ["dozing", "awake", "awake"], statuses
        assert evictions(world, "m0") == 0 and evictions(world, "m1") == 0
        assert statuses["m0"].memory_bytes == world.triton.dozing_bytes

        world.step(world.request("m0"), 1.5)  # the dozing model wakes on its request: over budget, m1 goes (LRU)
        world.step(world.tick(2.0), 0.1)
        assert answers(world) == ["200"] * 4
        assert world.manager.status("m0").level == "awake" and world.manager.status("m1").level == "unloaded"
        assert evictions(world, "m1") == 1
    finally:
        world.close()


def test_an_adaptive_model_dozes_after_the_time_it_learned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests every 20 s: once the adaptive keep-alive has seen enough idle times, the model stays awake across a
    20 s gap (about 22 s: a wake from doze costs more than that much memory at the doze price), not the server's 1 s,
    then dozes, then its learned keep-alive unloads it."""
    logging.getLogger("snoozeml").setLevel(logging.CRITICAL)
    world = LifecycleWorld(tmp_path, monkeypatch=monkeypatch, doze_after_secs=DOZE_AFTER, keep_alive_min_samples=3)
    try:
        world.triton.memory["m0"] = 120 * MIB
        adaptive = {"worker": Worker.PREFORKED, "idle_timeout_secs": 300, "keep_alive": "adaptive"}
        world.step(world.publish("m0", None, **adaptive), 0.1)
        for _ in range(5):  # four idle times of about 20 s (the sweep hears each request within a second)
            world.step(world.request("m0"), 0.5)
            world.step(world.tick(19.5), 0.0)
        world.step(world.request("m0"), 0.5)
        learned = world.manager.status("m0").keep_alive["doze_after_secs"]
        assert 20.0 <= learned <= 24.0, learned
        world.step(world.tick(learned - 5.0), 0.0)
        assert world.manager.status("m0").level == "awake"  # the server's DOZE_AFTER has long passed
        world.step(world.tick(7.0), 0.1)
        assert world.manager.status("m0").level == "dozing"
        world.close()
    finally:
        world.abandon()
        logging.getLogger("snoozeml").setLevel(logging.NOTSET)


def test_a_sweep_that_dozes_a_victim_too_small_to_fit_unloads_it_in_the_same_sweep(world):
    """Found by the dozing machine (seed 3118721135): after a restart m3 was adopted with its stubs dozing (an older
    publish, charged its dozing PSS), a burst woke them on the warm path (300 MiB), and the sweep's enforcement dozed
    m1 to make room (60 -> 20 MiB): still 20 MiB over the budget, until the next sweep. A plan carried out is
    measured again within the sweep, and the dozing victim is unloaded."""
    s, w = world.step, world
    s(w.publish("m0", 60, 1, "preforked"), 0.05)
    s(w.publish("m1", 60, 1, "preforked"), 0.05)
    s(w.publish("m3", 60, 1, "in-stub"), 0.01)
    s(w.hold("m3"), 0.0)
    s(w.publish("m3", 150, 2, "preforked"), 0.01)
    s(w.remote_publish("m2", 150), 0.05)
    s(w.stop_during_hung_load("m0", "stop"), 0.3)
    s(w.request("m0", 0.3), 0.01)
    s(w.pause(), 0.0)
    s(w.request("m1", None), 0.3)
    s(w.publish("m3", 150, 2, "preforked"), 0.0)
    s(w.restart(), 0.3)
    s(w.burst("m3", 8), 0.05)
    s(w.request("m3", None), 1.0)  # the world checks the tree against the budget at each step


def test_a_request_waiting_on_a_reload_that_a_stop_abandons_is_answered_not_cancelled(world):
    """Found by the dozing machine (seed 1154293239): another node republished m0 while it dozed; its reload waited
    for memory, with requests waiting on it, when a stop came. The stop abandons a loaded model's reload (a load is
    never waited for) by cancelling its task, and the waiting requests were cancelled with it: no answer at all. The
    reload is now cancelled with its reason, so that they are answered 503 (retry once the control plane is back)."""
    s, w = world.step, world
    s(w.publish("m2", 60, 2, "preforked"), 0.05)
    s(w.publish("m0", 60, 1, "preforked"), 0.3)
    s(w.request("m2", 2.0), 0.0)
    s(w.request("m0", None), 0.01)
    s(w.restart(), 0.0)
    s(w.release(), 1.0)
    s(w.remote_delete("m0"), 0.05)
    s(w.unload_hang("m0"), 0.05)
    s(w.pause(), 0.05)
    s(w.remote_publish("m0", 150), 1.0)
    s(w.publish("m2", 100, 1, "in-stub"), 1.0)
    s(w.burst("m0", 8), 0.05)
    s(w.resume(), 0.05)
    s(w.hold("m1"), 0.3)
    s(w.stop_during_hung_load("m0", "stop"), 0.3)
    answers = [c.answer for c in world.answered if c.what == "request" and c.model == "m0"]
    assert any(a is not None and a.startswith("503") and "stopping" in a for a in answers), answers


def test_a_stub_of_an_in_stub_version_asked_to_doze_during_its_reload_refuses_and_nothing_is_learned_as_growth(world):
    """Found by the dozing machine (seed 1272521834), a fault of the test world's: the sweep asked m0's stubs to doze
    while a reload of a version another node had published in-stub was measuring its new stub; the fake's stub
    dozed though its version has no worker (the runtime's in-stub stub has no doze socket and refuses), so the reload
    measured a dozing stub and the request after it was learned as 130 MiB of growth, counted twice after a crash's
    recovery. The fake's stubs now doze only where the version they run is preforked."""
    s, w = world.step, world
    s(w.publish("m0", 60, 1, "preforked"), 0.05)
    s(w.request("m0", None), 0.3)
    s(w.request("m1", None), 0.3)
    s(w.publish("m2", 60, 1, "preforked"), 0.05)
    s(w.request("m2", None), 0.3)
    s(w.publish("m3", 60, 1, "preforked"), 0.05)
    s(w.request("m3", None), 0.3)
    s(w.doze("m1"), 0.3)
    s(w.request("m0", None), 0.01)
    s(w.publish_ensemble_api(("m3",), 5), 0.05)
    s(w.request("m0", 2.0), 0.3)
    s(w.republish_while_waiting("m3", "hang", 1), 0.01)
    s(w.doze("m3"), 0.01)
    s(w.hold("m0"), 0.01)
    s(w.api_load("m2", 3), 0.01)
    s(w.stop_during_hung_load("m2", "delete"), 0.05)
    s(w.remote_publish("m2", 150), 0.0)
    s(w.tick(1.0), 0.3)
    s(w.request("m0", None), 1.0)
    s(w.publish("m0", 150, 1, "preforked"), 1.0)
    s(w.remote_delete("m0"), 1.0)
    s(w.remote_publish("m0", 150), 0.3)
    s(w.tick(1.0), 0.3)
    s(w.tick(3.0), 0.05)
    s(w.request("m0", None), 0.3)
    s(w.stop_during_hung_load("m1", "stop"), 1.0)
    s(w.crash("m0"), 0.0)
    s(w.publish_ensemble_api(("m1",), 1), 0.3)
    s(w.tick(1.0), 0.0)
    rec = world.manager.states.get("m0")
    assert rec is not None and rec.memory.growth < 100 * 2**20, rec.memory.growth  # no wake learned as growth


def test_an_ensembles_wake_admits_its_dozing_steps_wakes_before_its_request_wakes_them_together(world):
    """An ensemble's request runs every step inside Triton: steps that doze wake there together, where the budget
    admits none of them (a warm-path wake is admitted by no one). The ensemble's own wake goes through the control
    plane, which admits each dozing step's wake first: an idle model is evicted (dozed, then unloaded) before the
    steps wake, and the tree stays within the budget (without it: 450 MiB of 300)."""
    s, w = world.step, world
    dozing_beside_an_idle_one(world, ("m1", "m3"), "m2", "preforked")  # 150 MiB beside the steps' 2 x 20
    s(w.publish_ensemble_api(("m1", "m3"), IDLE_TIMEOUT), 0.05)
    world.triton.peak = 0
    s(w.request("e0", None), 1.0)
    assert answers(world)[-1] == "200"
    assert [world.manager.status(m).level for m in ("m1", "m3")] == ["awake", "awake"]
    assert world.manager.status("m2").state is ModelState.UNLOADED
    assert world.triton.peak <= BUDGET_MB * MIB, world.triton.peak / MIB


def test_an_ensemble_request_that_woke_two_dozing_steps_at_once_stays_within_the_budget_plus_one_model(world):
    """Found by the dozing machine (seed 1139189736): m1 and m3 (150 MiB awake) dozed, m2 and m0 awake, then a
    request for the ensemble over m1 and m3 loaded it over its dozing steps and its request woke both inside Triton,
    unadmitted: 510 MiB held against a budget of 300 plus one model of 150."""
    s, w = world.step, world
    s(w.publish("m0", 60, 1, "preforked"), 0.05)
    s(w.publish("m1", 60, 1, "preforked"), 0.05)
    s(w.publish_ensemble_api(("m1", "m3"), 1), 0.0)
    s(w.publish("m2", 60, 1, "preforked"), 0.0)
    s(w.hold("m2"), 0.0)
    s(w.publish("m3", 150, 1, "preforked"), 0.05)
    s(w.restart(), 0.3)
    s(w.publish("m1", 150, 1, "preforked"), 0.01)
    s(w.tick(7.0), 0.0)
    s(w.publish("m2", 150, 1, "preforked"), 0.05)
    s(w.request("m3", 0.3), 0.01)
    s(w.request("m1", None), 0.3)
    s(w.republish_while_waiting("m0", "hang", 3), 0.05)
    s(w.request("m2", None), 0.05)
    s(w.request("e0", None), 1.0)  # the world checks the tree's peak at each step


def test_a_load_after_a_warm_path_wake_is_admitted_against_what_the_woken_model_holds(world):
    """A request straight to Triton woke a dozing model (two stubs, 300 MiB awake, charged 40 dozing); a load that
    came before the next sweep was admitted against the 40 and went ahead beside the 300. Admission now reads the
    dozing models' wakes first: the woken model is dozed again to make room, and the tree stays within the budget."""
    s, w = world.step, world
    s(w.publish("m0", 150, 2, "preforked"), 0.05)
    s(w.publish("m1", 150, 1, "in-stub"), 0.05)
    s(w.request("m0", None), 0.3)
    s(w.tick(DOZE_AFTER + 1.5), 0.0)
    assert world.manager.status("m0").level == "dozing"
    s(w.burst("m0", 2), 0.0)  # the warm path: the control plane hears of it at its next sweep, or from admission
    s(w.request("m1", None), 0.3)
    assert world.manager.status("m1").state is ModelState.READY
    assert world.triton.peak <= BUDGET_MB * MIB, world.triton.peak / MIB


def test_a_load_admitted_before_a_sweep_heard_a_warm_path_wake_stays_within_the_budget_plus_one_model(world):
    """Found by the dozing machine (seed 2526912484): m2 (two stubs, 150 MiB each awake) dozed and was adopted dozing
    by a restart; a burst woke both its stubs on the warm path, and a load of m1 (150) was admitted against m2's
    dozing 40 MiB before a sweep heard the wake: 630 MiB against the budget plus one model (300 + 300)."""
    s, w = world.step, world
    s(w.publish("m3", 60, 1, "preforked"), 0.05)
    s(w.publish("m0", 60, 2, "preforked"), 0.0)
    s(w.publish("m2", 150, 2, "preforked"), 0.05)
    s(w.request("m2", 2.0), 0.05)
    s(w.hold("m0"), 0.05)
    s(w.restart(), 1.0)
    s(w.publish("m1", 150, 1, "in-stub"), 0.05)
    s(w.burst("m3", 5), 0.0)
    s(w.request("m0", 2.0), 0.3)
    s(w.burst("m2", 3), 0.0)
    s(w.hold("m1"), 0.01)
    s(w.request("m0", None), 0.3)  # the world checks the tree's peak at each step


def test_a_wake_heard_by_admission_is_charged_in_the_same_step_the_record_hears_it(world):
    """Found by the dozing machine (seed 748220775) once admission heard wakes too: a request woke one of m0's two
    dozing stubs on the warm path, and an ensemble's load over m0 heard it. The record listed the stub awake while it
    still charged m0 its doze (40 MiB, its stubs holding 80) until the measurement that came after an await."""
    s, w = world.step, world
    s(w.publish("m0", 60, 2, "preforked"), 0.01)
    s(w.publish_ensemble_api(("m0",), 1), 0.0)
    s(w.remote_delete("m1"), 0.3)
    s(w.stop_during_hung_load("m2", "publish"), 0.3)
    s(w.request("m0", 0.3), 0.05)
    s(w.remote_publish("m2", 60), 0.3)
    s(w.doze("m2"), 1.0)
    s(w.doze("m1"), 0.05)
    s(w.request("m0", 2.0), 0.3)
    s(w.request("e0", 0.3), 0.0)  # the world checks each model's charge against its stubs at each step


def test_wakes_from_doze_while_paused_are_enforced_once_the_lifecycle_resumes(world):
    """Found by the dozing machine (seed 3954049102): during a pause, requests straight to Triton woke m1 and m0 from
    doze, 530 MiB against a budget of 300 (no sweep runs while paused, and none admits a warm-path wake; the product
    pauses only with its gateway gated and drained). Once the lifecycle resumes, its next sweep hears the wakes and
    evicts back within the budget."""
    s, w = world.step, world
    s(w.publish("m2", 60, 1, "preforked"), 0.05)
    s(w.publish("m1", 60, 1, "preforked"), 0.0)
    s(w.burst("m2", 8), 0.3)
    s(w.publish("m0", 100, 2, "preforked"), 0.3)
    s(w.api_load("m1", 2), 0.01)
    s(w.publish("m3", 150, 1, "in-stub"), 0.05)
    s(w.request("m0", 0.3), 0.01)
    s(w.burst("m3", 9), 0.05)
    s(w.pause(), 0.01)
    s(w.republish_while_waiting("m1", "hang", 2), 1.0)
    s(w.burst("m0", 9), 1.0)
    assert world.triton.peak > BUDGET_MB * MIB  # woken while paused: nothing enforced
    s(w.resume(), 0.0)
    s(w.tick(3.0), 1.0)

    def used() -> int:
        return world.triton.server_bytes() + sum(world.triton.holding().values())

    assert used() <= BUDGET_MB * MIB, used() / MIB


def test_an_unload_hung_across_a_restart_is_counted_while_a_load_of_the_model_published_again_runs(world):
    """Found by the dozing machine (seed 1330313060): m2's unload hung in Triton across a restart; m2 was published
    again and its load, running when the index was read, kept that read from marking the old instances as held. The
    load was refused for memory, the record said FAILED, and what Triton still unloaded was counted nowhere until the
    next read of the index. The budget now counts it as a model without a record (``budget.unrecorded``)."""
    s, w = world.step, world
    s(w.publish("m0", 60, 1, "preforked"), 0.05)
    s(w.publish("m2", 60, 1, "preforked"), 0.05)
    s(w.publish_ensemble_api(("m2",), 5), 0.0)
    s(w.pause(), 0.3)
    s(w.restart(), 0.3)
    s(w.unload_hang("m2"), 1.0)
    s(w.burst("e0", 7), 0.01)
    s(w.remote_delete("m2"), 0.01)
    s(w.restart(), 0.0)
    s(w.hold("m0"), 0.0)
    s(w.pause(), 0.05)
    s(w.tick(7.0), 0.01)
    s(w.publish("m0", 100, 1, "preforked"), 0.05)
    s(w.remote_publish("m3", 100), 0.0)
    s(w.remote_publish("m2", 150), 0.0)
    s(w.api_override("m2", 4), 0.01)
    s(w.script_load("m0", "hang", 0.05), 0.05)
    s(w.hold("m3"), 0.3)  # the world checks, at the end too, that what Triton holds is counted


def test_requests_straight_to_several_dozing_models_at_once_wake_them_within_the_budget(world):
    """Two dozing models (150 MiB each awake, 20 dozing) beside an idle one of 150, a budget of 300: requests straight
    to both dozing models in the same instant woke both on the warm path, unadmitted, 450 MiB until the next sweep
    (dozing machine seed 2526912484: three such wakes, 630 MiB against 300 plus one model of 300). Each stub now asks
    room before it forks: the idle model goes first, one wake at a time, and the tree never holds more than the
    budget."""
    s, w = world.step, world
    dozing_beside_an_idle_one(world, ("m0", "m1"), "m2", "in-stub")
    assert world.manager.status("m2").state is ModelState.READY
    world.triton.peak = 0  # from here on
    s(w.request("m0", None), 0.0)  # both in the same instant, before any sweep
    s(w.request("m1", None), 0.3)
    assert answers(world)[-2:] == ["200", "200"]
    assert [s.wakes for m in ("m0", "m1") for s in world.triton.models[m].stubs] == [1, 1]
    assert world.manager.status("m2").state is ModelState.UNLOADED  # evicted for the wakes, before they forked
    assert world.triton.peak <= BUDGET_MB * MIB, world.triton.peak / MIB
    rooms = world.manager.metrics.doze_wake_rooms
    assert [rooms.labels(model=m, outcome="room")._value.get() for m in ("m0", "m1")] == [1, 1]


def test_an_asked_wake_counts_the_model_awake_until_heard_or_its_bound_passes(world):
    """A stub's ask for room counts its model at what it held awake (``MemoryBudget.held``) from the ask on: once
    the wake is heard it is measured; an ask whose wake never came (its load failed, the stub dozes on) is forgotten
    after the ask's and the load's bounds, and the model is charged its doze again."""
    world.triton.memory["m0"] = 120 * MIB
    world.step(world.publish("m0", None, worker=Worker.PREFORKED, idle_timeout_secs=600), 0.1)
    world.step(world.request("m0"), 0.5)
    world.step(world.tick(DOZE_AFTER + 1.5), 0.1)
    rec = world.manager.states.records["m0"]
    [stub] = world.triton.models["m0"].stubs
    dozing = world.manager.budget.held(rec)
    assert rec.doze.dozing and dozing == world.triton.dozing_bytes

    answer = world.run(world.manager.admit_doze_wake("m0", (stub.pid, stub.start_ticks), timeout=1.0))
    assert answer == {"admitted": True, "why": None}
    assert world.manager.budget.held(rec) == rec.doze.awake_footprint >= 120 * MIB  # counted awake from the ask
    world.step(world.tick(3.0), 0.1)  # sweeps: no wake heard, the ask still within its bound
    assert world.manager.budget.held(rec) == rec.doze.awake_footprint
    bound = world.settings.wake_queue_timeout_secs + rec.model.load_timeout_secs + LOAD_ABANDON_SECS
    world.step(world.tick(bound), 1.5)
    assert rec.doze.dozing and not rec.doze.asked and world.manager.budget.held(rec) == dozing

    world.run(world.manager.admit_doze_wake("m0", (stub.pid, stub.start_ticks), timeout=1.0))
    world.step(world.request("m0"), 0.1)  # its wake comes, and the sweep hears it: measured, the ask dropped
    world.step(world.tick(1.0), 0.1)
    assert wakes(world, "m0", "doze") == 1 and not rec.doze.asked  # (it may doze again since: idle a second)


def test_an_asked_wake_whose_record_stops_dozing_while_it_waits_still_gets_room_or_says_it_went_over(world):
    """Found by the dozing machine (seed 3601441757): an ensemble's request woke its dozing step m1 (two stubs, 300
    MiB awake) beside m2 (100), both held by the ensemble, in a budget of 300. m1's stub asked room and waited for
    memory; a failed rescale reset m1's doze record meanwhile (counted awake), and the wait answered that room was
    made: the tree then held 400 MiB of 300 with the answer saying it fit. The wait now makes room for what the
    record holds awake, and says the wake went over the budget when none can be made."""
    s, w = world.step, world
    s(w.publish_ensemble_api(("m2", "m1"), 5), 0.0)
    s(w.publish("m1", 150, 2, "preforked"), 0.3)
    s(w.remote_publish("m2", 150), 0.3)
    s(w.request("e0", None), 0.3)
    s(w.restart(), 1.0)
    s(w.remote_publish("m2", 100), 0.3)
    s(w.request("m1", 2.0), 0.3)
    s(w.burst("e0", 10), 0.01)
    s(w.tick(1.0), 0.0)
    s(w.doze("m1"), 0.01)
    s(w.tick(3.0), 0.05)  # the world checks the budget at every step, and each ask's answer against it
    rooms = world.manager.metrics.doze_wake_rooms
    s(w.tick(10.0), 0.05)
    assert rooms.labels(model="m1", outcome="over_budget")._value.get() >= 1


def test_an_ask_from_a_stub_whose_record_no_longer_knows_it_dozes_still_gets_room(world):
    """Found by the dozing machine (seed 3108582327): m3's two stubs dozed (150 MiB each awake); a failed rescale
    reset its doze record, which counts it awake (300) beside m2 (60, held by a stream) in a budget of 300. A burst
    straight to m3 woke both stubs: they asked room, and the answer was that nothing was asked of a record that does
    not doze. The ask now makes room for what the record counts, or waits and says the wake went over."""
    s, w = world.step, world
    s(w.publish("m2", 60, 1, "preforked"), 0.05)
    s(w.publish("m3", 150, 2, "preforked"), 0.3)
    s(w.request("m1", None), 1.0)
    s(w.api_override("m2", None), 1.0)
    s(w.request("m3", 0.3), 0.0)
    s(w.request("e0", 0.3), 0.3)
    s(w.doze("m0"), 0.3)
    s(w.hold("m2"), 0.05)
    s(w.api_load("m3", 3), 0.0)
    s(w.burst("m3", 3), 0.0)
    s(w.tick(0.1), 0.05)  # the world checks the budget at every step, and each ask's answer against it
    assert world.manager.metrics.doze_wake_rooms.labels(model="m3", outcome="unasked")._value.get() == 0


def test_an_ask_from_a_stub_of_a_model_adopted_dozing_counts_it_at_its_awake_size(world):
    """Found by the dozing machine (seed 4214762718): a restarted control plane adopted m0 with both its stubs dozing
    (measured at 40 MiB; its stubs not yet asked whether they doze). Requests straight to Triton woke both stubs to
    300: they asked room, and the record, counting 40, answered that it fit beside m2 and m3: 380 MiB of 300. The
    ask now tells the record that its stub dozes, and room is made for what the model is estimated to hold awake."""
    s, w = world.step, world
    s(w.publish("m2", 100, 1, "preforked"), 0.01)
    s(w.publish("m0", 150, 2, "preforked"), 0.01)
    s(w.publish("m3", 60, 1, "preforked"), 0.01)
    s(w.request("m0", 2.0), 1.0)
    s(w.stop_during_hung_load("m2", "publish"), 0.0)
    s(w.stop_during_hung_load("m3", "stop"), 0.0)
    s(w.publish_ensemble_api(("m3", "m2"), 1), 0.0)
    s(w.republish_while_waiting("m0", "hang", 2), 0.0)
    s(w.request("e0", None), 1.0)  # the world checks the budget at every step, and each ask's answer against it
