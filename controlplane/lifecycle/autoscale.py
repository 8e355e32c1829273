"""Autoscaling by queue depth: the rule, as a pure function of the model's load window."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoadWindow:
    """How long a model's queue has stayed high (scale up) or low (scale down); monotonic seconds."""

    high_since: float | None = None
    low_since: float | None = None


def autoscale_step(
    window: LoadWindow,
    *,
    pending: float,
    instances: int,
    base: int,
    max_instances: int,
    threshold: float,
    window_secs: float,
    idle_timeout_secs: float,
    now: float,
) -> int:
    """The instance count the model should have now (``instances`` when nothing changes).

    Up: pending requests per instance above ``threshold`` for ``window_secs`` doubles the
    instances, up to ``max_instances``. Down: one instance less after ``idle_timeout / N`` of low
    load, where low means the queue would stay under half the threshold with one instance less (the
    gap between the two thresholds keeps the count from flapping).
    """
    if pending > threshold * instances:
        window.low_since = None
        if window.high_since is None:
            window.high_since = now
        if now - window.high_since >= window_secs and instances < max_instances:
            window.high_since = None
            return min(max_instances, instances * 2)
        return instances
    window.high_since = None
    if instances > base and pending <= threshold * (instances - 1) / 2:
        if window.low_since is None:
            window.low_since = now
        if now - window.low_since >= idle_timeout_secs / instances:
            window.low_since = None
            return instances - 1
        return instances
    window.low_since = None
    return instances
