"""The sweep reads Triton's repository index paced by what a read costs (``TritonSync.index_due``): Triton reads its
repository folder for each read, so with thousands of models a read every second would keep it busy (10,000: 44 ms of
its CPU a read). Few models: every sweep, as before."""

from __future__ import annotations

from controlplane.lifecycle.triton_sync import INDEX_SPACING
from harness.lifecycle_world import LifecycleWorld


def reads_over(world: LifecycleWorld, secs: float) -> int:
    before = world.triton.calls["index"]
    world.step(world.tick(secs), 0.0)
    return world.triton.calls["index"] - before


def test_a_quick_index_is_read_every_sweep(world: LifecycleWorld) -> None:
    world.step(world.publish("m0", 60, 1), 0.05)
    assert reads_over(world, 10.0) >= 9  # a sweep a second (sweep_interval_secs=1)


def test_a_slow_index_is_read_only_once_its_spacing_passed_and_a_delete_still_leaves(world: LifecycleWorld) -> None:
    world.step(world.publish("m0", 60, 1), 0.05)
    world.step(world.request("m0", 0.3), 1.0)
    world.triton.index_delay = 0.1  # a read takes 0.1 s: the next one is due 5 s after it ends
    world.step(world.tick(2.0), 0.0)  # the first slow read
    reads = reads_over(world, 20.0)
    spacing = INDEX_SPACING * world.triton.index_delay
    assert 20.0 / (spacing + 2.0) <= reads <= 20.0 / spacing + 1, reads  # one per spacing (plus up to a sweep)
    world.step(world.remote_delete("m0"), 0.0)  # what another node did is found at the reads that follow
    world.step(world.tick(3 * spacing + 2.0), 0.0)
    assert world.manager.states.get("m0") is None and "m0" not in world.triton.holding()
