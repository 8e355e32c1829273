"""Mixed soak: several models, scale-to-zero cycles, autoscaling up and down, continuous traffic.

Each cycle: a burst on a slow model (it scales up to 2 instances) and light traffic on fast-a, then
traffic on fast-b only (slow scales down and sleeps, fast-a sleeps; fast-b sleeps during the next
burst). Zero failed requests, and the resident memory of the control plane + the Triton process
tree, measured with every model asleep, grows less than 5% from the first steady point to the last.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from harness.probes import until_async
from harness.reliability import Traffic, report, summary

pytestmark = pytest.mark.integration

BURST_SECS, CALM_SECS = 4.0, 5.0
MODELS = ("slow", "fast-a", "fast-b")


@pytest.fixture(scope="module")
def serve(serve_factory, package):
    serve = serve_factory("soak", autoscale_queue_threshold="2", autoscale_window_secs="0.5")
    serve.start()
    serve.publish("slow", package, params={"predict_sleep": 0.03}, max_batch_size=1, max_instances=2,
                  idle_timeout_secs=3)  # fmt: skip
    for model in ("fast-a", "fast-b"):
        serve.publish(model, package, idle_timeout_secs=2)
    return serve


async def cycle(serve, results: list) -> None:
    burst = [
        Traffic(serve, {"slow": 2.0}, grpc_clients=8).start(),
        Traffic(serve, {"fast-a": 2.0}, grpc_clients=1, http_clients=1, pause=0.01).start(),
    ]
    await asyncio.sleep(BURST_SECS)
    for t in burst:
        results += await t.stop()
    calm = Traffic(serve, {"fast-b": 2.0}, grpc_clients=1, http_clients=1, pause=0.01).start()
    await asyncio.sleep(CALM_SECS)
    results += await calm.stop()


async def steady_rss(serve) -> dict[str, int]:
    """With every model asleep (a point the stack returns to each cycle): median of a few samples."""
    await until_async(
        lambda: all(serve.status(m)["state"] == "unloaded" for m in MODELS) and serve.stub_pids() == [],
        "every model to sleep",
    )
    samples = []
    for _ in range(5):
        samples.append(await asyncio.to_thread(serve.rss))
        await asyncio.sleep(0.2)
    return {k: int(statistics.median(s[k] for s in samples)) for k in samples[0]}


async def soak(serve, seconds: float, name: str) -> None:
    results: list = []
    await cycle(serve, results)  # warm-up: first loads, allocator pools, caches
    before = await steady_rss(serve)
    ups = await asyncio.to_thread(serve.metric, "snooze_scale_events_total", model="slow", direction="up")
    unloads = await asyncio.to_thread(serve.metric, "snooze_idle_unloads_total", model="fast-a")
    cycles, deadline = 0, time.monotonic() + seconds
    while cycles == 0 or time.monotonic() < deadline:  # at least one cycle
        await cycle(serve, results)
        cycles += 1
    after = await steady_rss(serve)
    metric = serve.metric
    scaled_up = await asyncio.to_thread(metric, "snooze_scale_events_total", model="slow", direction="up") - ups
    scaled_down = await asyncio.to_thread(metric, "snooze_scale_events_total", model="slow", direction="down")
    idle_unloads = await asyncio.to_thread(metric, "snooze_idle_unloads_total", model="fast-a") - unloads
    total = summary(results)
    growth = {k: (after[k] - before[k]) / before[k] * 100 for k in before}
    overall = (sum(after.values()) - sum(before.values())) / sum(before.values()) * 100
    report(
        name,
        cycles=cycles,
        failed=f"{total['failed']}/{total['total']}",
        scale_ups=int(scaled_up),
        scale_downs_total=int(scaled_down),
        fast_a_idle_unloads=int(idle_unloads),
        rss_before_mb={k: round(v / 2**20, 1) for k, v in before.items()},
        rss_after_mb={k: round(v / 2**20, 1) for k, v in after.items()},
        rss_growth_pct=round(overall, 2),
        rss_growth_pct_parts={k: round(v, 2) for k, v in growth.items()},
        errors=total["errors"],
    )
    assert total["failed"] == 0, total
    assert scaled_up >= 1 and scaled_down >= 1 and idle_unloads >= cycles
    assert overall < 5.0, (before, after)


async def test_soak_one_cycle(serve):
    """The default tier: one measured cycle after the warm-up one (about 25 s); the longer runs are slow."""
    await soak(serve, 0, "mixed soak, one cycle")


@pytest.mark.slow
async def test_soak_30s(serve):
    await soak(serve, 30, "mixed soak 30 s")


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_soak_5min(serve):
    await soak(serve, 300, "mixed soak 5 min")
