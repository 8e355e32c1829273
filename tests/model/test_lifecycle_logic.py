"""Lifecycle logic checked over the fake Triton (no real Triton needed), moved here from the real-Triton tier
(tests/integration/test_lifecycle.py): the same scenarios, on a virtual clock, with every invariant of
``LifecycleWorld.check`` after each step."""

from __future__ import annotations

import json

from controlplane.lifecycle.state import ModelState
from controlplane.render import DEPLOYMENT_FILE
from harness.lifecycle_world import LifecycleWorld


def sample(world: LifecycleWorld, name: str, **labels: str) -> float:
    return world.manager.metrics.registry.get_sample_value(name, labels) or 0.0


def test_pause_holds_every_change_until_resume(world):
    """What a checkpoint needs: pause() lets a running load finish, then nothing changes (no idle unload, no
    dead-stub recovery by the sweeper or the crash watch, wake-ups, recover() and API loads and unloads wait)
    until resume(). (The real-Triton checks of the pause are tests/integration/test_snapshot.py's.)"""
    w = world
    idle, crashy, asleep, slow = "m0", "m1", "m2", "m3"
    w.step(w.publish(idle, 60, idle_timeout_secs=3), 0.1)
    for model in (crashy, asleep, slow):
        w.step(w.publish(model, 60), 0.1)
    w.step(w.api_load(crashy), 0.5)
    w.step(w.script_load(slow, "ok", 1.0), 0)
    w.step(w.api_load(slow), 0.1)
    records = w.manager.states.records
    assert records[slow].state is ModelState.LOADING
    w.step(w.api_load(idle), 0.2)
    assert records[idle].state is ModelState.READY

    w.step(w.pause(), 0.0)
    pause = w.calls[-1]
    w.step(w.tick(1.5), 0.0)  # the slow load ends; then pause() returns
    assert w.manager.paused and pause.task.done() and records[slow].state is ModelState.READY
    assert w.triton.crash(crashy) is not None
    w.step(w.request(asleep), 0.0)
    woken = w.calls[-1]
    w.step(w.api_unload(slow), 0.0)
    waiting = [woken, w.calls[-1]]
    recover = w.loop.create_task(w.manager.recover(crashy, "stub_unhealthy"))
    w.step(w.tick(3.5), 0.0)  # past idle's timeout: many sweep (1 s) and watch (0.2 s) intervals
    assert not any(c.task.done() for c in waiting) and not recover.done()
    assert [records[m].state for m in (idle, crashy, asleep, slow)] == [
        ModelState.READY, ModelState.READY, ModelState.UNLOADED, ModelState.READY,
    ]  # fmt: skip
    assert w.processes.stubs(crashy) == [] and asleep not in w.triton.ready()
    assert sample(w, "snooze_recoveries_total", model=crashy, cause="dead_stub") == 0

    w.step(w.resume(), 0.0)
    w.step(w.tick(2.0), 0.0)
    assert recover.done() and recover.exception() is None
    assert [c.task.result() for c in waiting] == ["200", "unloaded"]
    assert records[asleep].state is ModelState.READY and records[slow].state is ModelState.UNLOADED
    assert records[crashy].state is ModelState.READY and w.processes.stubs(crashy) != []
    w.step(w.request(crashy), 0.0)
    served = w.calls[-1]
    w.step(w.tick(0.5), 0.0)
    assert served.task.result() == "200"
    w.step(w.tick(5.0), 0.0)
    assert records[idle].state is ModelState.UNLOADED  # the idle unload, after resume


def _until(world: LifecycleWorld, condition, what: str, secs: float = 30.0, every: float = 0.25) -> float:
    """Step the world ``every`` virtual seconds until ``condition()``; the virtual seconds it took."""
    started = world.now
    while not condition():
        assert world.now - started < secs, f"no {what} within {secs:g} virtual seconds"
        world.step(world.tick(every), 0.0)
    return world.now - started


def test_autoscale_up_under_load_and_down_when_idle(world):
    """A queue above autoscale_queue_threshold per instance for autoscale_window_secs doubles the instances (up to
    max_instances), every request is served through the reload, and low load for idle_timeout / N takes the extra
    instance away before the idle unload. (Through real Triton and the gateway: tests/reliability/test_soak.py.)"""
    w = world
    records = w.manager.states.records
    w.triton.exec_delay = 0.2  # one instance serves 5 requests a second: a burst of 30 queues for seconds
    w.step(w.publish("m0", 60, idle_timeout_secs=6, max_instances=2), 0.1)
    w.step(w.api_load("m0"), 0.5)
    w.step(w.burst("m0", 30), 0.0)
    burst = [c for c in w.calls if c.what == "request"]
    assert len(burst) == 30

    def scaled(n: int) -> bool:
        rec = records["m0"]
        return rec.instances == n and rec.op is None and rec.state is ModelState.READY

    _until(w, lambda: scaled(2), "scale-up")
    assert sample(w, "snooze_scale_events_total", model="m0", direction="up") == 1
    assert len(w.processes.stubs("m0")) == 2
    _until(w, lambda: all(c.task.done() for c in burst), "answers")
    assert [c.task.result() for c in burst] == ["200"] * 30  # served throughout the reload
    quiet_since = w.now
    _until(w, lambda: scaled(1), "scale-down")
    assert w.now - quiet_since < 6.0  # before the idle unload (6 s)
    assert sample(w, "snooze_scale_events_total", model="m0", direction="down") == 1
    assert len(w.processes.stubs("m0")) == 1
    _until(w, lambda: records["m0"].state is ModelState.UNLOADED, "the idle unload")


def test_a_held_model_is_neither_unloaded_for_idleness_nor_evicted_until_its_stream_ends(world):
    """A stream through the gateway holds its model (``HoldRegistry``): no idle unload and no eviction for another
    model's memory while it is open; once it ends, the idle timeout counts again. (Through Envoy, Triton and a real
    gRPC stream: tests/integration/gateway/test_gateway_streams.py,
    test_an_open_stream_keeps_its_model_awake_and_is_journaled.)"""
    w = world
    records = w.manager.states.records
    w.step(w.publish("m0", 150), 0.1)
    w.step(w.hold("m0"), 1.0)
    assert records["m0"].state is ModelState.READY and w.held
    w.step(w.tick(20.0), 0.0)  # four idle timeouts (5 s)
    assert records["m0"].state is ModelState.READY
    w.step(w.publish("m1", 200), 0.1)
    w.step(w.request("m1"), 0.0)
    wake = w.calls[-1]
    w.step(w.tick(15.0), 0.0)
    assert wake.task.result().startswith("503")  # no room beside the held model: refused, not evicted
    assert records["m0"].state is ModelState.READY
    w.step(w.release(), 0.0)
    w.step(w.tick(10.0), 0.0)
    assert records["m0"].state is ModelState.UNLOADED


def test_a_model_serving_two_versions_is_ready_as_its_load_returns(world):
    """Triton runs a model's instances once per version it serves (a Triton folder's version_policy): two stubs for
    one instance and two versions are all the model's, and its wake waits for none of them to leave (it waited out
    ``STUBS_SETTLE_SECS``, 3 s, on every wake of such a model)."""
    world.step(world.publish("m0", 60), 0.1)
    folder = world.triton.repository / "m0"
    record = json.loads((folder / DEPLOYMENT_FILE).read_text())
    (folder / DEPLOYMENT_FILE).write_text(json.dumps({**record, "versions": ["1", "2"]}))
    world.step(world.request("m0"), 1.0)
    assert [c.answer for c in world.answered if c.what == "request"] == ["200"]
    status = world.manager.status("m0")
    assert status.state == "ready" and status.processes == 2  # one stub per version
