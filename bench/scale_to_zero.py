"""Scale to zero: resident memory of the Triton process tree (server + python stubs) over one
load -> traffic -> idle-unload cycle, sampled every 100 ms by a thread (not the event loop)."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from bench._load import Job, LoadWorker
from bench.common import API_KEY, EXAMPLES, gateway_urls, serving_stack, wait_state

INTERVAL = 0.1
TOLERANCE = 0.05


class RssSampler(threading.Thread):
    def __init__(self, read: Any, interval: float = INTERVAL) -> None:
        super().__init__(daemon=True)
        self.read, self.interval = read, interval
        self.samples: list[tuple[float, int]] = []
        self.t0 = time.perf_counter()
        self._halt = threading.Event()

    def run(self) -> None:
        next_at = time.perf_counter()
        while not self._halt.is_set():
            self.samples.append((time.perf_counter() - self.t0, self.read()))
            next_at += self.interval
            self._halt.wait(max(0.0, next_at - time.perf_counter()))

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def between(self, start: float, end: float) -> list[int]:
        return [v for t, v in self.samples if start <= t <= end]


async def run(
    root: Path,
    *,
    model: str,
    idle_timeout: float,
    baseline_secs: float,
    traffic_secs: float,
    cycles: int = 2,
    settle_secs: float = 2.0,
) -> dict[str, Any]:
    entries = [{"id": model, "path": EXAMPLES / model, "idle_timeout_secs": idle_timeout}]
    events: list[dict[str, float]] = []
    first_s, rps, errors = [], [], 0
    async with serving_stack(root / "stack", entries, sweep_interval_secs=0.5) as stack:
        triton = stack.triton_process
        published = stack.store.get(model)
        tensors = dict(
            shape=[1, *published.inputs[0].dims],
            input_name=published.inputs[0].name,
            output_name=published.outputs[0].name,
            headers={"x-api-key": API_KEY},
        )
        target = gateway_urls(stack)["grpc"]
        sampler = RssSampler(triton.process_tree_rss)
        sampler.start()
        try:
            await asyncio.sleep(baseline_secs)
            async with LoadWorker() as worker:
                for _ in range(cycles):
                    ev = {"wake": sampler.now()}
                    # the first request wakes the model through the gateway; then steady traffic
                    first = await worker.run(Job("grpc", target, model, 1, 120, max_requests=1, **tensors))
                    ev["ready"] = sampler.now()
                    traffic = await worker.run(Job("grpc", target, model, 8, traffic_secs, **tensors))
                    ev["idle"] = sampler.now()
                    await wait_state(stack, model, "unloaded", idle_timeout + 60)
                    ev["unloaded"] = sampler.now()
                    await asyncio.sleep(settle_secs)
                    ev["end"] = sampler.now()
                    events.append(ev)
                    first_s.append(first.p50_ms / 1000)
                    rps.append(traffic.rps)
                    errors += first.errors + traffic.errors + (first.requests != 1)
        finally:
            sampler.stop()
    mib = 2**20
    before = statistics.median(sampler.between(0, events[0]["wake"]))
    loaded_samples = [v for ev in events for v in sampler.between(ev["ready"], ev["idle"])]
    loaded = statistics.median(loaded_samples)
    afters = [statistics.median(sampler.between(ev["unloaded"] + settle_secs / 2, ev["end"])) for ev in events]
    after = afters[-1]
    return {
        "model": model,
        "settings": {
            "idle_timeout_secs": idle_timeout,
            "sweep_interval_secs": 0.5,
            "sample_interval_secs": INTERVAL,
            "cycles": cycles,
            "traffic": f"gRPC through the gateway, concurrency 8, {traffic_secs} s",
        },
        "first_request_s": [round(v, 3) for v in first_s],
        "traffic_rps": [round(v, 1) for v in rps],
        "errors": errors,
        "rss_mib": {
            "before": round(before / mib, 1),
            "loaded_median": round(loaded / mib, 1),
            "loaded_peak": round(max(loaded_samples) / mib, 1),
            "after_each_cycle": [round(a / mib, 1) for a in afters],
            "after": round(after / mib, 1),
        },
        "after_vs_before": round(after / before, 4),
        "after_within_5pct_of_before": abs(after / before - 1) <= TOLERANCE,
        "loaded_increment_returned": round((loaded - after) / (loaded - before), 4) if loaded > before else None,
        "last_cycle_after_vs_first_cycle_after": round(afters[-1] / afters[0], 4),
        "idle_unload_after_traffic_s": [round(ev["unloaded"] - ev["idle"], 2) for ev in events],
        "events_s": [{k: round(v, 2) for k, v in ev.items()} for ev in events],
        "samples": [[round(t, 2), round(v / mib, 1)] for t, v in sampler.samples],
    }
