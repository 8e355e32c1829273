"""The pure parts of the lifecycle: OOM detection, load overrides, the autoscaling rule, status, and what the
keep-alive policies hear from the lifecycle (``warmth``, on a fake clock)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from controlplane import keepalive
from controlplane.keepalive import AdaptiveKeepAlive, FixedKeepAlive
from controlplane.lifecycle.autoscale import LoadWindow, autoscale_step
from controlplane.lifecycle.configs import GENERATION_PARAMETER, config_with_instances, rendered_config
from controlplane.lifecycle.memory.host import MemoryBudget
from controlplane.lifecycle.memory.oom import is_oom_error
from controlplane.lifecycle.state import ModelRecord, ModelState, ModelStates, ModelStatus
from controlplane.lifecycle.warmth import FORWARD_STAMP_SLACK_SECS, MIN_SWEEP_GAP_SECS, Warmth
from controlplane.metrics import SnoozeMetrics
from controlplane.settings import Settings
from controlplane.spec import DeploymentSpec
from controlplane.store import PublishedModel

CONFIG = """
name: "m"
backend: "python"
max_batch_size: 8
input [{ name: "x", data_type: TYPE_FP32, dims: [2] }]
output [{ name: "y", data_type: TYPE_FP32, dims: [2] }]
instance_group [{ kind: KIND_CPU, count: 1 }]
"""


@pytest.mark.parametrize(
    ("text", "oom"),
    [
        ("[snooze:oom] model 'm': load ran out of memory (MemoryError: x)", True),
        ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", True),
        ("MemoryError", True),
        ("[snooze:model_error] model 'm': load raised RuntimeError: broken weights", False),
    ],
)
def test_is_oom_error(text, oom):
    assert is_oom_error(text) is oom


def test_config_with_instances_sets_the_count_and_leaves_the_input_alone():
    base = rendered_config(CONFIG, where="test")
    assert base["instance_group"] == [{"kind": "KIND_CPU", "count": 1}]
    scaled = config_with_instances(base, 3)
    assert scaled["instance_group"][0] == {"kind": "KIND_CPU", "count": 3}
    assert base["instance_group"][0]["count"] == 1 and "parameters" not in scaled
    assert config_with_instances({"name": "m"}, 2)["instance_group"] == [{"kind": "KIND_CPU", "count": 2}]


def test_replace_changes_a_parameter_every_time():
    first = config_with_instances(rendered_config(CONFIG, where="test"), 1, replace=True)
    second = config_with_instances(first, 1, replace=True)
    assert first["parameters"][GENERATION_PARAMETER] != second["parameters"][GENERATION_PARAMETER]


def step(window: LoadWindow, pending: float, instances: int, now: float) -> int:
    return autoscale_step(
        window,
        pending=pending,
        instances=instances,
        base=1,
        max_instances=4,
        threshold=4,
        window_secs=5,
        idle_timeout_secs=60,
        now=now,
    )


def test_scale_up_needs_the_queue_high_for_the_whole_window():
    w = LoadWindow()
    assert step(w, 10, 1, now=0) == 1
    assert step(w, 10, 1, now=4.9) == 1
    assert step(w, 10, 1, now=5) == 2  # doubles
    assert step(w, 10, 2, now=6) == 2  # 5 per instance: high again, a new window starts
    assert step(w, 3, 2, now=8) == 2  # dipped below: the window restarts
    assert step(w, 9, 2, now=9) == 2 and step(w, 9, 2, now=14) == 4
    assert step(LoadWindow(high_since=0), 100, 4, now=100) == 4  # max_instances


def test_scale_down_after_idle_timeout_over_n_of_low_load():
    w = LoadWindow()
    assert step(w, 0, 4, now=0) == 4
    assert step(w, 0, 4, now=14.9) == 4
    assert step(w, 0, 4, now=15) == 3  # 60 s / 4 instances
    assert step(w, 0, 3, now=16) == 3 and step(w, 0, 3, now=36) == 2  # 60 / 3
    assert step(w, 0, 1, now=1000) == 1  # never below the deployment's instances


def test_a_queue_between_the_thresholds_keeps_the_count():
    w = LoadWindow()
    for t in range(0, 100, 5):
        assert step(w, 6, 2, now=t) == 2  # 3 per instance: not high; 6 > 4 * (2 - 1) / 2: not low


def test_status_to_dict():
    status = ModelStatus("m", ModelState.READY, None, 2, 1.5, 300, 1024, "measured", 0.4, 1, 2, None)
    assert status.to_dict() == {
        "id": "m",
        "state": "ready",
        "reason": None,
        "instances": 2,
        "last_access": 1.5,
        "idle_timeout_secs": 300,
        "memory_bytes": 1024,
        "memory_source": "measured",
        "last_cold_start_secs": 0.4,
        "load_count": 1,
        "processes": 2,
        "last_crash": None,
        "gpu_memory_bytes": None,
        "keep_alive": None,
        "worker": None,
        "warmup": None,
        "ensembles": None,
        "steps": None,
        "level": "unloaded",
    }


# ---------------------------------------------------------------------------------------------
# warmth: the lifecycle's events as the keep-alive policies hear them


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def record(model_id: str = "m", **deployment: object) -> ModelRecord:
    dep = DeploymentSpec(id=model_id, path=Path("."), **deployment)
    return ModelRecord(model_id, PublishedModel(model_id, Path("."), dep, "custom", "python", [], [], {}, {}, 60, 60))


def warmth(clock: Clock, **settings: object) -> tuple[Warmth, SnoozeMetrics]:
    metrics = SnoozeMetrics()
    return Warmth(Settings(**settings), metrics, clock=clock), metrics


def test_a_request_the_activator_forwarded_is_heard_once_at_its_arrival():
    clock = Clock()
    w, _ = warmth(clock)
    rec = record(keep_alive="adaptive", idle_timeout_secs=60)
    w.request(rec, 1000.0)  # the activator woke the model for it
    rec.access.touched = 1001.5  # the forward ended; Triton stamped the request just after that
    rec.access.triton_last = 1001.5 + FORWARD_STAMP_SLACK_SECS / 2
    w.triton_access(rec)
    assert (
        rec.access.keep_alive is not None
        and rec.access.keep_alive.last_request == 1000.0
        and rec.access.keep_alive.samples == 0
    )
    rec.access.triton_last = 1009.0  # a request straight from the gateway to Triton
    w.triton_access(rec)
    w.triton_access(rec)  # the sweeper reads the same stamp again
    assert rec.access.keep_alive.idle_times() == [9.0]


def test_fixed_timeout_counts_from_the_last_use_as_before():
    clock = Clock()
    w, _ = warmth(clock)
    rec = record(idle_timeout_secs=10)
    w.request(rec, 1000.0)
    clock.now = 1001.0
    w.loaded(rec, "request", load_secs=1.0)
    w.served(rec, 1001.5)  # the activator's forward ended
    assert not w.unload_due(rec, 1011.4) and w.unload_due(rec, 1011.5)
    rec.access.touched, rec.access.triton_last = 1001.5, 1001.6  # that forward's own stamp: use, not a new request
    w.triton_access(rec)
    assert not w.unload_due(rec, 1011.5) and w.unload_due(rec, 1011.6)
    assert isinstance(rec.access.keep_alive, FixedKeepAlive) and rec.access.keep_alive.samples == 0


def test_a_changed_deployment_gets_a_new_policy_that_still_unloads_the_loaded_model():
    clock = Clock(500.0)
    w, _ = warmth(clock)
    rec = record(idle_timeout_secs=300)
    rec.state, rec.load.ready_at = rec.state.READY, 100.0
    assert type(w.policy(rec)) is FixedKeepAlive
    rec.model = record(keep_alive="adaptive", idle_timeout_secs=120).model  # republished
    policy = w.policy(rec)
    assert isinstance(policy, AdaptiveKeepAlive) and w.policy(rec) is policy
    assert not w.unload_due(rec, 219.0) and w.unload_due(rec, 220.0)  # 120 s from its load, not never


def test_settings_tune_the_adaptive_policy_and_prewarm_outcomes_reach_the_metrics():
    clock = Clock()
    w, metrics = warmth(clock, keep_alive_min_samples=3, keep_alive_min_unloaded_secs=2)
    rec = record(keep_alive="adaptive", idle_timeout_secs=2)
    for t in (1000.0, 1008.0, 1016.0, 1024.0):  # a caller every 8 s: learned after three idle times
        w.request(rec, t)
    clock.now = 1024.5
    w.loaded(rec, "request", load_secs=0.5)
    window = w.windows(rec)
    assert window["pattern"] and window["min_samples"] == 3
    assert window["prewarm_after_secs"] == pytest.approx(8 * 0.9 - 0.5)
    assert w.unload_due(rec, 1024.6)  # unloaded between requests
    w.unloaded(rec)
    assert not w.prewarm_due(rec, 1030.0) and w.prewarm_due(rec, 1030.7)
    clock.now = 1030.7
    w.prewarm_started(rec)
    assert rec.prewarmed_unused and not w.prewarm_due(rec, 1031.0)  # one pre-warm per predicted request
    clock.now = 1031.2
    w.loaded(rec, "prewarm", load_secs=0.5)
    w.request(rec, 1032.0)  # it came: used
    assert not rec.prewarmed_unused
    clock.now = 1038.7
    w.unloaded(rec)
    w.prewarm_started(rec)
    clock.now = 1070.0
    w.unloaded(rec)  # nobody came: wasted
    used = metrics.registry.get_sample_value("snooze_prewarm_outcomes_total", {"model": "m", "outcome": "used"})
    wasted = metrics.registry.get_sample_value("snooze_prewarm_outcomes_total", {"model": "m", "outcome": "wasted"})
    assert (used, wasted) == (1, 1)


def budget(policy: str, records: list[ModelRecord]) -> MemoryBudget:
    class States:
        def values(self) -> list[ModelRecord]:
            return records

    async def never(*_: object) -> dict[str, float]:
        raise AssertionError("not called")

    return MemoryBudget(Settings(eviction_policy=policy), States(), pending=never)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["lru", "gdsf"])
def test_eviction_takes_unused_prewarms_first_then_the_policys_order(policy):
    clock = Clock()
    w, _ = warmth(clock, keep_alive_min_samples=1, keep_alive_min_unloaded_secs=0)
    old, recent, bet = record("old"), record("recent"), record("bet", keep_alive="adaptive", idle_timeout_secs=2)
    old.access.touched, recent.access.touched, bet.access.touched = 10.0, 20.0, 30.0
    for r in (old, recent, bet):
        r.memory.footprint, r.memory.footprint_instances, r.load.last_cold_start = 100 * 2**20, 1, 0.5
    b = budget(policy, [old, recent, bet])
    w.request(bet, 0.0)
    w.request(bet, 8.0)
    w.prewarm_started(bet)
    assert [r.id for r in b.eviction_order([old, recent, bet])] == ["bet", "old", "recent"]
    w.request(bet, 16.0)  # used now: the policy's order (equal sizes, costs and frequencies: recency)
    assert [r.id for r in b.eviction_order([old, recent, bet])] == ["old", "recent", "bet"]


def test_gdsf_keeps_a_frequently_used_model_that_lru_would_evict():
    hot, cold = record("hot"), record("cold")
    for r in (hot, cold):
        r.memory.footprint, r.memory.footprint_instances, r.load.last_cold_start = 100 * 2**20, 1, 0.5
    hot.access.touched, cold.access.touched = 10.0, 20.0  # the hot model was used less recently
    lru, gdsf = budget("lru", [hot, cold]), budget("gdsf", [hot, cold])
    for b in (lru, gdsf):
        b.accessed(hot, 50)
        b.accessed(cold, 1)
    assert [r.id for r in lru.eviction_order([hot, cold])] == ["hot", "cold"]
    assert [r.id for r in gdsf.eviction_order([hot, cold])] == ["cold", "hot"]


def test_a_model_never_measured_is_estimated_at_the_largest_measured_model_not_the_average():
    small, large, new = record("small"), record("large"), record("new")
    small.memory.footprint, small.memory.footprint_instances = 50 * 2**20, 1
    large.memory.footprint, large.memory.footprint_instances = 150 * 2**20, 1
    b = budget("gdsf", [small, large, new])
    assert b.estimate(new, 1) == 150 * 2**20
    assert b.estimate(new, 2) == 300 * 2**20
    declared = record("declared", memory_mb=20)
    assert b.estimate(declared, 1) == 20 * 2**20  # its package's declared memory comes before any guess


def test_the_server_defaults_are_the_policy_defaults():
    fields = Settings.model_fields
    assert fields["keep_alive_min_samples"].default == keepalive.MIN_SAMPLES
    assert fields["keep_alive_min_unloaded_secs"].default == keepalive.MIN_UNLOADED_SECS


def test_forgetting_a_deleted_model_drops_all_its_series_and_only_its():
    metrics = SnoozeMetrics()
    for model in ("gone", "kept"):
        metrics.cold_starts.labels(model=model, trigger="request").inc()
        metrics.prewarm_loads.labels(model=model).inc()
        metrics.prewarm_outcomes.labels(model=model, outcome="used").inc()
        metrics.cold_start_seconds.labels(model=model).observe(0.2)
        metrics.memory_bytes.labels(model=model).set(1e6)
        metrics.gpu_memory_bytes.labels(model=model, gpu="0").set(1e6)
        metrics.set_state(model, "ready")
    metrics.auth_failures.labels(surface="api", reason="missing").inc()
    metrics.forget("gone")
    text = metrics.render().decode()
    assert 'model="gone"' not in text
    for name in ("snooze_cold_starts_total", "snooze_prewarm_loads_total", "snooze_prewarm_outcomes_total",
                 "snooze_cold_start_seconds_count", "snooze_model_memory_bytes", "snooze_model_gpu_memory_bytes",
                 "snooze_model_state"):  # fmt: skip
        assert f"{name}{{" in text and any(
            line.startswith(name) and 'model="kept"' in line for line in text.splitlines()
        ), name
    assert 'snooze_auth_failures_total{reason="missing",surface="api"} 1.0' in text


def test_the_sweeper_wakes_for_a_policy_decision_due_before_its_next_pass():
    clock = Clock()
    w, _ = warmth(clock, keep_alive_min_samples=3, keep_alive_min_unloaded_secs=2)
    rec, other = record(keep_alive="adaptive", idle_timeout_secs=2), record("other", idle_timeout_secs=300)
    assert w.sweep_delay([rec, other], 5.0) == 5.0  # no policy has heard anything: the interval
    for t in (1000.0, 1008.0, 1016.0, 1024.0):  # a caller every 8 s
        w.request(rec, t)
    w.request(other, 1024.0)
    clock.now = 1024.5
    w.loaded(rec, "request", load_secs=0.5)
    w.unloaded(rec)
    prewarm_at = 1024.0 + 8 * 0.9 - 0.5
    assert w.sweep_delay([rec, other], 60.0) == pytest.approx(prewarm_at - clock.now)
    assert w.sweep_delay([rec, other], 1.0) == 1.0  # sooner passes stay
    clock.now = prewarm_at - 0.001  # never a busy loop right before the instant
    assert w.sweep_delay([rec, other], 60.0) == pytest.approx(MIN_SWEEP_GAP_SECS)
    clock.now = prewarm_at + 0.1
    assert w.prewarm_due(rec, clock.now)


def test_the_sweeps_policy_passes_walk_only_the_records_that_have_a_policy_and_are_still_current():
    clock = Clock()
    w, _ = warmth(clock)
    heard, never, replaced = record("heard"), record("never"), record("replaced")
    current = {r.id: r for r in (heard, never, replaced)}
    assert w.with_policy(current.get) == []
    w.request(heard, 1000.0)
    w.request(replaced, 1000.0)
    assert {r.id for r in w.with_policy(current.get)} == {"heard", "replaced"}
    current["replaced"] = record("replaced")  # a new record of the model (dropped, then made again): no policy yet
    del current["heard"]  # dropped (deleted)
    assert w.with_policy(current.get) == []
    w.request(current["replaced"], 1001.0)
    assert w.with_policy(current.get) == [current["replaced"]]


@pytest.mark.timeout(10)
def test_settle_yields_while_an_ended_transition_is_still_recorded():
    """Found by the machine (SNOOZE_MACHINE_SEED=832459210, run 56): settle() met a transition that had ended but
    whose done callback (which clears ``rec.op``) had not run yet; awaiting the finished task never yields, so the
    callback never ran and settle() spun forever, freezing the event loop."""
    import asyncio

    from controlplane.lifecycle.state import ModelStates

    async def go() -> None:
        states = ModelStates(None, SnoozeMetrics())  # type: ignore[arg-type]
        rec = record("m")
        ended = asyncio.get_running_loop().create_future()
        ended.set_result(None)
        rec.op = ended  # type: ignore[assignment]
        asyncio.get_running_loop().call_soon(setattr, rec, "op", None)  # the pending done callback
        await states.settle(rec)
        assert rec.op is None

    asyncio.run(go())


def test_waiting_for_transitions_is_bounded_and_cancels_what_is_left():
    """A stop's wait for running transitions: a hung one (an unload Triton never answers) is cancelled at the
    bound and named; one that ends in time is not touched."""

    async def run() -> tuple[list[str], bool, bool]:
        states = ModelStates(store=None, metrics=SnoozeMetrics())  # type: ignore[arg-type]
        hung, quick = record("hung"), record("quick")
        states.records = {"hung": hung, "quick": quick}
        hung.op = asyncio.create_task(asyncio.Event().wait())
        quick.op = asyncio.create_task(asyncio.sleep(0.01))
        left = await states.wait_all(timeout=0.2)
        return left, hung.op.cancelled(), quick.op.cancelled()

    assert asyncio.run(run()) == (["hung"], True, False)


def test_a_models_state_gauge_has_a_series_per_state_it_has_been_in():
    """A published model asleep costs one series, not one per state; the state now is 1, those it left are 0."""
    metrics = SnoozeMetrics()

    def series() -> dict[str, float]:
        return {
            line.split('state="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.render().decode().splitlines()
            if line.startswith('snooze_model_state{model="m"')
        }

    metrics.set_state("m", "unloaded")
    assert series() == {"unloaded": 1.0}
    for state in ("loading", "ready", "unloading", "unloaded", "unloaded"):
        metrics.set_state("m", state)
    assert series() == {"unloaded": 1.0, "loading": 0.0, "ready": 0.0, "unloading": 0.0}
    metrics.forget("m")
    assert series() == {}
    metrics.set_state("m", "ready")  # published again: one series again
    assert series() == {"ready": 1.0}
