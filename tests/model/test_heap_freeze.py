"""What keeps thousands of sleeping models cheap to hold and to list: the sweep freezes the heap once many records were
made (``controlplane/heap.py``, counted by ``ModelStates``), and a model never requested shows a fresh policy's
windows without one built for it. Over the fake Triton in virtual time."""

from __future__ import annotations

import gc

import pytest

from controlplane import heap
from controlplane.lifecycle import supervisor


def test_freeze_long_lived_moves_what_lives_out_of_the_collectors_walks() -> None:
    before = gc.get_freeze_count()
    try:
        heap.freeze_long_lived()
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()  # this test process's objects go back to the collector


def test_the_sweep_freezes_once_enough_records_were_made(world, monkeypatch: pytest.MonkeyPatch) -> None:
    frozen: list[int] = []
    monkeypatch.setattr(supervisor, "FREEZE_AFTER_RECORDS", 3)
    monkeypatch.setattr(supervisor, "freeze_long_lived", lambda: frozen.append(len(world.manager.states.records)))
    world.step(world.publish("m0", 60), 0.1)
    world.step(world.request("m0"), 1.5)  # one record, a sweep or more: below the mark
    assert frozen == [] and world.manager.states.made == 1
    for model in ("m1", "m2"):
        world.step(world.publish(model, 60), 0.1)
        world.step(world.request(model), 0.5)
    world.step(world.tick(1.5), 0.1)  # the next sweep
    assert frozen == [3] and world.manager.states.made == 0


@pytest.mark.parametrize("keep_alive", ["fixed", "adaptive"])
def test_a_model_never_requested_shows_a_fresh_policys_windows_without_building_one(world, keep_alive) -> None:
    """A listing of thousands of sleeping models reads the windows of a fresh policy of each kind once; the windows
    shown are those the model's own policy has once built (its first request builds it)."""
    world.step(world.publish("m0", 60, keep_alive=keep_alive), 0.1)
    rec = world.manager.states.record("m0")
    shown = world.manager.status("m0").keep_alive
    assert rec.access.keep_alive is None  # the status built none
    assert shown == world.manager.warmth.policy(rec).windows() and shown["policy"] == keep_alive
    world.step(world.request("m0"), 1.0)
    assert rec.access.keep_alive is not None and world.manager.status("m0").keep_alive["policy"] == keep_alive
