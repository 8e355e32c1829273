"""The sweep freezes the heap once many records were made (``controlplane/heap.py``): counted by ``ModelStates``,
over the fake Triton in virtual time."""

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
