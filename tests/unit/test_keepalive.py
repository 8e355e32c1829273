"""Keep-alive policies (controlplane/keepalive.py) and their virtual-time replay (bench/keepalive_replay.py).

Times are plain numbers (virtual seconds): the policies take every time as an argument."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from bench.keepalive_replay import SYNTHETIC, read_trace, replay, run
from controlplane import keepalive as ka
from controlplane.keepalive import Action, AdaptiveKeepAlive, FixedKeepAlive, Window, keep_alive_policy


def _feed(policy: FixedKeepAlive, times: list[float] | np.ndarray) -> None:
    for t in times:
        policy.on_request(float(t))


def _periodic(n: int, period: float = 600.0, jitter: float = 10.0, seed: int = 7) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.arange(1, n + 1) * period + rng.uniform(-jitter, jitter, n)


# ---------------------------------------------------------------------------------------------
# the fixed policy


def test_fixed_unloads_idle_timeout_after_the_last_request_or_load() -> None:
    policy = FixedKeepAlive(300)
    assert policy.decide(0, loaded=False) is Action.KEEP and policy.next_decision_at(0) is None
    policy.on_request(100)
    policy.on_loaded(101.5, load_secs=1.5)  # the cold start's load: the timeout counts from ready
    assert policy.keep_alive_until(100) == 400 and policy.prewarm_at(100) is None
    assert policy.decide(401, loaded=True) is Action.KEEP
    assert policy.next_decision_at(150) == 401.5
    assert policy.decide(401.5, loaded=True) is Action.UNLOAD
    assert policy.decide(500, loaded=False) is Action.KEEP  # never pre-warms
    policy.on_request(450)
    assert policy.decide(700, loaded=True) is Action.KEEP and policy.decide(750, loaded=True) is Action.UNLOAD
    assert policy.windows() == {
        "policy": "fixed",
        "pattern": False,
        "reason": "fixed idle timeout",
        "samples": 0,
        "keep_alive_secs": 300,
        "prewarm_after_secs": None,
        "prewarm_loads": 0,
        "prewarm_used": 0,
        "prewarm_wasted": 0,
        "prewarmed_unused": False,
    }


def test_policy_factory_follows_the_deployment() -> None:
    assert type(keep_alive_policy("fixed", 60)) is FixedKeepAlive
    adaptive = keep_alive_policy("adaptive", 60)
    assert isinstance(adaptive, AdaptiveKeepAlive) and adaptive.idle_timeout_secs == 60
    with pytest.raises(ValueError, match="'fixed' or 'adaptive'"):
        keep_alive_policy("smart", 60)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="idle_timeout_secs must be > 0"):
        FixedKeepAlive(0)


# ---------------------------------------------------------------------------------------------
# the adaptive policy


def test_adaptive_learns_a_periodic_caller_and_prewarms_before_the_next_call() -> None:
    policy = AdaptiveKeepAlive(300)
    times = _periodic(40)
    _feed(policy, times)
    policy.on_loaded(times[-1] + 0.5, load_secs=2.0)
    last = float(times[-1])
    w = policy.windows()
    assert w["pattern"] and w["samples"] == 39
    # gaps are 580-620 s: pre-warm ~10% before the shortest minus the load, keep ~10% past the longest
    assert 500 < w["prewarm_after_secs"] < 580 and 620 < w["keep_alive_secs"] < 700
    at, until = policy.prewarm_at(last), policy.keep_alive_until(last)
    assert at == pytest.approx(last + w["prewarm_after_secs"]) and until == pytest.approx(last + w["keep_alive_secs"])
    # unloaded between calls, loaded again before the next one, unloaded if it does not come
    assert policy.decide(last + 1, loaded=True) is Action.UNLOAD
    policy.on_unloaded(last + 1)
    assert policy.decide(at - 1, loaded=False) is Action.KEEP and policy.next_decision_at(last + 1) == at
    assert policy.decide(at, loaded=False) is Action.PREWARM
    policy.on_loaded(at + 2, prewarm=True, load_secs=2.0)
    assert policy.prewarmed_unused and policy.decide(at + 3, loaded=True) is Action.KEEP
    assert policy.decide(until, loaded=True) is Action.UNLOAD
    policy.on_unloaded(until)
    assert policy.decide(until + 1, loaded=False) is Action.KEEP  # no second pre-warm for the same call
    w = policy.windows()
    assert (w["prewarm_loads"], w["prewarm_used"], w["prewarm_wasted"], w["prewarmed_unused"]) == (1, 0, 1, False)


def test_a_prewarm_that_serves_the_next_call_counts_as_used() -> None:
    policy = AdaptiveKeepAlive(300)
    times = _periodic(20)
    _feed(policy, times[:-1])
    at = policy.prewarm_at(float(times[-2]))
    assert at is not None and policy.decide(at, loaded=False) is Action.PREWARM
    policy.on_loaded(at + 1, prewarm=True)
    policy.on_request(float(times[-1]))
    policy.on_unloaded(float(times[-1]) + 1)
    w = policy.windows()
    assert (w["prewarm_loads"], w["prewarm_used"], w["prewarm_wasted"]) == (1, 1, 0)


def test_adaptive_is_the_fixed_timeout_until_it_has_seen_enough_idle_times() -> None:
    policy = AdaptiveKeepAlive(300)
    _feed(policy, _periodic(ka.MIN_SAMPLES))  # n requests: n - 1 idle times
    w = policy.windows()
    assert not w["pattern"] and w["samples"] == ka.MIN_SAMPLES - 1
    assert w["reason"] == f"learning: {ka.MIN_SAMPLES - 1} of {ka.MIN_SAMPLES} idle times seen"
    assert (w["keep_alive_secs"], w["prewarm_after_secs"]) == (300, None)
    policy.on_request(ka.MIN_SAMPLES * 600.0 + 600)
    assert policy.windows()["pattern"] and policy.windows()["prewarm_after_secs"] is not None


def test_memoryless_traffic_gets_no_prewarm() -> None:
    """Poisson arrivals have no pattern to bet on: a busy model stays loaded past the longest idle time seen,
    a sparse one (requests slower than one per idle_timeout_secs) is let go after MIN_KEEP_ALIVE_SECS."""
    rng = np.random.default_rng(3)
    busy, sparse = AdaptiveKeepAlive(300), AdaptiveKeepAlive(300)
    _feed(busy, np.cumsum(rng.exponential(30, 500)))
    _feed(sparse, np.cumsum(rng.exponential(3600, 500)))
    assert busy.windows()["prewarm_after_secs"] is None and sparse.windows()["prewarm_after_secs"] is None
    longest = max(busy._idle)
    assert busy.windows()["keep_alive_secs"] >= longest * (1 + ka.MARGIN)
    assert sparse.windows()["keep_alive_secs"] == ka.MIN_KEEP_ALIVE_SECS
    assert "too sparse" in sparse.windows()["reason"]


def test_bursts_are_covered_and_the_silence_after_them_is_not() -> None:
    """Requests seconds apart with hour-long silences between bursts: keep-alive covers the gaps in a burst
    (at least MIN_KEEP_ALIVE_SECS), not the silences, although they are among the longest idle times."""
    rng = np.random.default_rng(5)
    times, t = [], 0.0
    for _ in range(6):
        t += 3600
        times += list(t + np.cumsum(rng.exponential(4, 25)))
        t = times[-1]
    policy = AdaptiveKeepAlive(300)
    _feed(policy, times)
    w = policy.windows()
    assert w["prewarm_after_secs"] is None and ka.MIN_KEEP_ALIVE_SECS <= w["keep_alive_secs"] < 120


def test_idle_history_is_bounded_and_follows_a_changed_caller() -> None:
    policy = AdaptiveKeepAlive(300)
    _feed(policy, _periodic(1000))
    assert policy.samples == ka.HISTORY
    t0 = policy.last_request
    _feed(policy, t0 + np.arange(1, ka.HISTORY + 1) * 20.0)  # now called every 20 s
    w = policy.windows()
    assert w["samples"] == ka.HISTORY and w["prewarm_after_secs"] is None
    assert w["keep_alive_secs"] == ka.MIN_KEEP_ALIVE_SECS  # 20 s gaps + 10% stay under the floor


def test_an_explicit_load_holds_the_model_for_the_fixed_timeout() -> None:
    policy = AdaptiveKeepAlive(300)
    times = _periodic(30)
    _feed(policy, times)
    last = float(times[-1])
    assert policy.decide(last + 10, loaded=True) is Action.UNLOAD  # the pattern says: unload until the pre-warm
    policy.on_loaded(last + 20, explicit=True)  # an operator's `snoozectl load`
    assert policy.decide(last + 30, loaded=True) is Action.KEEP
    assert policy.next_decision_at(last + 30) == last + 320
    assert policy.decide(last + 320, loaded=True) is Action.UNLOAD


def test_a_model_loaded_before_any_request_gets_the_fixed_timeout() -> None:
    policy = AdaptiveKeepAlive(120)
    policy.on_loaded(50)  # adopted at a restart, or loaded by the API: no request seen yet
    assert policy.decide(169, loaded=True) is Action.KEEP and policy.decide(170, loaded=True) is Action.UNLOAD


# ---------------------------------------------------------------------------------------------
# the replay


def test_replay_accounting_on_a_hand_computed_trace() -> None:
    """Fixed 10 s, cold start 1 s, requests at 0, 5, 30, 30.5, 100 over [0, 120]:
    0 cold (ready at 1), 5 warm, unload at 15; 30 cold, 30.5 waits 0.5 s for that load, unload at 41;
    100 cold, unload at 111. Loaded 0-15, 30-41, 100-111 = 37 s."""
    res = replay([30.5, 0, 5, 30, 100], FixedKeepAlive(10), cold_start_secs=1.0, start=0, end=120)
    assert (res.requests, res.warm, res.cold, res.request_loads, res.prewarm_loads) == (5, 1, 4, 3, 0)
    assert res.wait_s == pytest.approx(3.5) and res.loaded_s == pytest.approx(37)
    assert res.warm_pct == pytest.approx(20) and res.loaded_pct == pytest.approx(100 * 37 / 120)


class _ScriptedWindow(AdaptiveKeepAlive):
    """The adaptive policy's decisions on a window given by hand: pre-warm 8 s after a request, keep 20 s."""

    def window(self) -> Window:
        return Window(20.0, 8.0, pattern=True)


def test_replay_accounting_of_prewarms_on_a_hand_computed_trace() -> None:
    """Cold start 1 s, requests at 0, 10, 40 over [0, 60], window: pre-warm at +8 s, keep until +20 s.
    0: cold (load 0-1), unload when served; pre-warm 8-9; 10: warm, unload; pre-warm 18-19, unused, unloaded
    at 30 (wasted); 40: cold (load 40-41), unload; pre-warm at 48, still loaded at the end.
    Loaded 0-1, 8-10, 18-30, 40-41, 48-60 = 28 s."""
    policy = _ScriptedWindow(300)
    res = replay([0, 10, 40], policy, cold_start_secs=1.0, start=0, end=60)
    assert (res.requests, res.warm, res.cold, res.request_loads) == (3, 1, 2, 2)
    assert (res.prewarm_loads, res.wasted_prewarms) == (3, 1)
    assert res.wait_s == pytest.approx(2) and res.loaded_s == pytest.approx(28)
    w = policy.windows()
    assert (w["prewarm_loads"], w["prewarm_used"], w["prewarm_wasted"], w["prewarmed_unused"]) == (3, 1, 1, True)


def test_always_on_is_loaded_before_the_first_request() -> None:
    res = replay([5, 50], FixedKeepAlive(math.inf), cold_start_secs=1.0, start=0, end=100, preloaded=True)
    assert (res.cold, res.warm, res.loaded_s) == (0, 2, 100)


def test_read_trace_groups_by_model_and_names_bad_lines(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("model,timestamp\n# a comment\na,20\nb,5.5\na,10\n")
    assert read_trace(trace) == {"a": [20.0, 10.0], "b": [5.5]}
    trace.write_text("a,1\na,soon\n")
    with pytest.raises(ValueError, match=r"t\.csv:2: timestamp 'soon' is not a number"):
        read_trace(trace)
    trace.write_text("a,1,2\n")
    with pytest.raises(ValueError, match=r"t\.csv:1: expected 'model,timestamp'"):
        read_trace(trace)


# ---------------------------------------------------------------------------------------------
# the test, on the seeded synthetic traces


@pytest.fixture(scope="module")
def synthetic() -> dict:
    return run()


@pytest.mark.parametrize("trace", [spec.name for spec in SYNTHETIC])
def test_adaptive_beats_every_fixed_timeout_at_no_more_memory(synthetic: dict, trace: str) -> None:
    tr = synthetic["traces"][trace]
    rows = {r["policy"]: r for r in tr["rows"]}
    adaptive = rows.pop("adaptive")
    assert tr["days"] >= 1
    cheaper = [r for name, r in rows.items() if name.startswith("fixed") and r["loaded_s"] <= adaptive["loaded_s"]]
    assert all(r["cold"] > adaptive["cold"] for r in cheaper), (adaptive, cheaper)
    assert tr["verdict"]["ok"]


@pytest.mark.parametrize("trace", [spec.name for spec in SYNTHETIC if spec.periodic])
def test_periodic_trace_is_mostly_warm_at_under_half_the_loaded_time(synthetic: dict, trace: str) -> None:
    adaptive = synthetic["traces"][trace]["rows"][-1]
    assert adaptive["policy"] == "adaptive" and adaptive["warm_pct"] >= 90 and adaptive["loaded_pct"] < 50
    assert adaptive["prewarm_loads"] > 0.8 * synthetic["traces"][trace]["requests"]


def test_bench_replays_a_trace_file(tmp_path: Path) -> None:
    from bench.__main__ import main

    t = _periodic(60, period=300, jitter=5)
    (tmp_path / "trace.csv").write_text("model,timestamp\n" + "".join(f"torch-mlp,{x}\nmine,{x}\n" for x in t))
    assert main(["--replay", str(tmp_path / "trace.csv"), "--out-dir", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    section = report["sections"]["keepalive_replay"]
    assert section["cold_start_secs"] == {"mine": 1.0, "torch-mlp": 1.31}
    assert set(section["traces"]) == {"mine", "torch-mlp"} and section["traces"]["mine"]["requests"] == 60
    text = (tmp_path / "out" / "report.md").read_text()
    assert "## Keep-alive policies replayed in virtual time: trace" in text
    assert (tmp_path / "out" / "plots" / "keepalive_replay.png").stat().st_size > 0


def test_a_server_may_lower_min_samples_and_min_unloaded_for_callers_with_a_period_of_seconds() -> None:
    """The done-when's caller (every 8 s, idle timeout 2 s): the defaults keep it loaded (unloading for under 60 s
    is not worth a load); lowered, it is unloaded after each request and pre-warmed before the next, after three
    idle times (fewer than TAIL_SAMPLES + 1: the tail estimate works with what there is)."""
    times = 1000 + np.arange(12) * 8.0
    default = keep_alive_policy("adaptive", 2)
    _feed(default, times)
    assert default.windows()["prewarm_after_secs"] is None
    tuned = keep_alive_policy("adaptive", 2, min_samples=3, min_unloaded_secs=2)
    _feed(tuned, times[:3])
    assert not tuned.windows()["pattern"] and tuned.windows()["reason"] == "learning: 2 of 3 idle times seen"
    tuned.on_request(float(times[3]))
    tuned.on_loaded(float(times[3]) + 0.5, load_secs=0.5)
    w = tuned.windows()
    assert w["pattern"] and w["min_samples"] == 3 and w["prewarm_after_secs"] == pytest.approx(8 * 0.9 - 0.5)
    assert tuned.decide(float(times[3]) + 1, loaded=True) is Action.UNLOAD
    with pytest.raises(ValueError, match="min_samples must be >= 1"):
        AdaptiveKeepAlive(2, min_samples=0)


def test_the_fixed_timeout_counts_from_the_end_of_a_forward_the_learned_window_from_the_request() -> None:
    fixed, adaptive = FixedKeepAlive(10), AdaptiveKeepAlive(10, min_samples=1, min_unloaded_secs=0)
    for policy in (fixed, adaptive):
        _feed(policy, [0.0, 100.0])
        policy.on_served(103.0)  # the activator's forward of the request at 100 ended at 103
    assert fixed.keep_alive_until(100) == 110 and fixed.next_decision_at(104) == 113
    assert adaptive.next_decision_at(100.5) == pytest.approx(100 + adaptive.windows()["prewarm_after_secs"])


# ---------------------------------------------------------------------------------------------
# the doze time (a preforked model's worker ends, its stub stays loaded)


def _gaps(policy: FixedKeepAlive, gaps: list[float]) -> None:
    _feed(policy, np.cumsum([1.0, *gaps]))


def test_the_doze_time_is_the_servers_until_a_pattern_is_learned() -> None:
    fixed, adaptive = FixedKeepAlive(300), AdaptiveKeepAlive(300)
    for policy in (fixed, adaptive):
        _gaps(policy, [20.0] * (ka.MIN_SAMPLES - 1))
        assert policy.doze_after(30.0) == 30.0
    _gaps(fixed, [20.0] * 50)
    assert fixed.doze_after(30.0) == 30.0  # a fixed policy never learns one


@pytest.mark.parametrize(
    ("gaps", "doze"),
    [
        # every 20 s: awake across the gap (a doze wake would cost more than 20 s of memory at the doze price)
        ([20.0] * 30, 20.0 * (1 + ka.MARGIN)),
        # every 2 s: awake across it, but never dozed in a pause shorter than MIN_DOZE_SECS
        ([2.0] * 30, ka.MIN_DOZE_SECS),
        # every 100 s: 100 s awake costs more than the wake it saves (30 s at the doze price): doze soon
        ([100.0] * 30, ka.MIN_DOZE_SECS),
        # mostly 10 s apart, one gap in five an hour: awake over the short gaps only
        ([10.0, 10.0, 10.0, 10.0, 3600.0] * 8, 10.0 * (1 + ka.MARGIN)),
    ],
)
def test_the_learned_doze_time_follows_the_idle_times(gaps: list[float], doze: float) -> None:
    policy = AdaptiveKeepAlive(300)
    _gaps(policy, gaps)
    assert policy.doze_after(30.0) == pytest.approx(doze)
    assert policy.doze_after(30.0) <= policy.window().keep_alive_secs  # it dozes before it is unloaded
    policy.on_request(1e7)  # a new idle time: learned again
    assert policy.doze_after(30.0) == pytest.approx(policy.doze_after(99.0))
