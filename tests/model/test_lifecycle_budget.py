"""The memory budget inside the real manager over the fake Triton: which model the eviction policy lets go,
what concurrent wake-ups reserve, and how long a wake-up may wait for its load to start (the wake queue)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from controlplane.errors import UnavailableError
from controlplane.lifecycle.memory.cgroup import CgroupMemory
from controlplane.lifecycle.state import ModelState
from harness.fake_triton import MIB
from harness.lifecycle_world import LifecycleWorld

LONG_IDLE = {"idle_timeout_secs": 600}  # no idle unload in these tests: only memory pressure evicts


@pytest.fixture
def make_world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., LifecycleWorld]]:
    logging.getLogger("snoozeml").setLevel(logging.CRITICAL)
    worlds: list[LifecycleWorld] = []

    def make(**settings: object) -> LifecycleWorld:
        root = tmp_path / f"w{len(worlds)}"
        root.mkdir()
        worlds.append(LifecycleWorld(root, monkeypatch=monkeypatch, **settings))
        return worlds[-1]

    yield make
    for w in worlds:
        w.close()
    logging.getLogger("snoozeml").setLevel(logging.NOTSET)


def state(world: LifecycleWorld, model: str) -> ModelState:
    return world.manager.states.records[model].state


@pytest.mark.parametrize("policy", ["gdsf", "lru"])
def test_the_policy_chooses_the_victim_gdsf_keeps_the_hot_model_lru_evicts_it(make_world, policy):
    """Three 100 MiB models fill the 300 MiB budget; the hot one (11 requests) was used least recently. A fourth
    model needs room: LRU evicts the hot model, GDSF a model used once (frequency from Triton's counts)."""
    world = make_world(eviction_policy=policy)
    for m in ("hot", "a", "b", "c"):
        world.step(world.publish(m, 100, **LONG_IDLE), 0.01)
    world.step(world.request("hot"), 1.0)
    world.step(world.burst("hot", 10), 2.0)  # the sweeps read Triton's success count: 11
    world.step(world.request("a"), 1.0)
    world.step(world.request("b"), 2.0)
    world.step(world.request("c"), 2.0)
    evicted = {m for m in ("hot", "a", "b") if state(world, m) is ModelState.UNLOADED}
    assert state(world, "c") is ModelState.READY
    assert evicted == ({"a"} if policy == "gdsf" else {"hot"})
    if policy == "gdsf":
        world.step(world.api_unload("hot"), 1.0)
        assert world.manager.budget.policy.frequency["hot"] >= 11  # kept across the unload: the point of it


@pytest.mark.parametrize("policy", ["gdsf", "lru"])
def test_a_warm_request_since_the_last_sweep_counts_when_a_victim_is_chosen(make_world, policy):
    """Found by a fresh clone (LRU evicted the model used last): a request that takes the warm path goes straight to
    Triton, and the manager hears of it only when it reads Triton's statistics. "old" was loaded first, "new" after
    it; a warm request to "old" comes just before a third model needs room, before any sweep. The victim must be
    "new", the one used least recently (both policies: one request each, the same sizes and load times)."""
    world = make_world(eviction_policy=policy, sweep_interval_secs=30.0)
    for m in ("old", "new", "third"):
        world.step(world.publish(m, 150, **LONG_IDLE), 0.01)
    world.step(world.request("old"), 0.5)
    world.step(world.request("new"), 0.5)
    rec = world.manager.states.records["old"]
    seen = rec.access.triton_last
    world.step(world.request("old"), 0.01)  # warm: answered by Triton, not seen by the manager yet
    assert world.manager.states.records["old"].access.triton_last == seen  # no sweep read it
    world.step(world.request("third"), 1.0)
    assert state(world, "third") is ModelState.READY
    assert state(world, "old") is ModelState.READY and state(world, "new") is ModelState.UNLOADED


def test_sweeps_and_eviction_plans_read_every_models_statistics_in_one_call(make_world):
    """With many loaded models, a sweep and an eviction plan ask Triton once for every model's statistics
    (``GET /v2/models/stats``), not once per model (each plan did, and a wake waiting for room plans again every
    50 ms): six models loaded, then a seventh that must evict, then sweeps."""
    world = make_world(memory_budget_mb=650, sweep_interval_secs=1.0)
    for i in range(7):
        world.step(world.publish(f"m{i}", 100, **LONG_IDLE), 0.01)
    for i in range(6):
        world.step(world.request(f"m{i}"), 0.3)
    world.triton.calls.clear()
    world.step(world.request("m6"), 1.0)  # over the budget: an eviction plan, then the load
    assert state(world, "m6") is ModelState.READY
    assert sum(state(world, f"m{i}") is ModelState.UNLOADED for i in range(6)) >= 1
    world.step(world.tick(5.0), 0.0)  # five sweeps over six loaded models
    assert world.triton.calls["all_stats"] >= 5
    # one model's own reading: only an unload's last look at its victim (whether a request came since)
    assert world.triton.calls["stats"] <= world.triton.calls["unload"]


def test_concurrent_wakes_of_never_measured_models_stay_within_the_budget(make_world):
    """Models that declare no memory: two measured (50 and 150 MiB), the 50 MiB one still loaded; then two new
    150 MiB models wake at once (two loads at a time). Estimated at the average of the measured (100 MiB) both
    fit on paper beside the loaded one and overran the 300 MiB budget (350 MiB); at the largest measured
    (150 MiB) the second evicts one idle model first (it waits for the first load to end: a load that must
    evict does not run beside another, so the policy may pick the first one as well as the small one)."""
    world = make_world()
    sizes = {"small": 50, "large": 150, "new1": 150, "new2": 150}
    for m, mb in sizes.items():
        world.triton.memory[m] = mb * MIB
        world.step(world.publish(m, None, **LONG_IDLE), 0.01)
    world.step(world.request("small"), 1.0)
    world.step(world.request("large"), 1.0)
    world.step(world.api_unload("large"), 0.5)
    world.triton.peak = 0
    world.step(world.request("new1"), 0.0)
    world.step(world.request("new2"), 3.0)
    assert {c.answer for c in world.calls} <= {"200"}, [c.answer for c in world.calls]
    assert state(world, "new2") is ModelState.READY
    assert {state(world, "small"), state(world, "new1")} == {ModelState.READY, ModelState.UNLOADED}
    assert world.triton.peak <= 300 * MIB, world.triton.peak / MIB


def test_a_wake_that_cannot_start_loading_within_its_bound_gets_a_fast_503_naming_the_model_and_the_fix(make_world):
    world = make_world(max_concurrent_loads=1, wake_queue_timeout_secs=1.0)
    for m in ("slow", "next"):
        world.step(world.publish(m, 60, **LONG_IDLE), 0.01)
    world.step(world.script_load("slow", "ok", 5.0), 0)
    world.step(world.request("slow"), 0.1)  # holds the only load slot for 5 s
    started = world.now

    async def wake() -> UnavailableError | None:
        try:
            await world.manager.ensure_ready("next")
        except UnavailableError as e:
            return e
        return None

    async def queue_then_wake() -> tuple[dict, UnavailableError | None]:
        task = world.loop.create_task(wake())
        await __import__("asyncio").sleep(0.5)
        return world.manager.runtime()["wake_queue"], await task

    queue, error = world.run(queue_then_wake())
    assert queue["length"] == 1 and queue["waiting"][0]["model"] == "next"
    assert queue["waiting"][0]["waiting_for"] == "a load slot" and queue["oldest_wait_secs"] == pytest.approx(0.5)
    assert error is not None, "the wake waited for the slot instead of giving up at its bound"
    assert world.now - started == pytest.approx(1.0, abs=0.05)  # at its bound, not after the 5 s load
    assert "'next'" in error.message and "a load slot" in error.message and "1 other load" not in error.message
    assert "SNOOZE_MAX_CONCURRENT_LOADS" in (error.hint or "") and error.retry_after and error.retry_after >= 1
    assert state(world, "next") is ModelState.UNLOADED  # the load never started: nothing failed
    metrics = world.manager.metrics.registry
    assert metrics.get_sample_value("snooze_wake_queue_timeouts_total", {"model": "next", "waiting_for": "slot"}) == 1
    assert metrics.get_sample_value("snooze_wake_queue_length") == 0
    # a client through the gateway: the activator answers in Triton's words, snoozeml's reason after, 503
    world.step(world.tick(5.0), 0)
    world.step(world.script_load("slow", "ok", 5.0), 0)
    world.step(world.api_unload("slow"), 0.5)
    world.step(world.request("slow"), 0.1)
    world.run(world.request("next"))
    call = world.calls[-1]
    world.step(world.tick(1.2), 0)
    answer = call.answer
    assert answer is not None and answer.startswith(
        "503: Request for unknown model: 'next' has no available versions: snoozeml: model 'next' is asleep and its "
        "load could not start within 1.0s"
    ), answer
    world.step(world.tick(5.0), 0)
    world.step(world.request("next"), 1.0)  # the slot is free again: the next request loads it
    assert state(world, "next") is ModelState.READY


def test_a_wake_whose_load_starts_within_its_bound_waits_for_the_whole_load(make_world):
    world = make_world(max_concurrent_loads=1, wake_queue_timeout_secs=1.0)
    world.step(world.publish("big", 60, **LONG_IDLE), 0.01)
    world.step(world.script_load("big", "ok", 3.0), 0)  # a 3 s load, longer than the queue bound
    world.run(world.request("big"))
    call = world.calls[-1]
    world.step(world.tick(4.0), 0)
    assert call.answer == "200"  # its load had started within the bound: the bound does not cut it
    assert state(world, "big") is ModelState.READY


@pytest.mark.parametrize("bound", [10.0, 1.0])
def test_a_wake_waits_for_memory_held_by_requests_in_flight_within_its_bound(make_world, bound):
    """The budget is full of a model serving requests (nothing idle to evict): the wake waits for them to end,
    then evicts it and loads (it was refused at once before); past its bound it is refused, naming memory."""
    world = make_world(wake_queue_timeout_secs=bound)
    world.step(world.publish("busy", 200, **LONG_IDLE), 0.01)
    world.step(world.publish("other", 200, **LONG_IDLE), 0.01)
    world.step(world.request("busy"), 1.0)
    world.triton.exec_delay = 1.5
    world.step(world.burst("busy", 2), 0.1)  # in flight for about 3 s
    world.run(world.request("other"))
    call = world.calls[-1]
    world.step(world.tick(0.5), 0)
    assert world.manager.runtime()["wake_queue"]["waiting"][0] == {
        "model": "other",
        "waiting_for": "memory",
        "wait_secs": pytest.approx(0.5, abs=0.06),
    }
    world.step(world.tick(6.0), 0)
    if bound > 3:
        assert call.answer == "200" and state(world, "busy") is ModelState.UNLOADED
    else:
        assert call.answer is not None and "could not start within 1.0s: it waited for memory" in call.answer
        assert state(world, "busy") is ModelState.READY and state(world, "other") is ModelState.UNLOADED


def test_the_budget_counts_tritonservers_own_memory_beside_the_models_read_at_each_sweep(make_world):
    """tritonserver itself holds 100 MiB: under the 300 MiB budget two 100 MiB models fit beside it, not three
    (the budget is for the whole Triton tree); when the server grows by 50 MiB, the next sweep evicts one more."""
    world = make_world()
    world.triton.server_memory = 100 * MIB
    for m in ("a", "b", "c"):
        world.step(world.publish(m, 100, **LONG_IDLE), 0.01)
    for m in ("a", "b", "c"):
        world.step(world.request(m), 1.0)
    assert {c.answer for c in world.answered if c.what == "request"} == {"200"}
    assert [state(world, m) for m in "abc"] == [ModelState.UNLOADED, ModelState.READY, ModelState.READY]
    assert world.triton.peak <= 300 * MIB, world.triton.peak / MIB
    assert world.manager.budget.server == 100 * MIB
    world.triton.server_memory = 150 * MIB
    world.step(world.tick(1.5), 0)  # a sweep reads the server's memory again
    assert sorted(state(world, m).value for m in "bc") == ["ready", "unloaded"]


def test_a_budget_smaller_than_tritonserver_itself_is_refused_naming_the_setting_and_the_servers_size(make_world):
    world = make_world()
    world.triton.server_memory = 350 * MIB
    world.step(world.publish("a", 100, **LONG_IDLE), 0.01)
    with pytest.raises(UnavailableError) as refused:
        world.run(world.manager.ensure_ready("a"))
    message, hint = refused.value.message, refused.value.hint or ""
    assert "model 'a'" in message and "SNOOZE_MEMORY_BUDGET_MB=300" in message, message
    assert "tritonserver's own 350 MiB" in message, message
    assert "raise SNOOZE_MEMORY_BUDGET_MB to at least 450" in hint, hint
    assert "a" not in world.triton.holding()


def test_a_republish_reserves_the_new_version_beside_the_old_one_until_the_old_one_has_left(make_world):
    """Three 100 MiB models fill the 300 MiB budget. A republish of one reloads it: Triton builds the new instance
    beside the old one and holds both until it is ready. The budget counted the larger of the two (400 MiB held);
    now the reload makes room for both first (an idle model is evicted), then the old version leaves."""
    world = make_world()
    for m in ("a", "b", "c"):
        world.step(world.publish(m, 100, **LONG_IDLE), 0.01)
        world.step(world.request(m), 1.0)
    world.triton.peak = 0
    world.step(world.publish("a", 100, **LONG_IDLE), 2.0)
    assert world.triton.peak <= 300 * MIB, world.triton.peak / MIB
    assert state(world, "a") is ModelState.READY and world.manager.states.records["a"].load.load_count == 2
    assert sorted(state(world, m).value for m in "bc") == ["ready", "unloaded"]


def test_wakes_of_models_of_unknown_size_load_one_at_a_time_until_one_is_measured(make_world):
    """Nothing measured yet, nothing declared: four wake-ups at once (four load slots) were each estimated at
    0 MiB, loaded side by side and held 400 MiB under the 300 MiB budget. The first now loads alone; once it is
    measured (100 MiB) the others are estimated from it: two more fit, the fourth evicts."""
    world = make_world(max_concurrent_loads=4)
    for m in ("a", "b", "c", "d"):
        world.triton.memory[m] = 100 * MIB
        world.step(world.publish(m, None, **LONG_IDLE), 0.01)
    for m in ("a", "b", "c", "d"):
        world.step(world.request(m), 0.0)
    world.step(world.tick(3.0), 0)
    assert {c.answer for c in world.answered if c.what == "request"} == {"200"}
    assert world.triton.peak <= 300 * MIB, world.triton.peak / MIB
    assert state(world, "d") is ModelState.READY
    assert sum(state(world, m) is ModelState.READY for m in "abcd") == 3


def test_what_a_loaded_model_holds_is_read_again_at_each_sweep(make_world):
    """A model's process grows after its load (a real stub: 85 MiB at its load, 88 MiB once it has answered).
    Three 100 MiB models fill the 300 MiB budget; each grows by 10 MiB: the next sweep sees 330 MiB held and
    evicts one (the load-time figures said 300 and nothing was evicted)."""
    world = make_world()
    for m in ("a", "b", "c"):
        world.step(world.publish(m, 100, **LONG_IDLE), 0.01)
        world.step(world.request(m), 1.0)
    for m in ("a", "b", "c"):
        for stub in world.triton.models[m].stubs:
            stub.memory += 10 * MIB
    world.step(world.tick(1.5), 0)
    assert sum(state(world, m) is ModelState.READY for m in "abc") == 2
    loaded = [m for m in "abc" if state(world, m) is ModelState.READY]
    assert all(world.manager.status(m).memory_bytes == 110 * MIB for m in loaded)


def test_a_model_loaded_again_counts_what_it_grew_to_so_no_load_takes_the_room_it_takes_back(make_world):
    """A stub grows at its first request (a real one by 2.8 MiB); here 100 MiB models grow by 10 MiB, under a
    330 MiB budget. a, b and c, each grown to 110 MiB, fill it; a is unloaded, then a and a 10 MiB model e wake
    together. a measured 100 MiB at its load and e was admitted into the 10 MiB its request took back: 340 MiB
    held. Counted at the 110 MiB it grew to before, a leaves e to evict first."""
    world = make_world(memory_budget_mb=330)
    for m in ("a", "b", "c"):
        world.triton.growth[m] = 10 * MIB
        world.step(world.publish(m, 100, **LONG_IDLE), 0.01)
        world.step(world.request(m), 1.5)  # a sweep reads what it grew to
    world.step(world.publish("e", 10, **LONG_IDLE), 0.01)
    world.step(world.api_unload("a"), 0.5)
    world.triton.peak = 0
    world.step(world.request("a"), 0.0)
    world.step(world.request("e"), 3.0)
    assert {c.answer for c in world.answered if c.what == "request"} == {"200"}
    assert state(world, "a") is ModelState.READY and state(world, "e") is ModelState.READY
    assert world.triton.peak <= 330 * MIB, world.triton.peak / MIB


def test_a_load_reserves_what_tritonserver_itself_grows_by_with_each_model(make_world):
    """tritonserver holds more for each model it loads (a real one about 2 MiB: its side of the model's shared
    memory); here 10 MiB, beside 92 MiB models under the 300 MiB budget. The third load fitted on the server's
    size before it (20 + 2 x 92 + 92 = 296 MiB) and the tree held 306 MiB once it was loaded. The load now
    reserves the server's growth seen at the loads before it: it evicts first."""
    world = make_world()
    world.triton.server_per_model = 10 * MIB
    for m in ("a", "b", "c"):
        world.step(world.publish(m, 92, **LONG_IDLE), 0.01)
    for m in ("a", "b", "c"):
        world.step(world.request(m), 1.0)
    assert {c.answer for c in world.answered if c.what == "request"} == {"200"}
    assert world.manager.budget.server_growth == 10 * MIB
    assert world.triton.peak <= 300 * MIB, world.triton.peak / MIB
    assert state(world, "c") is ModelState.READY and sum(state(world, m) is ModelState.READY for m in "abc") == 2


def _cgroup(limit_mb: float | None, usage_mb: float) -> CgroupMemory:
    limit = int(limit_mb * MIB) if limit_mb else None
    return CgroupMemory(Path("/sys/fs/cgroup/triton"), 2, limit, int(usage_mb * MIB))


def test_without_a_budget_setting_the_cgroup_limit_less_the_headroom_is_the_budget(make_world):
    """No SNOOZE_MEMORY_BUDGET_MB; Triton's cgroup is limited to 500 MiB, headroom 100 MiB: five 100 MiB models
    woken one after another keep at most four loaded (400 MiB), each wake answered."""
    world = make_world(memory_budget_mb=None, memory_headroom_mb=100)
    world.cgroup = _cgroup(500, 0)
    for m in ("a", "b", "c", "d", "e"):
        world.step(world.publish(m, 100, **LONG_IDLE), 0.01)
    for m in ("a", "b", "c", "d", "e"):
        world.step(world.request(m), 1.0)
    assert {c.answer for c in world.calls + world.answered} == {"published", "200"}
    loaded = [m for m in "abcde" if state(world, m) is ModelState.READY]
    assert len(loaded) == 4, loaded
    assert world.manager.runtime()["budget_bytes"] == 400 * MIB


def test_a_sweep_evicts_when_the_cgroup_passes_its_ceiling_whatever_the_models_sum(make_world):
    """The models count 300 MiB of a 1000 MiB budget, but Triton's cgroup (limit 500 MiB, headroom 50) holds
    480 MiB (page cache, memory outside any model): the next sweep evicts idle models until its usage is
    accounted under the ceiling; below the ceiling nothing is evicted."""
    world = make_world(memory_budget_mb=1000, memory_headroom_mb=50)
    for m in ("a", "b", "c"):
        world.step(world.publish(m, 100, **LONG_IDLE), 0.01)
        world.step(world.request(m), 1.0)
    outside = 140  # what the cgroup holds beside the models
    world.cgroup = lambda: _cgroup(500, outside + world.triton.server_bytes() / MIB + held(world) / MIB)
    world.step(asyncio.sleep(0), 3.0)
    assert all(state(world, m) is ModelState.READY for m in "abc")
    runtime = world.manager.runtime()
    assert runtime["cgroup_usage_bytes"] == 440 * MIB and runtime["models_bytes"] == 300 * MIB
    outside = 180
    world.step(asyncio.sleep(0), 3.0)
    evicted = [m for m in "abc" if state(world, m) is ModelState.UNLOADED]
    assert len(evicted) == 1, evicted  # 30 MiB over: one idle 100 MiB model is enough


def held(world: LifecycleWorld) -> int:
    return sum(s.memory for m in world.triton.models.values() for s in m.stubs if s.alive)


def test_a_republish_with_no_room_beside_the_old_version_unloads_it_rather_than_serve_it(make_world):
    """Three 100 MiB models fill the 300 MiB budget and each is held (a stream through the gateway): nothing can be
    evicted, so the reload cannot build the new version beside the old one. The old version kept serving after the
    republish had returned (bench churn --quick: answers of the old version). It now leaves Triton, and the next
    request loads the new version once there is room."""
    world = make_world()
    for m in ("a", "b", "c"):
        world.step(world.publish(m, 100, **LONG_IDLE), 0.01)
        world.step(world.hold(m), 1.0)
    world.step(world.publish("a", 100, **LONG_IDLE), 2.0)
    rec = world.manager.states.records["a"]
    assert rec.state is ModelState.UNLOADED and "no room beside the old one" in (rec.reason or ""), rec.reason
    assert "a" not in world.triton.ready(), "the previous version of 'a' still serves"
    world.step(world.release(), 0.5)  # the stream on 'a' ends (its old version had to be let go)
    world.step(world.request("a"), 1.0)
    assert state(world, "a") is ModelState.READY
    folder = world.triton.repository / "a"
    assert world.triton.models["a"].files == (folder.stat().st_ino, (folder / "config.pbtxt").stat().st_mtime_ns)


def test_an_idle_model_is_evicted_though_the_sweep_has_not_read_its_last_request_yet(world):
    """Found under load (tests/reliability/test_load_faults.py): a request that reached Triton straight from the
    gateway is heard at the next sweep. An eviction planned before that read its victim as idle since its
    earlier request; the eviction then read Triton's newer stamp and kept the victim as "used since the
    decision", though that request ended before the decision. A load that ran out of memory then found no idle
    model to unload and failed (the out-of-memory path evicts once, it does not wait). A request since the
    decision is one stamped after it."""
    world.step(world.publish("m0", 150), 0.1)
    world.step(world.publish("m1", 60), 0.1)
    world.step(world.request("m0"), 2.5)  # woken, then swept: its access is read
    world.run(world.triton.infer("m0", "direct"))  # straight to Triton: heard at the next sweep only
    world.step(world.script_load("m1", "oom"), 0)  # its load runs out of memory: it evicts, then retries
    world.step(world.request("m1"), 3.0)
    answers = {c.model: c.answer for c in world.answered if c.what == "request"}
    assert answers == {"m0": "200", "m1": "200"}, answers
    assert world.manager.states.records["m0"].state is ModelState.UNLOADED


def test_an_eviction_leaves_a_victim_that_was_taken_meanwhile(make_world):
    """Found by the churn trace with preforked models (a client got "model 'churn-15' already has a transition
    running" as a 500): a planned eviction tries a doze first and awaits the stubs' answers; a victim whose doze was
    refused and that started a transition of its own meanwhile must be left, not unloaded on top of it."""
    world = make_world()
    world.step(world.publish("m0", 100, **LONG_IDLE), 0.01)
    world.step(world.request("m0"), 1.0)
    rec = world.manager.states.records["m0"]
    world.step(world.script_load("m0", "hang", 0.05), 0.0)
    world.step(world.publish("m0", 100, **LONG_IDLE), 0.5)  # its reload in place hangs: a transition runs
    assert rec.op is not None and rec.state is ModelState.READY
    evict = world.manager.transitions.unloads.evict
    assert world.run(evict(rec, "memory", "another model")) is False
    assert rec.state is ModelState.READY
