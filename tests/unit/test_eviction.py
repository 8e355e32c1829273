"""The eviction policies' maths (``controlplane/lifecycle/memory/eviction.py``) and the virtual-time replay that
compares them (``bench/eviction_replay.py``)."""

from __future__ import annotations

import pytest

from bench import eviction_replay as er
from controlplane.lifecycle.memory.eviction import (
    MIB,
    MIN_AGING_WINDOW,
    Candidate,
    EvictionPolicy,
    GreedyDualSizeFrequency,
    eviction_policy,
)


def c(model_id: str, size_mib: float = 100, cost: float = 1.0, last: float = 0.0) -> Candidate:
    return Candidate(model_id, size_mib * MIB, cost, last)


def test_lru_orders_by_last_access_only():
    lru = EvictionPolicy()
    lru.accessed("a", 100)
    assert [x.id for x in lru.order([c("a", last=1), c("b", last=3), c("cc", last=2)])] == ["a", "cc", "b"]


def test_gdsf_priority_is_the_clock_plus_frequency_times_cost_over_size():
    g = GreedyDualSizeFrequency()
    g.accessed("a", 4)
    assert g.priority(c("a", size_mib=200, cost=0.5)) == pytest.approx(4 * 0.5 / 200)
    assert g.priority(c("new", size_mib=50, cost=1.0)) == pytest.approx(1 / 50)  # F at least 1
    g.evicted(c("new", size_mib=50, cost=1.0))
    assert g.clock == pytest.approx(1 / 50)
    g.loaded("b")  # a model loaded now starts from the clock
    assert g.priority(c("b", size_mib=100, cost=1.0)) == pytest.approx(1 / 50 + 1 / 100)
    assert g.priority(c("a", size_mib=200, cost=0.5)) == pytest.approx(4 * 0.5 / 200)  # a's base stays


def test_gdsf_evicts_the_large_cheap_rarely_used_model_first():
    g = GreedyDualSizeFrequency()
    for m, n in (("hot", 20), ("warm", 5), ("once", 1), ("big", 5)):
        g.accessed(m, n)
    order = g.order([c("hot"), c("warm"), c("once"), c("big", size_mib=1000), c("slow", cost=30.0)])
    assert [x.id for x in order] == ["big", "once", "warm", "hot", "slow"]


def test_gdsf_clock_lets_a_model_unused_since_many_evictions_fall_behind_a_fresh_one():
    g = GreedyDualSizeFrequency()
    g.accessed("old", 3)  # base 0, H = 0.03
    for i in range(10):  # evictions raise the clock
        g.evicted(c(f"x{i}", cost=float(i + 1)))
    g.accessed("fresh", 1)  # base = clock = 0.1, H = 0.11
    assert [x.id for x in g.order([c("old"), c("fresh")])] == ["old", "fresh"]


def test_gdsf_frequency_survives_an_unload_and_halves_with_age():
    g = GreedyDualSizeFrequency()
    g.accessed("a", 30)
    g.evicted(c("a"))  # unloaded: its frequency stays
    g.loaded("a")
    assert g.frequency["a"] == 30
    g.accessed("b", MIN_AGING_WINDOW - 30)  # the window (at least MIN_AGING_WINDOW requests) is reached: halve
    assert g.halvings == 1 and g.frequency["a"] == 15 and g.frequency["b"] == (MIN_AGING_WINDOW - 30) / 2
    g.forget("a")
    assert "a" not in g.frequency


def test_an_unknown_policy_name_is_refused_with_the_choices():
    assert eviction_policy("lru").name == "lru" and eviction_policy("gdsf").name == "gdsf"
    with pytest.raises(ValueError, match="lru, gdsf"):
        eviction_policy("fifo")


def test_the_replay_charges_each_miss_its_load_time_and_evicts_in_the_policys_order():
    models = {"a": er.ReplayModel(100, 1.0), "b": er.ReplayModel(100, 2.0), "c": er.ReplayModel(100, 4.0)}
    res = er.replay(["a", "b", "a", "c", "b"], models, 200, EvictionPolicy())
    # LRU: c evicts b (a was used later), so the last b misses
    assert (res.hits, res.loads, res.cold_start_s) == (1, 4, 1.0 + 2.0 + 4.0 + 2.0)


def most_hits(seq: str, slots: int, cache: frozenset[str] = frozenset()) -> int:
    """Every eviction choice tried: the most hits possible."""
    if not seq:
        return 0
    head, rest = seq[0], seq[1:]
    if head in cache:
        return 1 + most_hits(rest, slots, cache)
    if len(cache) < slots:
        return most_hits(rest, slots, cache | {head})
    return max(most_hits(rest, slots, (cache - {out}) | {head}) for out in cache)


@pytest.mark.parametrize("seq", ["abcabdabcd", "abcdabcdab", "aabbccabcabdd", "abacadaeabac"])
def test_belady_has_the_most_hits_possible_with_unit_sizes(seq):
    models = {m: er.ReplayModel(1, 1.0) for m in set(seq)}
    opt = er.belady(list(seq), models, 2)
    assert opt.hits == most_hits(seq, 2)
    for policy in ("lru", "gdsf"):
        assert er.replay(list(seq), models, 2.0, eviction_policy(policy)).hits <= opt.hits


def test_the_replay_section_runs_every_trace_and_says_whether_the_default_is_at_or_above_lru():
    out = er.run(requests=600)
    assert set(out["traces"]) == {t.name for t in er.TRACES}
    for trace in out["traces"].values():
        policies = [r["policy"] for r in trace["unit"]["rows"]]
        assert policies == ["lru", "gdsf", er.BELADY]
        best = max(r["hits"] for r in trace["unit"]["rows"])
        assert trace["unit"]["rows"][-1]["hits"] == best  # nothing beats the optimum
        assert trace["sized"]["verdict"]["ok"] == (
            trace["sized"]["rows"][1]["hits"] >= trace["sized"]["rows"][0]["hits"]
        )
