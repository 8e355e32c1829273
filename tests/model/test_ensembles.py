"""Ensembles and their steps as one group (controlplane/lifecycle/groups.py), over the fake Triton: a request to a
sleeping ensemble wakes it and every step once; its steps stay loaded while it is, whatever their own timers; a
step shared by two ensembles is loaded and charged once; eviction takes an ensemble with the steps only it holds;
status says who uses whom. The real Triton's ensembles: tests/integration (the Triton model folders' tests)."""

from __future__ import annotations

from controlplane.lifecycle.state import ModelState


def _requests(world, model: str) -> list[str | None]:
    return [c.answer for c in world.answered if c.what == "request" and c.model == model]


def test_a_request_to_a_sleeping_ensemble_wakes_it_and_each_step_once(world):
    world.step(world.publish("m0", 60), 0.1)
    world.step(world.publish("m1", 60), 0.1)
    world.publish_ensemble("e0", ["m0", "m1"])
    world.step(world.burst("e0", 4), 1.0)
    assert _requests(world, "e0") == ["200"] * 4
    assert world.triton.calls["load"] == 3  # m0, m1, then e0: each once, though four requests woke it
    records = world.manager.states.records
    assert {m: records[m].state for m in ("m0", "m1", "e0")} == dict.fromkeys(("m0", "m1", "e0"), ModelState.READY)
    assert world.manager.status("m0").ensembles == ["e0"] and world.manager.status("e0").steps == ["m0", "m1"]
    assert world.manager.status("e0").memory_bytes in (None, 0)  # an ensemble holds no process of its own


def test_steps_stay_loaded_while_their_ensemble_is_and_sleep_after_it(world):
    world.step(world.publish("m0", 60, idle_timeout_secs=1), 0.1)
    world.step(world.publish("m1", 60, idle_timeout_secs=1), 0.1)
    world.publish_ensemble("e0", ["m0", "m1"], idle_timeout_secs=6)
    world.step(world.request("e0"), 0.5)
    for _ in range(8):  # 4 s: past the steps' own 1 s timeout, within the ensemble's 6 s
        world.step(world.tick(0.5), 0.0)
    records = world.manager.states.records
    assert {m: records[m].state for m in ("m0", "m1", "e0")} == dict.fromkeys(("m0", "m1", "e0"), ModelState.READY)
    for _ in range(20):  # the ensemble's timeout passes: it sleeps, then its steps after their own
        world.step(world.tick(0.5), 0.0)
    assert {m: records[m].state for m in ("m0", "m1", "e0")} == dict.fromkeys(("m0", "m1", "e0"), ModelState.UNLOADED)
    assert records["m0"].in_use == records["m1"].in_use == 0  # the pins went with the ensemble


def test_a_step_woken_first_is_held_while_a_slower_step_loads(world):
    # m0 loads at once, m1 takes 3 s (past m0's own 1 s idle timeout) before the ensemble's load can start: m0
    # must not be idle-unloaded meanwhile (Triton would then load it itself for the ensemble, behind the lifecycle).
    world.step(world.publish("m0", 60, idle_timeout_secs=1), 0.1)
    world.step(world.publish("m1", 60, idle_timeout_secs=1), 0.1)
    world.publish_ensemble("e0", ["m0", "m1"], idle_timeout_secs=6)
    world.step(world.script_load("m1", "ok", delay=3.0), 0.0)
    world.step(world.request("e0"), 0.1)
    for _ in range(10):
        world.step(world.tick(0.5), 0.0)
    assert _requests(world, "e0") == ["200"]
    records = world.manager.states.records
    assert {m: records[m].state for m in ("m0", "m1", "e0")} == dict.fromkeys(("m0", "m1", "e0"), ModelState.READY)
    assert world.manager.status("m0").load_count == 1 and world.triton.calls["load"] == 3  # nothing loaded twice
    assert world.triton.calls["unload"] == 0


def test_a_step_shared_by_two_ensembles_and_a_direct_caller_is_loaded_and_charged_once(world):
    world.step(world.publish("m0", 60), 0.1)  # shared
    world.step(world.publish("m1", 60), 0.1)
    world.step(world.publish("m2", 60), 0.1)
    world.publish_ensemble("e0", ["m0", "m1"])
    world.publish_ensemble("e1", ["m0", "m2"])
    world.step(world.request("e0"), 0.01)
    world.step(world.request("e1"), 0.01)
    world.step(world.request("m0"), 1.0)
    assert _requests(world, "e0") == _requests(world, "e1") == _requests(world, "m0") == ["200"]
    assert world.triton.calls["load"] == 5  # m0 once, m1, m2, e0, e1
    assert world.manager.status("m0").ensembles == ["e0", "e1"]
    budget = world.manager.budget
    assert budget.used(exclude=None) == sum(budget.held(r) for r in world.manager.states.values())  # each once
    assert world.triton.holding() == {"m0": 60 << 20, "m1": 60 << 20, "m2": 60 << 20, "e0": 0, "e1": 0}


def test_eviction_takes_an_ensemble_with_the_steps_only_it_holds(world):
    """Budget 300 MiB: an ensemble of two 100 MiB steps and a shared 60 MiB one. A 150 MiB model then needs room:
    the ensemble goes as a group (its exclusive steps with it), not step by step under it (they are pinned)."""
    world.step(world.publish("a", 100), 0.1)
    world.step(world.publish("b", 100), 0.1)
    world.publish_ensemble("e0", ["a", "b"])
    world.step(world.request("e0"), 3.0)
    world.step(world.publish("big", 150), 0.1)
    world.step(world.request("big"), 3.0)
    records = world.manager.states.records
    assert _requests(world, "big") == ["200"]
    assert records["e0"].state is ModelState.UNLOADED and records["e0"].reason == "memory"
    assert records["a"].state is ModelState.UNLOADED and records["b"].state is ModelState.UNLOADED
    world.step(world.request("e0"), 3.0)  # and it wakes again, its steps with it, once there is room
    assert _requests(world, "e0") == ["200", "200"]
