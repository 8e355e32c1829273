"""Races of the lifecycle's periodic jobs and of the stack's shutdown, each checked where it happens."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from controlplane.errors import NotFoundError, SnoozeError
from controlplane.lifecycle.state import ModelRecord, ModelState, ProcessRecord
from controlplane.settings import Settings
from controlplane.stack import ServingStack


def test_a_crash_is_noticed_while_the_store_follower_reloads_another_model(world):
    """Race: the sweep, the crash watch and the store follower shared one lock, and the follower held it through a
    whole reload: a crash elsewhere waited for that reload to end."""
    world.step(world.publish("m0", 60), 0.1)
    world.step(world.publish("m1", 60), 0.1)
    world.step(world.request("m0"), 0.5)
    world.step(world.request("m1"), 0.5)
    world.step(world.script_load("m0", "ok", 3.0), 0)  # the follower's reload of m0 takes 3 s
    world.step(world.remote_publish("m0", 60), 2.5)  # the follower (every 2 s) has started the reload
    reload = world.manager.states.records["m0"].op
    assert reload is not None and not reload.done()
    world.step(world.crash("m1"), 0.5)  # several watch intervals (0.2 s), well within the reload
    assert world.manager.states.records["m0"].op is reload and not reload.done()  # still reloading
    assert world.manager.states.records["m1"].procs.last_crash is not None  # and the crash was noticed meanwhile


class WatchedProcs(ProcessRecord):
    """Notes which threads write a record's process list."""

    writers: set[str]

    def __setattr__(self, name: str, value: object) -> None:
        if name == "stubs":
            self.__dict__.setdefault("writers", set()).add(threading.current_thread().name)
        super().__setattr__(name, value)


def test_the_crash_watch_writes_records_on_the_event_loop_only(world):
    """Race: the crash watch, running in a worker thread, wrote a record's process list while the event loop
    wrote it too. Here a stub of a two-instance model ended on purpose (reaped) and a new one took its place: the
    watch notes the new process list, from the event loop."""
    world.step(world.publish("m0", 60, 2), 0.1)
    world.step(world.api_load("m0", 2), 1.0)
    watched = world.manager.states.records["m0"]
    procs = watched.procs
    watched.procs = WatchedProcs(**{f: getattr(procs, f) for f in procs.__dataclass_fields__})
    model = world.triton.models["m0"]
    world.triton._exit([model.stubs[0]])  # reaped: ended by Triton itself
    model.stubs = model.stubs[1:] + [world.triton._stub(model, model.stubs[0].memory, model.files)]
    loop_thread = threading.current_thread().name
    with ThreadPoolExecutor(1, thread_name_prefix="watch") as pool:  # the watch's worker thread
        found = pool.submit(world.manager.run_once.crashes, watched).result()
    assert world.manager.run_once.noted(watched, watched.generation, found) == []
    assert watched.procs.writers == {loop_thread} and watched.procs.stubs == tuple(s.process for s in model.stubs)


async def test_the_stack_stops_every_piece_when_one_fails(tmp_path):
    """Race: ServingStack.stop stopped at the first step that raised, leaving tritonserver running."""
    stack = ServingStack(Settings(work_dir=tmp_path))
    stopped: list[str] = []

    class Piece:
        def __init__(self, name: str, fails: bool = False) -> None:
            self.name, self.fails = name, fails

        async def stop(self) -> None:
            stopped.append(self.name)
            if self.fails:
                raise RuntimeError(f"{self.name} would not stop")

        async def aclose(self) -> None:
            stopped.append(self.name)

    class Triton:
        def stop(self) -> None:
            stopped.append("tritonserver")

    stack.activator = Piece("activator", fails=True)
    stack.lifecycle = Piece("lifecycle")
    stack.admin = Piece("admin")  # type: ignore[assignment]
    stack.triton_process = Triton()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="activator would not stop"):
        await stack.stop()
    assert stopped == ["activator", "lifecycle", "admin", "tritonserver"]


def test_a_wake_during_the_adoption_of_a_model_loaded_elsewhere_waits_for_it(world):
    """Race: the resync adopted a model Triton had loaded behind this control plane's back (another tool, an
    earlier control plane) outside the model's transition slot; a request meanwhile found it unloaded here and
    had Triton load it again. The adoption is a transition: the wake waits for it and loads nothing."""
    world.step(world.publish("m0", 60), 0.1)
    manager, triton = world.manager, world.triton
    world.run(triton.load("m0"))  # behind the control plane's back
    loads_before = triton.calls["load"]
    sync, transitions = manager.sync, manager.transitions
    adopt, entered, gate = transitions._adopt_op, asyncio.Event(), asyncio.Event()

    async def slow_adopt(rec: ModelRecord) -> None:  # the adoption measures the model's processes meanwhile
        entered.set()
        await gate.wait()
        await adopt(rec)

    transitions._adopt_op = slow_adopt  # type: ignore[method-assign]

    async def race() -> None:
        resync = asyncio.create_task(sync.resync(full=False))
        await entered.wait()
        wake = asyncio.create_task(manager.ensure_ready("m0", timeout=10))
        await asyncio.sleep(0.5)
        gate.set()
        await asyncio.gather(resync, wake)

    world.run(race())
    transitions._adopt_op = adopt  # type: ignore[method-assign]
    assert triton.calls["load"] == loads_before  # the wake loaded nothing: it waited for the adoption
    assert manager.states.records["m0"].state.value == "ready"


def test_a_wake_waiting_while_its_model_is_deleted_does_not_load_it_again(world):
    """Race: a delete (``forget``) dropped the record while a wake-up waited on the model's load; when the delete's
    unload ended, the wake-up found the model unloaded and had Triton load it again, with no record left to count
    it or ever unload it. A dropped record starts no transition: the wake-up is told the model is gone."""
    world.step(world.publish("m0", 60), 0.1)
    world.step(world.script_load("m0", "ok", 0.5), 0)
    manager = world.manager

    async def race() -> None:
        load = asyncio.create_task(manager.load("m0"))
        await asyncio.sleep(0.1)  # Triton is loading it
        await asyncio.sleep(0)
        wake = asyncio.create_task(manager.ensure_ready("m0", timeout=10))  # waits for the load
        await asyncio.sleep(0)
        forget = asyncio.create_task(manager.forget("m0"))  # cancels the load (cancel.py), then drops
        await forget
        with pytest.raises(NotFoundError):  # the load and its wake-up: the model is gone
            await load
        with pytest.raises(NotFoundError):
            await wake

    world.run(race())
    assert "m0" not in world.triton.holding() and "m0" not in manager.states.records


def test_a_wake_while_tritonserver_is_away_is_answered_at_once_then_served_once_it_is_back(world):
    """Race (seen in CI under load): after tritonserver died, a request waited for its restart, the resync and
    its model's load, past the client's 8 s deadline (HTTP clients send none), instead of the 503 it gets while
    Triton cannot be reached. While Triton is away a wake-up is refused at once with Retry-After; once it is
    back, the next request loads the model again. (Triton's container restarting, as compose or the kubelet
    does: its pid changes; the embedded child's restart takes the same path, tests/reliability/test_triton_kill.py.)"""
    from harness.fake_triton import _Server

    w = world
    w.step(w.publish("m0", 60), 0.1)
    w.step(w.request("m0"), 0.0)
    first = w.calls[-1]
    w.step(w.tick(0.5), 0.0)
    assert first.task.result() == "200"
    w.processes._server = None  # type: ignore[assignment]
    w.step(w.tick(1.5), 0.0)  # a sweep sees it
    assert not w.manager.sync.up.is_set()
    assert w.manager.states.records["m0"].state is ModelState.UNLOADED
    w.triton.models.clear()  # what the gone tritonserver had loaded

    async def through_the_activator() -> SnoozeError:
        with pytest.raises(SnoozeError) as refused:
            await w.answers.forward("m0", "rid-away", lambda: w.triton.infer("m0", "rid-away"), lambda a: a.dead)
        return refused.value

    started = w.now
    refused = w.run(through_the_activator())
    assert w.now - started < 0.1, "the wake-up waited for tritonserver to come back"
    assert refused.status_code == 503 and "tritonserver is restarting" in str(refused), refused
    assert refused.retry_after and refused.retry_after >= 1

    w.processes._server = _Server(4343)  # a new tritonserver, nothing loaded
    w.step(w.tick(1.5), 0.0)
    assert w.manager.sync.up.is_set()
    w.step(w.request("m0"), 0.0)
    again = w.calls[-1]
    w.step(w.tick(1.0), 0.0)
    assert again.task.result() == "200"
