"""Keeping models warm: each model's keep-alive policy (``controlplane.keepalive``), told what the lifecycle
sees and asked when an idle model goes and when a sleeping one is loaded ahead of its next request.

What a policy hears, and from where:

- a request: at its arrival, when the activator wakes or serves the model (``ensure_ready``); or when the
  sweeper sees Triton's ``last_inference`` pass the end of the activator's last forward (``touched``): a
  request that went from the gateway straight to Triton. A request the activator forwarded ran before that
  end (give or take ``FORWARD_STAMP_SLACK_SECS``) and was already heard at its arrival; hearing it again at
  its ``last_inference`` would record a cold start's load time as an idle time;
- the end of the activator's forward (``on_served``: the fixed timeout counts from there);
- every completed load (``trigger``: "request", "api", "prewarm", "adopt", None for reloads, rescales and
  recoveries) and every departure from memory (unload, eviction, Triton gone).

A pre-warm is heard when it starts, as the replay (``bench/keepalive_replay.py``) has it: a request that comes
while it loads uses it. The rules around it are the supervisor's (``Supervisor.sweep``): only a model that
is unloaded with no transition running, only while a load slot is free, only from free memory budget (host
and GPU: nothing is evicted for it), and a pre-warmed model nobody used yet is the first to be evicted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from controlplane.clock import SYSTEM_CLOCK
from controlplane.keepalive import Action, FixedKeepAlive, keep_alive_policy
from controlplane.lifecycle.state import ModelRecord
from controlplane.metrics import SnoozeMetrics
from controlplane.settings import Settings

# Triton stamps last_inference in whole milliseconds and may stamp a request the activator forwarded a moment
# after the forward's end (measured: +0.5 ms); a stamp this close after it is that request, not a new one
FORWARD_STAMP_SLACK_SECS = 0.25
# the sweeper's shortest sleep when a policy's decision is due sooner than its interval (no busy loop on a
# decision it cannot act on yet, such as a pre-warm waiting for a load slot)
MIN_SWEEP_GAP_SECS = 0.05
# loads an operator asked for (or found loaded at start): the policy holds them for the fixed timeout
EXPLICIT_TRIGGERS = ("api", "adopt")


class Warmth:
    """The keep-alive policies of every model (one per ``ModelRecord``), and the metrics of their pre-warms."""

    def __init__(
        self, settings: Settings, metrics: SnoozeMetrics, *, clock: Callable[[], float] = SYSTEM_CLOCK.time
    ) -> None:
        """``clock``: wall seconds, the manager's ``Clock.time`` (the policies' times are all wall time)."""
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        self._fresh_windows: dict[tuple[Any, float], dict[str, Any]] = {}  # ``windows`` of a model without a policy
        # the records given a policy (a model heard of: requested or loaded), by id: what the sweep's pre-warm pass
        # and its sleep walk, not every record (most of 10,000 models are never requested)
        self._with_policy: dict[str, ModelRecord] = {}

    def policy(self, rec: ModelRecord) -> FixedKeepAlive:
        """The model's policy; a new one when its deployment's ``keep_alive`` or ``idle_timeout_secs`` changed."""
        dep = rec.model.deployment
        policy = rec.access.keep_alive
        if policy is None or policy.kind != dep.keep_alive or policy.idle_timeout_secs != dep.idle_timeout_secs:
            policy = keep_alive_policy(
                dep.keep_alive,
                dep.idle_timeout_secs,
                min_samples=self.settings.keep_alive_min_samples,
                min_unloaded_secs=self.settings.keep_alive_min_unloaded_secs,
            )
            rec.access.keep_alive, rec.access.prewarms_counted = policy, (0, 0)
            self._with_policy[rec.id] = rec
            if rec.loaded:  # a loaded model's window starts at its load, as under the policy it replaces
                policy.on_loaded(rec.load.ready_at or self.clock())
        return policy

    # ------------------------------------------------------------------ what happened

    def request(self, rec: ModelRecord, at: float | None = None) -> None:
        self.policy(rec).on_request(self.clock() if at is None else at)
        self._count(rec)

    def served(self, rec: ModelRecord, at: float) -> None:
        self.policy(rec).on_served(at)

    def triton_access(self, rec: ModelRecord) -> None:
        """After the sweeper read Triton's ``last_inference`` into ``rec.access.triton_last``."""
        if rec.access.triton_last <= rec.access.access_reported:
            return
        rec.access.access_reported = rec.access.triton_last
        if rec.access.triton_last > rec.access.touched + FORWARD_STAMP_SLACK_SECS:
            self.request(rec, rec.access.triton_last)
        else:  # the activator's own forward, heard at its arrival: only the end of use moves
            self.served(rec, rec.access.triton_last)

    def prewarm_started(self, rec: ModelRecord) -> None:
        self.policy(rec).on_loaded(self.clock(), prewarm=True)

    def loaded(self, rec: ModelRecord, trigger: str | None, load_secs: float | None = None) -> None:
        self.policy(rec).on_loaded(self.clock(), explicit=trigger in EXPLICIT_TRIGGERS, load_secs=load_secs)

    def unloaded(self, rec: ModelRecord) -> None:
        if rec.access.keep_alive is not None:
            rec.access.keep_alive.on_unloaded(self.clock())
            self._count(rec)

    # ------------------------------------------------------------------ decisions

    def unload_due(self, rec: ModelRecord, now: float) -> bool:
        """The policy lets the loaded model go (the caller still checks that nothing uses it)."""
        return self.policy(rec).decide(now, loaded=True) is Action.UNLOAD

    def prewarm_due(self, rec: ModelRecord, now: float) -> bool:
        """The policy wants the unloaded model back now (only a model it heard a request for)."""
        return rec.access.keep_alive is not None and rec.access.keep_alive.decide(now, loaded=False) is Action.PREWARM

    def windows(self, rec: ModelRecord) -> dict[str, Any]:
        """The policy's windows; for a model with no policy yet (never requested, not loaded: most of thousands) those
        of a fresh policy of its kind, read once per kind and timeout, so that a listing neither builds a policy per
        model (memory) nor reads one (time)."""
        if rec.access.keep_alive is None and not rec.loaded:
            dep = rec.model.deployment
            key = (dep.keep_alive, dep.idle_timeout_secs)
            fresh = self._fresh_windows.get(key)
            if fresh is None:
                fresh = self._fresh_windows[key] = keep_alive_policy(
                    dep.keep_alive,
                    dep.idle_timeout_secs,
                    min_samples=self.settings.keep_alive_min_samples,
                    min_unloaded_secs=self.settings.keep_alive_min_unloaded_secs,
                ).windows()
            return dict(fresh)
        return self.policy(rec).windows()

    def with_policy(self, current: Callable[[str], ModelRecord | None]) -> list[ModelRecord]:
        """The records that have a policy, those that are still ``current(id)`` (a dropped or replaced record is
        forgotten here)."""
        live = []
        for model_id, rec in list(self._with_policy.items()):
            if current(model_id) is rec and rec.access.keep_alive is not None:
                live.append(rec)
            else:
                del self._with_policy[model_id]
        return live

    def sweep_delay(self, records: Iterable[ModelRecord], interval: float) -> float:
        """How long the sweeper may sleep: its interval, or less when a policy's next decision (an unload
        or a pre-warm) falls sooner, so that a pre-warm starts when its policy says and not up to a whole
        interval later. Never below ``MIN_SWEEP_GAP_SECS``. ``records``: those with a policy (``with_policy``)."""
        now = self.clock()
        due = [
            t
            for rec in records
            if rec.access.keep_alive is not None and (t := rec.access.keep_alive.next_decision_at(now))
        ]
        if not due:
            return interval
        return min(interval, max(min(due) - now, MIN_SWEEP_GAP_SECS))

    def _count(self, rec: ModelRecord) -> None:
        """Pre-warms the policy has since judged used (a request came) or wasted (unloaded unused)."""
        policy = rec.access.keep_alive
        if policy is None:
            return
        used, wasted = rec.access.prewarms_counted
        if policy.prewarm_used > used:
            self.metrics.prewarm_outcomes.labels(model=rec.id, outcome="used").inc(policy.prewarm_used - used)
        if policy.prewarm_wasted > wasted:
            self.metrics.prewarm_outcomes.labels(model=rec.id, outcome="wasted").inc(policy.prewarm_wasted - wasted)
        rec.access.prewarms_counted = (policy.prewarm_used, policy.prewarm_wasted)
