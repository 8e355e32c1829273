"""Open work keeps a model in use, over the real LifecycleManager in the fake-Triton world: a live sequence
(its model process's note, ``python_backend/sequences.py``) holds its model against idle unload, eviction
and scale-down, within its bound, and a stop waits for it (bounded); the gateway's ready flags follow the
lifecycle's states."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from controlplane.gateway.activator import ReadyFlags
from controlplane.lifecycle.sequences import describe_live
from controlplane.lifecycle.state import ModelState
from controlplane.settings import Settings
from controlplane.spec import SequenceSpec
from controlplane.stack import ServingStack
from controlplane.triton.journal import SEQUENCES_SUFFIX
from harness.lifecycle_world import LifecycleWorld

SEQUENCE = SequenceSpec(max_sequence_idle_secs=5)


def note_sequences(world: LifecycleWorld, model: str, live: int, for_secs: float) -> None:
    """What the model's processes write (python_backend/sequences.py): ``live`` sequences, live ``for_secs`` more."""
    until = world.clock.time() + for_secs if live else 0.0
    for stub in world.processes.stubs(model):
        note = world.journal / f"{stub.pid}-{stub.start_ticks}{SEQUENCES_SUFFIX}"
        note.write_text(json.dumps({"model": model, "live": live, "until": until}))


def state(world: LifecycleWorld, model: str) -> ModelState:
    return world.manager.states.records[model].state


def test_a_live_sequence_is_not_evicted_another_model_is(world):
    world.step(world.publish("m0", 150, sequence=SEQUENCE), 0.1)
    world.step(world.publish("m1", 100), 0.1)
    world.step(world.publish("m2", 100), 0.1)
    world.step(world.request("m0"), 1.0)
    note_sequences(world, "m0", 1, 60.0)  # a sequence started; its next request has not come yet
    world.step(world.tick(1.5), 0)  # a sweep sees it
    world.step(world.request("m1"), 1.0)  # m0 is now the least recently used
    world.step(world.request("m2"), 2.0)  # 350 MiB > 300: one must go
    assert state(world, "m0") is ModelState.READY, "the live sequence's model was evicted"
    assert "m1" not in world.triton.holding() and "m2" in world.triton.holding()
    note_sequences(world, "m0", 0, 0)  # its END
    world.step(world.tick(1.5), 0)
    assert world.manager.states.records["m0"].in_use == 0
    world.step(world.request("m1"), 2.0)  # now m0 is the one to go
    assert "m0" not in world.triton.holding() and "m1" in world.triton.holding()


def test_a_live_sequence_outlasts_its_idle_timeout_and_ends_within_its_bound(world):
    world.step(world.publish("m0", 60, sequence=SEQUENCE), 0.1)  # idle_timeout_secs 5
    world.step(world.request("m0"), 1.0)
    note_sequences(world, "m0", 1, 20.0)  # e.g. a client that paused, well inside Triton's limit as noted
    world.step(world.tick(15.0), 0)  # three idle timeouts
    assert state(world, "m0") is ModelState.READY, "an idle unload cut a live sequence"
    world.step(world.tick(12.0), 0)  # the note's bound passed (an abandoned sequence): the model may sleep
    assert "m0" not in world.triton.holding()
    assert world.manager.states.records["m0"].in_use == 0


def test_a_live_sequence_stops_a_scale_down(world):
    world.settings.autoscale = True
    world.step(world.publish("m0", 60, sequence=SequenceSpec(max_sequence_idle_secs=30), idle_timeout_secs=60), 0.1)
    world.step(world.api_load("m0", 2), 2.0)
    note_sequences(world, "m0", 1, 120.0)
    world.step(world.tick(40.0), 0)  # no queue for longer than idle_timeout / 2: one instance would go
    assert world.manager.states.records["m0"].instances == 2, "a scale-down could end the live sequence"
    note_sequences(world, "m0", 0, 0)
    world.step(world.request("m0"), 0)  # its END; the model is not idle
    world.step(world.tick(35.0), 0)
    assert world.manager.states.records["m0"].instances == 1


def test_ready_flags_follow_the_lifecycle_and_a_late_hold_keeps_the_model(world, tmp_path: Path):
    """The wake filter lets a stream on when its model's flag is there and sends the hold without waiting:
    the flag goes the moment an unload starts, and a hold that arrives while the unload checks keeps the model."""
    world.step(world.publish("m0", 60), 0.1)
    world.step(world.request("m0"), 1.0)
    flags = ReadyFlags(tmp_path / "ready")
    flags.open()
    seen: list[tuple[ModelState | None, bool]] = []
    holds: list[asyncio.Task[None]] = []
    release = asyncio.Event()

    async def hold() -> None:
        async with world.manager.serving("m0"):
            await release.wait()

    def on_state(model: str, new: ModelState | None) -> None:
        seen.append((new, flags.ready(model)))  # before the flag's own update: what it was
        if new is ModelState.UNLOADING and not holds:
            holds.append(asyncio.ensure_future(hold()))  # a stream's hold, sent before the flag went

    world.manager.add_state_listener(flags.update)
    assert flags.ready("m0")  # caught up at once
    world.manager.states.listeners.insert(0, on_state)
    world.step(world.tick(7.0), 0)  # past idle_timeout_secs: the sweeper starts the idle unload
    assert (ModelState.UNLOADING, True) in seen and state(world, "m0") is ModelState.READY
    assert flags.ready("m0"), "the model stayed READY: its flag is back"
    release.set()
    world.step(world.tick(7.0), 0)  # the hold ended: now it sleeps, and its flag is gone
    assert state(world, "m0") is ModelState.UNLOADED and not flags.ready("m0")
    world.manager.remove_state_listener(flags.update)
    flags.close()


def test_a_stop_waits_for_live_sequences_until_their_end(world):
    """A graceful stop (and the snapshot quiesce) waits for a live sequence's END before it closes the gateway."""
    world.step(world.publish("m0", 60, sequence=SEQUENCE), 0.1)
    world.step(world.request("m0"), 1.0)
    note_sequences(world, "m0", 2, 60.0)

    async def wait_while_one_ends() -> tuple[dict[str, int], float]:
        async def end_after(secs: float) -> None:
            await asyncio.sleep(secs)
            note_sequences(world, "m0", 0, 0)  # the last END came

        ender = asyncio.ensure_future(end_after(3.0))
        start = world.clock.monotonic()
        left = await world.manager.wait_for_sequences(30.0)
        await ender
        return left, world.clock.monotonic() - start

    left, waited = world.run(wait_while_one_ends())
    assert left == {}
    assert 2.9 <= waited < 4.0, f"returned after {waited:.1f} virtual seconds, not at the sequences' END"


def test_a_stop_waits_for_live_sequences_up_to_its_bound_and_names_them(world):
    world.step(world.publish("m0", 60, sequence=SEQUENCE), 0.1)
    world.step(world.publish("m1", 60), 0.1)
    world.step(world.request("m0"), 1.0)
    world.step(world.request("m1"), 0.1)
    note_sequences(world, "m0", 2, 60.0)  # a client that went away mid-sequence: Triton ends them in 60 s
    start = world.clock.monotonic()
    left = world.run(world.manager.wait_for_sequences(10.0))
    assert left == {"m0": 2} and world.clock.monotonic() - start >= 10.0
    assert describe_live(left) == "2 live sequence(s) of model 'm0'"
    note_sequences(world, "m0", 1, 2.0)  # Triton's idle bound for the last one is 2 s away
    start = world.clock.monotonic()
    assert world.run(world.manager.wait_for_sequences(10.0)) == {}
    assert world.clock.monotonic() - start < 3.0
    world.step(world.api_unload("m0"), 1.0)
    note_sequences(world, "m0", 1, 60.0)  # a stale note of a model no longer loaded holds nothing
    assert world.run(world.manager.wait_for_sequences(10.0)) == {}


async def test_the_stack_stop_lets_live_sequences_end_before_the_gateway_drains(tmp_path, caplog):
    """Their next requests must still get in: the wait comes before the drain, both within one grace; what is
    still live is named in the stop's warning."""
    stack = ServingStack(Settings(work_dir=tmp_path, shutdown_grace_secs=5))
    done: list[str] = []

    class Lifecycle:
        async def wait_for_sequences(self, timeout: float) -> dict[str, int]:
            done.append(f"sequences {timeout:g}")
            return {"acc": 1}

        async def stop(self) -> None:
            done.append("lifecycle stop")

    class Gateway:
        def drain(self, grace: float) -> bool:
            done.append("drain")
            return True

        def stop(self) -> None:
            done.append("gateway stop")

    stack.lifecycle = Lifecycle()  # type: ignore[assignment]
    stack.gateway = Gateway()  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="snoozeml.stack"):
        await stack.stop()
    assert done == ["sequences 5", "drain", "gateway stop", "lifecycle stop"]
    assert "stopping ends 1 live sequence(s) of model 'acc'" in caplog.text
    assert "SNOOZE_SHUTDOWN_GRACE_SECS" in caplog.text
