"""Keep-alive live: the adaptive policy in the real stack, against the fixed timeout under the same traffic.

Two copies of one example model are published, one with ``keep_alive = "adaptive"`` and one with the fixed
policy, both with an idle timeout shorter than the period of their caller. A client sends one request to each
through the gateway every ``period_s`` seconds. Per request the run notes whether it waited for the model to
wake (``snooze_wake_waits``: a cold start, or a pre-warm still loading) and its latency; a sampler notes every
100 ms whether each model is in memory (loading, ready or unloading). The adaptive policy learns from
``min_samples`` idle times (``SNOOZE_KEEP_ALIVE_MIN_SAMPLES``, 10 by default) and may unload between requests
when the model then stays out ``min_unloaded_s`` (``SNOOZE_KEEP_ALIVE_MIN_UNLOADED_SECS``, 60 s by default):
both lowered so that a period of seconds shows in a short run.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.coldstart import _request
from bench.common import API_KEY, EXAMPLES, gateway_urls, serving_stack

SAMPLE_S = 0.1
LOADED_STATES = ("loading", "ready", "unloading")
POLICIES = ("adaptive", "fixed")


def _sample(metrics: Any, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def _sample_states(stack: Any, models: dict[str, str], samples: dict[str, list[tuple[float, str]]]) -> None:
    while True:
        now = time.perf_counter()
        for policy, model in models.items():
            samples[policy].append((now, stack.lifecycle.status(model).state.value))
        await asyncio.sleep(SAMPLE_S)


def _loaded_share(samples: list[tuple[float, str]], start: float, end: float) -> float:
    inside = [state for t, state in samples if start <= t <= end]
    return sum(state in LOADED_STATES for state in inside) / len(inside) if inside else 0.0


def _unloaded_between(samples: list[tuple[float, str]], sent: list[float]) -> int:
    """Gaps between consecutive requests in which the model was seen out of memory."""
    return sum(
        any(a < t < b and state == "unloaded" for t, state in samples) for a, b in zip(sent, sent[1:], strict=False)
    )


async def run(
    root: Path,
    *,
    period_s: float,
    idle_timeout_s: float,
    requests: int,
    min_samples: int,
    min_unloaded_s: float,
    model: str = "numpy-linear",
) -> dict[str, Any]:
    models = {policy: f"{model}-{policy}" for policy in POLICIES}
    entries = [
        {"id": models[p], "path": EXAMPLES / model, "idle_timeout_secs": idle_timeout_s, "keep_alive": p}
        for p in POLICIES
    ]
    overrides = {
        "sweep_interval_secs": 0.25,
        "keep_alive_min_samples": min_samples,
        "keep_alive_min_unloaded_secs": min_unloaded_s,
    }
    async with serving_stack(root / "stack", entries, **overrides) as stack:
        metrics = stack.lifecycle.metrics
        base = gateway_urls(stack)["http"]
        bodies = {p: _request(stack.store.get(m)) for p, m in models.items()}
        rows: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
        samples: dict[str, list[tuple[float, str]]] = {p: [] for p in POLICIES}
        sampler = asyncio.create_task(_sample_states(stack, models, samples))

        async def call(http: aiohttp.ClientSession, policy: str) -> None:
            body, headers = bodies[policy]
            waits = _sample(metrics, "snooze_wake_waits_total", model=models[policy])
            start = time.perf_counter()
            async with http.post(f"{base}/v2/models/{models[policy]}/infer", data=body, headers=headers) as r:
                await r.read()
                status = r.status
            latency = time.perf_counter() - start
            cold = _sample(metrics, "snooze_wake_waits_total", model=models[policy]) > waits
            rows[policy].append({"sent": start, "status": status, "latency_s": latency, "warm": not cold})

        t0 = time.perf_counter() + 0.5
        try:
            async with aiohttp.ClientSession(headers={"X-API-Key": API_KEY}) as http:
                for k in range(requests):
                    await asyncio.sleep(max(0.0, t0 + k * period_s - time.perf_counter()))
                    for policy in POLICIES:  # one after the other: a cold load beside a warm request slows it
                        await call(http, policy)
                end = t0 + (requests - 1) * period_s
                await asyncio.sleep(2 * overrides["sweep_interval_secs"])  # the sweeper hears the last request
        finally:
            sampler.cancel()
        out = {}
        for p, m in models.items():
            policy = stack.lifecycle.warmth.policy(stack.lifecycle.states.record(m))
            out[p] = _summary(rows[p], samples[p], metrics, m, t0=t0, end=end, learned_from=min_samples + 1)
            out[p]["windows"] = policy.windows()
            out[p]["idle_times_s"] = [round(x, 2) for x in policy.idle_times()]
    return {
        "model": model,
        "period_s": period_s,
        "idle_timeout_s": idle_timeout_s,
        "requests": requests,
        "min_samples": min_samples,
        "min_unloaded_s": min_unloaded_s,
        "policies": out,
    }


def _summary(
    rows: list[dict[str, Any]],
    samples: list[tuple[float, str]],
    metrics: Any,
    model: str,
    *,
    t0: float,
    end: float,
    learned_from: int,
) -> dict[str, Any]:
    warm = [r for r in rows if r["warm"]]
    later = rows[learned_from:]  # the requests after the adaptive policy had its min_samples idle times
    lat_warm = [r["latency_s"] for r in warm]
    lat_cold = [r["latency_s"] for r in rows if not r["warm"]]
    return {
        "requests": len(rows),
        "errors": sum(r["status"] != 200 for r in rows),
        "warm": len(warm),
        "warm_pct": round(100 * len(warm) / len(rows), 1),
        "warm_after_learning": sum(r["warm"] for r in later),
        "requests_after_learning": len(later),
        "request_loads": int(_sample(metrics, "snooze_cold_starts_total", model=model, trigger="request")),
        "prewarm_loads": int(_sample(metrics, "snooze_prewarm_loads_total", model=model)),
        "prewarm_used": int(_sample(metrics, "snooze_prewarm_outcomes_total", model=model, outcome="used")),
        "prewarm_wasted": int(_sample(metrics, "snooze_prewarm_outcomes_total", model=model, outcome="wasted")),
        "idle_unloads": int(_sample(metrics, "snooze_idle_unloads_total", model=model)),
        "unloaded_between_requests": _unloaded_between(samples, [r["sent"] for r in rows]),
        "loaded_pct": round(100 * _loaded_share(samples, t0, end), 1),
        "latency_warm_ms": round(1000 * statistics.median(lat_warm), 1) if lat_warm else None,
        "latency_cold_ms": round(1000 * statistics.median(lat_cold), 1) if lat_cold else None,
        "warm_by_request": [r["warm"] for r in rows],
    }
