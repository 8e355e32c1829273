"""The memory budget holds with measured memory, wherever Triton runs.

Three models of ~150 MiB each under a 400 MiB budget: two fit, the third evicts the least recently used
one. The footprints are measured (the RSS of each model's processes), not declared, so this needs the
control plane to see Triton's processes: as its child, and in a process of its own (the deployed
topology, where it once went unmeasured and all three stayed loaded).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from reliability_helpers import infer_once, report

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
BALLAST_MB = 150
BUDGET_MB = 400


@pytest.fixture(scope="module")
def serve(serve_factory, package, topology):
    serve = serve_factory("budget", topology=topology, memory_budget_mb=str(BUDGET_MB))
    serve.start()
    for name in "abc":
        serve.publish(f"big-{name}", package, params={"ballast_mb": BALLAST_MB})
    return serve


async def test_the_budget_evicts_the_least_recently_used_model(serve):
    x = np.ones((1, 2), np.float32)
    peak = 0
    for name in "abc":
        answer = await infer_once(serve, f"big-{name}", "grpc", x)
        assert not isinstance(answer, str), answer
        peak = max(peak, (await asyncio.to_thread(serve.rss))["triton_tree"])
    statuses = {name: await asyncio.to_thread(serve.status, f"big-{name}") for name in "abc"}
    loaded = {n: s for n, s in statuses.items() if s["state"] == "ready"}
    report(
        f"memory budget ({serve.topology})",
        budget_mb=BUDGET_MB,
        loaded=sorted(loaded),
        model_mb={n: round((s["memory_bytes"] or 0) / MIB) for n, s in loaded.items()},
        triton_tree_peak_mb=round(peak / MIB),
    )
    assert statuses["a"]["state"] == "unloaded" and statuses["a"]["reason"] == "memory", statuses["a"]
    assert sorted(loaded) == ["b", "c"]
    for status in loaded.values():
        assert status["memory_source"] == "measured", status
        assert status["memory_bytes"] >= BALLAST_MB * MIB, status
    assert sum(s["memory_bytes"] for s in loaded.values()) <= BUDGET_MB * MIB
    assert await asyncio.to_thread(serve.metric, "snooze_evictions_total", model="big-a", reason="memory") == 1
