"""snoozeml's own Prometheus metrics, on a registry of their own (no global state, so tests and
several control planes in one process do not collide). Gateway request counts and latency come
from Envoy's stats and inference metrics from Triton's; these cover what only snoozeml knows."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

LEVELS = ("awake", "dozing", "unloaded")
_COLD_START_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
_UNLOAD_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 1.5, 2, 5, 10, 30)


class SnoozeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.cold_starts = Counter(
            "snooze_cold_starts", "Model loads triggered by a request or the API", ["model", "trigger"], registry=r
        )
        self.cold_start_seconds = Histogram(
            "snooze_cold_start_seconds",
            "Time from load start to ready",
            ["model"],
            buckets=_COLD_START_BUCKETS,
            registry=r,
        )
        self.prewarm_loads = Counter(
            "snooze_prewarm_loads",
            "Loads started by the adaptive keep-alive ahead of a predicted request",
            ["model"],
            registry=r,
        )
        self.prewarm_outcomes = Counter(
            "snooze_prewarm_outcomes",
            "Pre-warm loads by what became of them: used (a request came while loaded) or wasted (unloaded unused)",
            ["model", "outcome"],
            registry=r,
        )
        self.load_failures = Counter("snooze_load_failures", "Failed loads", ["model", "kind"], registry=r)
        self.wake_waits = Counter(
            "snooze_wake_waits", "Requests that waited for a model to wake", ["model"], registry=r
        )
        self.wake_wait_seconds = Histogram(
            "snooze_wake_wait_seconds",
            "Time requests waited for a model to wake",
            ["model"],
            buckets=_COLD_START_BUCKETS,
            registry=r,
        )
        self.wake_timeouts = Counter(
            "snooze_wake_timeouts",
            "Requests answered 503 because the wake outlived its deadline",
            ["model"],
            registry=r,
        )
        self.wake_queue_length = Gauge(
            "snooze_wake_queue_length",
            "Loads of sleeping models waiting to start (for a load slot or for memory)",
            registry=r,
        )
        self.wake_queue_oldest_seconds = Gauge(
            "snooze_wake_queue_oldest_wait_seconds",
            "How long the oldest load in the wake queue has waited",
            registry=r,
        )
        self.wake_queue_timeouts = Counter(
            "snooze_wake_queue_timeouts",
            "Requests answered 503 because their model's load could not start within SNOOZE_WAKE_QUEUE_TIMEOUT_SECS",
            ["model", "waiting_for"],
            registry=r,
        )
        self.evictions = Counter("snooze_evictions", "Models unloaded to free memory", ["model", "reason"], registry=r)
        self.unload_seconds = Histogram(
            "snooze_unload_seconds",
            "Time from an unload's start until the model's memory is free; how: ended (its processes were ended "
            "once Triton had taken it out of service) or waited (Triton's own unload, finalize included)",
            ["how"],
            buckets=_UNLOAD_BUCKETS,
            registry=r,
        )
        self.dozes = Counter(
            "snooze_dozes",
            "Stubs told to doze (their preforked worker ended, the model kept loaded)",
            ["model"],
            registry=r,
        )
        self.wakes = Counter(
            "snooze_wakes",
            "Wakes by where they started: doze (a request forked a worker in a dozing stub) or unloaded (a load)",
            ["model", "origin"],
            registry=r,
        )
        self.doze_wake_rooms = Counter(
            "snooze_doze_wake_rooms",
            "Wakes from doze whose stub asked room before it forked, by outcome: room (made or there), over_budget "
            "(memory held by models in use: it went ahead), unasked (the record had it awake, or the lifecycle paused)",
            ["model", "outcome"],
            registry=r,
        )
        self.wake_seconds = Histogram(
            "snooze_wake_seconds",
            "How long a wake took, by origin: from doze the stub's fork and load(), from unloaded the Triton load",
            ["origin"],
            buckets=_COLD_START_BUCKETS,
            registry=r,
        )
        self.level = Gauge(
            "snooze_model_level",
            "1 for the model's level now (awake, dozing, unloaded)",
            ["model", "level"],
            registry=r,
        )
        self.idle_unloads = Counter("snooze_idle_unloads", "Models unloaded for idleness", ["model"], registry=r)
        self.recoveries = Counter(
            "snooze_recoveries", "Reloads after a dead python stub or a Triton restart", ["model", "cause"], registry=r
        )
        self.scale_events = Counter(
            "snooze_scale_events", "Instance count changes by the autoscaler", ["model", "direction"], registry=r
        )
        self.instances = Gauge("snooze_model_instances", "Loaded instances per model", ["model"], registry=r)
        self.memory_bytes = Gauge(
            "snooze_model_memory_bytes", "Measured footprint per loaded model", ["model"], registry=r
        )
        self.gpu_memory_bytes = Gauge(
            "snooze_model_gpu_memory_bytes",
            "Measured GPU memory per loaded model and GPU",
            ["model", "gpu"],
            registry=r,
        )
        self.state = Gauge(
            "snooze_model_state",
            "1 for the model's current state (0 for a state it has left; a state it was never in has no series)",
            ["model", "state"],
            registry=r,
        )
        # by model: its state series made so far (a published model starts with one; ten thousand models asleep
        # cost one series each, not one per state) and the state now
        self._states: dict[str, tuple[dict[str, Any], str]] = {}
        self.auth_failures = Counter(
            "snooze_auth_failures", "Refused control-API requests", ["surface", "reason"], registry=r
        )
        self.triton_restarts = Counter("snooze_triton_restarts", "Embedded tritonserver restarts", registry=r)

    def set_state(self, model: str, state: str) -> None:
        series, now = self._states.get(model, ({}, ""))
        if state == now:
            return
        if now:
            series[now].set(0.0)
        if state not in series:
            series[state] = self.state.labels(model=model, state=state)
        series[state].set(1.0)
        self._states[model] = (series, state)

    def set_level(self, model: str, level: str) -> None:
        for name in LEVELS:
            self.level.labels(model=model, level=name).set(1.0 if name == level else 0.0)

    def forget(self, model: str) -> None:
        """Drop every series of a deleted model: gauges, and counters and histograms too (a model published
        again under the same id starts from zero, which Prometheus reads as a counter reset)."""
        self._states.pop(model, None)
        for metric in self.registry._collector_to_names:  # no public way to list collectors or series
            if not isinstance(metric, MetricWrapperBase) or metric._labelnames[:1] != ("model",):
                continue
            for labels in [k for k in list(metric._metrics) if k[0] == model]:
                metric.remove(*labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)
