"""A load in flight never holds an unload, a delete, a republish or a stop (``controlplane/lifecycle/cancel.py``).

The fake Triton's ``hang`` load keeps the model LOADING until its stubs are killed (a ``load()`` that never
returns, at the default load timeout of 300 s): each action must end it within a few virtual seconds, end the
model's processes, leave it holding no memory reservation, and tell the requests waiting on it why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from controlplane.errors import NotFoundError, UnavailableError
from controlplane.lifecycle.state import ModelState

ANSWER_SECS = 5.0  # the bound for an unload's answer and for the model's processes to be gone


@pytest.mark.timeout(60)
@pytest.mark.parametrize("action", ["unload", "delete", "republish", "stop"])
def test_an_action_during_a_hung_load_cancels_it_and_leaves_the_neighbour_alone(world, action):
    manifest = world.package / "snooze_model.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "load_timeout_secs": 300}))  # the default
    world.step(world.publish("m0", 60), 0.1)
    world.step(world.publish("m1", 60), 0.1)
    manager = world.manager
    world.run(manager.ensure_ready("m1"))  # the neighbour, loaded
    world.step(world.script_load("m0", "hang"), 0)

    async def scenario() -> tuple[BaseException | None, float]:
        wake = asyncio.create_task(manager.ensure_ready("m0"))  # waits on the load (its bound: 305 s)
        await asyncio.sleep(2.0)  # Triton is in the model's load(), which never returns
        rec = manager.states.get("m0")
        assert rec is not None and rec.state is ModelState.LOADING and world.processes.stubs("m0")
        started = world.now
        if action == "unload":
            await manager.unload("m0")
        elif action == "delete":  # as the API does it: forget, then the store
            await manager.forget("m0")
            world.store.delete("m0")
            world.deleted["m0"] = world.now
        elif action == "republish":
            world.store.publish(world._spec("m0", 60))
            world.changed["m0"] = world.now
            await manager.published("m0")
        else:
            await manager.stop()
        answered = world.now - started
        try:
            await asyncio.wait_for(wake, ANSWER_SECS)
        except (UnavailableError, NotFoundError) as e:
            return e, answered
        return None, answered

    error, answered = world.run(scenario(), limit=120)
    assert answered < ANSWER_SECS, f"{action} answered after {answered:.1f} virtual seconds"
    if action == "republish":  # still published: the waiting request is served by the new version, not refused
        assert error is None, f"a republish failed the request that waited on the load it cancelled: {error}"
        assert_serves_the_published_files(world, "m0")
        assert manager.states.get("m0").state is ModelState.READY
        assert manager.states.get("m1").state is ModelState.READY
        return
    assert error is not None, "the waiting request was served by a cancelled load"
    if action == "delete":
        assert isinstance(error, NotFoundError) and "deleted" in str(error)
    else:
        assert isinstance(error, UnavailableError) and error.retry_after and "load was cancelled" in str(error)
    assert world.processes.stubs("m0") == [] and "m0" not in world.triton.holding()  # no process left
    rec = manager.states.get("m0")
    if rec is not None:
        assert (
            rec.state is ModelState.UNLOADED
            and rec.op is None
            and rec.memory.reserved == 0
            and not rec.memory.gpu_reserved
        )
    if action != "stop":
        neighbour = manager.states.get("m1")
        assert neighbour is not None and neighbour.state is ModelState.READY
        world.run(manager.ensure_ready("m1"))
        world.step(world.script_load("m0", "ok"), 0)
        if action != "delete":  # the next request loads it again
            world.run(manager.ensure_ready("m0"))
            assert manager.states.get("m0").state is ModelState.READY
    else:
        world.run(manager.start())  # the world's close() stops it again


@pytest.mark.timeout(60)
@pytest.mark.parametrize("action", ["republish", "unload"])
def test_a_load_that_ends_while_the_cancel_waits_for_its_starting_stub_is_not_left_in_triton(world, action):
    """A stub still starting is not ended (cancel.py: ending it would wedge Triton 2.51), so the cancel waits for it,
    and the load may end meanwhile with the model READY in Triton. Its task then did not fail: the model must
    still leave Triton. Left there, the gateway's warm path (Envoy straight to Triton) served the old version
    after a republish had returned (bench churn: 7 answers of the old version), and the record said UNLOADED
    with no memory charged while its processes ran. After a republish, the request that waited is served by the
    new version, loaded once the old one has left."""
    world.step(world.publish("m0", 60), 0.1)
    manager = world.manager
    # its stub writes no phase note until initialize ends, 1 s in: the cancel does not end it, it waits
    world.triton.script_load("m0", "ok", 1.0, phase_note=False)

    async def scenario() -> None:
        wake = asyncio.create_task(manager.ensure_ready("m0"))
        await asyncio.sleep(0.3)
        rec = manager.states.get("m0")
        assert rec is not None and rec.state is ModelState.LOADING
        if action == "republish":
            world.store.publish(world._spec("m0", 60))
            world.changed["m0"] = world.now
            await manager.published("m0")
        else:
            await manager.unload("m0")
        if action == "republish":  # the model is still published: the request waits for the new version
            await asyncio.wait_for(wake, ANSWER_SECS)
            return
        # sent before the unload: served by the load that ended, or told to retry; either way answered
        with contextlib.suppress(UnavailableError):
            await asyncio.wait_for(wake, ANSWER_SECS)

    world.run(scenario(), limit=60)
    if action == "republish":
        assert_serves_the_published_files(world, "m0")
        return
    rec = manager.states.get("m0")
    assert rec is not None and rec.state is ModelState.UNLOADED and rec.memory.reserved == 0
    assert "m0" not in world.triton.ready(), "the cancelled load's model is still serving in Triton"
    world.run(asyncio.sleep(1.0))  # Triton's unload ends its processes
    assert world.processes.stubs("m0") == [] and "m0" not in world.triton.holding()


def assert_serves_the_published_files(world, model: str) -> None:
    """Triton holds ``model`` READY, loaded from the folder published now (a republish replaces it)."""
    folder = world.triton.repository / model
    loaded = world.triton.models[model]
    assert loaded.state == "READY"
    assert loaded.files == (folder.stat().st_ino, (folder / "config.pbtxt").stat().st_mtime_ns)
