"""The memory budget holds with measured memory, wherever Triton runs.

Three models of ~150 MiB each under a 480 MiB budget (tritonserver's own memory counts too): two fit, the
third evicts the least recently used one (the policy pinned to ``lru``). The footprints are measured (the Pss of
each model's processes), not declared, so this needs the control plane to see Triton's processes: as its child,
and in a process of its own (the deployed topology, where it once went unmeasured and all three stayed loaded).
With preforked workers a model is charged its stub plus its worker (Pss), the preloaded parent is
counted beside the models (a budget larger by about the parent's size), and an evicted model's
worker is gone: its memory left with the unload.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from harness.reliability import infer_once, report
from harness.serve import alive_pids

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
BALLAST_MB = 150
# two ~175 MiB models (Pss) fit beside tritonserver itself (~50 MiB: the budget is for the whole Triton tree), three do
# not; preforked: plus the numpy-only parent (~40 MiB), counted once
BUDGET_MB = {"in-stub": 480, "preforked": 540}


@pytest.fixture(scope="module")
def serve(serve_factory, package, topology, worker):
    # LRU: the victim is the least recently used (GDSF, the default, would weigh the three models' near-equal
    # load times and sizes; its choices are tested in tests/model/test_lifecycle_budget.py)
    # Dozing off (doze_after_secs 0): an eviction here unloads; a preforked victim that dozes first instead is
    # tests/model/test_doze.py's (and a dozing model's memory end to end, tests/reliability/test_doze_stack.py's)
    serve = serve_factory(
        "budget", topology=topology, memory_budget_mb=str(BUDGET_MB[worker]), eviction_policy="lru", doze_after_secs="0"
    )
    serve.start()
    for name in "abc":
        serve.publish(f"big-{name}", package, params={"ballast_mb": BALLAST_MB}, worker=worker)
    serve.worker = worker
    yield serve
    serve.stop()  # when its topology and worker are done: not idling beside the next ones


async def test_the_budget_evicts_the_least_recently_used_model(serve):
    x = np.ones((1, 2), np.float32)
    budget_mb = BUDGET_MB[serve.worker]
    peak = 0
    first_worker = None
    for name in "abc":
        answer = await infer_once(serve, f"big-{name}", "grpc", x)
        assert not isinstance(answer, str), answer
        peak = max(peak, (await asyncio.to_thread(serve.rss))["triton_tree"])
        if name == "a" and serve.worker == "preforked":
            [first_worker] = await asyncio.to_thread(serve.worker_pids, "big-a")
    statuses = {name: await asyncio.to_thread(serve.status, f"big-{name}") for name in "abc"}
    loaded = {n: s for n, s in statuses.items() if s["state"] == "ready"}
    runtime = await asyncio.to_thread(serve.api().runtime)
    report(
        f"memory budget ({serve.topology}, {serve.worker})",
        budget_mb=budget_mb,
        parents_mb=[round((p["memory_bytes"] or 0) / MIB) for p in runtime["preloaded_parents"]],
        loaded=sorted(loaded),
        model_mb={n: round((s["memory_bytes"] or 0) / MIB) for n, s in loaded.items()},
        triton_tree_peak_mb=round(peak / MIB),
    )
    assert statuses["a"]["state"] == "unloaded" and statuses["a"]["reason"] == "memory", statuses["a"]
    assert sorted(loaded) == ["b", "c"]
    for status in loaded.values():
        assert status["memory_source"] == "measured", status
        assert status["memory_bytes"] >= BALLAST_MB * MIB, status  # a worker's own pages are its model's
    assert sum(s["memory_bytes"] for s in loaded.values()) + runtime["overhead_bytes"] <= budget_mb * MIB
    if serve.worker == "preforked":
        [parent] = runtime["preloaded_parents"]
        assert parent["preload"] == ["numpy"] and parent["workers"] == 2 and runtime["overhead_bytes"] > 0, runtime
        assert first_worker is not None and alive_pids([first_worker]) == []  # evicted: its worker is gone
    else:
        assert runtime["preloaded_parents"] == [] and runtime["overhead_bytes"] == 0, runtime
    assert await asyncio.to_thread(serve.metric, "snooze_evictions_total", model="big-a", reason="memory") == 1


async def test_an_evicted_models_processes_are_ended_and_it_reloads_right_away(serve):
    """b and c loaded (requested in that order; a, if loaded, is evicted for them). A request for a evicts an idle
    model: its processes are ended as soon as Triton has taken it out of service (not after the python backend's
    1 s health probe), which is not a crash; b, requested right after (while Triton may still be finishing an
    unload), loads again if it was evicted and answers right. Asserted: what the budget promises (it holds, the
    last model requested is loaded, only idle models left and only for memory, each eviction ended its processes),
    not which of the idle models LRU picked: their last accesses are milliseconds apart."""
    x = np.full((1, 2), 3.0, np.float32)
    for name in "bc":
        answer = await infer_once(serve, f"big-{name}", "grpc", x)
        assert not isinstance(answer, str), answer
    loaded_before = {n for n in "abc" if (await asyncio.to_thread(serve.status, f"big-{n}"))["state"] == "ready"}
    assert loaded_before == {"b", "c"}, loaded_before  # three do not fit: a made room for them
    processes = {n: await asyncio.to_thread(serve.model_pids, f"big-{n}", serve.worker) for n in "bc"}
    assert all(processes.values()), processes
    ended_before = await asyncio.to_thread(serve.metric, "snooze_unload_seconds_count", how="ended")
    evicted_before = {n: await asyncio.to_thread(serve.metric, "snooze_evictions_total", model=f"big-{n}",
                                                 reason="memory") for n in "abc"}  # fmt: skip
    answer = await infer_once(serve, "big-a", "http", x)
    assert not isinstance(answer, str), answer
    left = [n for n in "bc" if (await asyncio.to_thread(serve.status, f"big-{n}"))["state"] != "ready"]
    assert len(left) == 1, left  # one of them made room for a
    assert alive_pids(processes[left[0]]) == []  # its memory left with the eviction
    answer = await infer_once(serve, "big-b", "grpc", x)  # its old instance may still be leaving Triton
    assert not isinstance(answer, str), answer
    np.testing.assert_array_equal(answer, x * 2.0)
    statuses = {n: await asyncio.to_thread(serve.status, f"big-{n}") for n in "abc"}
    loaded = {n for n, s in statuses.items() if s["state"] == "ready"}
    assert "b" in loaded and len(loaded) == 2, statuses
    for n in set("abc") - loaded:
        assert statuses[n]["state"] == "unloaded" and statuses[n]["reason"] == "memory", statuses[n]
    assert statuses["b"]["last_crash"] is None, statuses["b"]
    assert sum(statuses[n]["memory_bytes"] for n in loaded) <= BUDGET_MB[serve.worker] * MIB, statuses
    assert await asyncio.to_thread(serve.metric, "snooze_recoveries_total", model="big-b", cause="dead_stub") == 0
    evictions = sum(
        [
            await asyncio.to_thread(serve.metric, "snooze_evictions_total", model=f"big-{n}", reason="memory")
            - evicted_before[n]
            for n in "abc"
        ]
    )
    ended = await asyncio.to_thread(serve.metric, "snooze_unload_seconds_count", how="ended") - ended_before
    report(f"fast eviction ({serve.topology}, {serve.worker})", evictions=evictions, evictions_ended=ended,
           evicted=sorted(set("abc") - loaded))  # fmt: skip
    assert evictions >= 1 and ended == evictions  # every eviction ended its processes
