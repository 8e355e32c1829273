"""Keep-alive policies: how long a model stays loaded after a request, and when to load it again before
the next one.

Both policies answer the same questions, so the lifecycle calls one thing per model:

- ``on_request(t)``: a request arrived at ``t`` (the activator's wake-up, or Triton's ``last_inference``
  when the sweeper sees it advance: several requests within one sweep count as one);
- ``on_loaded(t, prewarm=..., explicit=..., load_secs=...)`` / ``on_unloaded(t)``: the model became ready
  / left memory;
- ``on_served(t)``: a request already reported at its arrival was answered at ``t`` (the activator's forward
  ended): the fixed timeout counts from there, as it does from a load;
- ``decide(now, loaded=...)``: ``KEEP``, ``UNLOAD`` or ``PREWARM`` at this instant, and
  ``next_decision_at(now)``: when that answer may change next if no request comes;
- ``keep_alive_until(last_request)`` and ``prewarm_at(last_request)``: the window behind ``decide``;
- ``windows()``: a snapshot for ``status``.

No method reads a clock: every time is an argument, so a trace replays in virtual time
(``bench/keepalive_replay.py``) with the very code the lifecycle runs.

``FixedKeepAlive`` is today's rule: unload ``idle_timeout_secs`` after the last request or load.

``AdaptiveKeepAlive`` follows the idea of "Serverless in the Wild" (Shahrad et al., USENIX ATC 2020): learn
each model's histogram of idle times (the gaps between its requests) and keep the model loaded only over the
stretch of time after a request where the next one is likely to come. The window has one of two shapes:

- stay loaded from the request until ``end``;
- unload at once, pre-warm (load again) at ``start`` so the model is ready for the earliest likely request,
  stay loaded until ``end``.

The paper takes ``start`` and ``end`` at fixed percentiles of the histogram. Here they are recorded idle
times too (so: percentiles), but chosen by a price instead of fixed ranks: of all candidate windows, the one
that, replayed over the recorded idle times, catches the most requests minus ``1 / idle_timeout_secs`` per
loaded second. The operator's timeout thus keeps its meaning: avoiding one cold start is worth
``idle_timeout_secs`` of memory. Fixed ranks fail on mixed traffic (a handful of hour-long silences among
128 gaps seconds apart moves a 98th percentile from seconds to an hour) and know nothing of memory; the price
stops the window where the requests it would still catch no longer pay for the memory. Then the window is
widened by ``MARGIN``, the pre-warm starts a load time early, and when the window reaches the longest idle
time on record while the requests in the tail still come faster than the price, it is stretched by
``TAIL_SPAN`` mean tail gaps (the histogram cannot show what lies past its longest gap).

Parameters (ours, and why; ``MIN_SAMPLES`` and ``MIN_UNLOADED_SECS`` are defaults a server may lower with
``SNOOZE_KEEP_ALIVE_MIN_SAMPLES`` / ``SNOOZE_KEEP_ALIVE_MIN_UNLOADED_SECS``, for callers whose period is seconds):

- ``HISTORY = 128`` idle times per model (1 KiB): two hours of a model called every minute, a day of one
  called every ten minutes, five days of an hourly one; recent enough to follow a changing caller.
- ``MIN_SAMPLES = 10``: until a model has shown ten idle times, the fixed timeout decides (the model has no
  usable pattern yet; ``windows()`` says so).
- ``MARGIN = 0.10``: the next gap drifts from those on record in proportion to its length (a job run every
  ten minutes slips by seconds, an hourly one by minutes); 10% of each edge also covers the sweeper's
  one-second resolution.
- ``PREWARM_MIN_SHARE = 0.5``: a pre-warm is a bet on where the next request falls; it is taken only on a
  window that holds at least half of the recent idle times. Without it the search finds narrow windows that
  hold three gaps of memoryless traffic by chance, and pre-warms that go unused.
- ``MIN_KEEP_ALIVE_SECS = 30``: a model whose requests come seconds apart is not unloaded in a pause of a few
  seconds; each reload is a client-visible cold start of 0.2-1.3 s and the CPU of a load.
- ``MIN_UNLOADED_SECS = 60``: unload before a pre-warm only when the model then stays out of memory for at
  least a minute; a shorter saving is not worth a load and the risk of a wrong prediction.
- ``TAIL_SAMPLES = 8``, ``TAIL_SPAN = 5``: the tail's rate is estimated from the eight longest gaps; five mean
  tail gaps past the longest one leave under 1% of the tail's requests uncaught, if it is exponential.

Where requests arrive without memory (Poisson traffic) no policy beats a fixed timeout: a request finds the
model loaded as often as a random instant does, so cold starts fall only as loaded time grows, whatever the
rule. There the adaptive policy is a timeout of its own choosing: long while requests come faster than one
per ``idle_timeout_secs``, ``MIN_KEEP_ALIVE_SECS`` when they come slower. It gains where gaps are predictable:
periodic callers (pre-warm) and bursts (a short keep-alive covers the burst, the silence after it costs
little).

Memory: a pre-warm uses only free budget, never evicts a model in use, and a pre-warmed model that has not
served a request yet (``prewarmed_unused``) is the first to go under pressure; the lifecycle enforces this,
the policy only says when a pre-warm would help.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from controlplane.modes import KeepAliveMode

HISTORY = 128
MIN_SAMPLES = 10
MARGIN = 0.10
PREWARM_MIN_SHARE = 0.5
MIN_KEEP_ALIVE_SECS = 30.0
MIN_UNLOADED_SECS = 60.0
TAIL_SAMPLES = 8
TAIL_SPAN = 5.0
DEFAULT_LOAD_SECS = 1.0  # lead time of a pre-warm until a load has been measured
# Dozing (a preforked model's worker ends, its stub stays loaded): a wake from doze costs about a tenth of a cold
# start (measured, bench --only doze: 13-54 ms against 298-333 ms from unloaded), so avoiding one is worth a tenth
# of the memory-seconds a cold start is (idle_timeout_secs), and the learned doze time is the keep-alive's search at
# that price. MIN_DOZE_SECS: a model is not dozed in a pause of a few seconds between requests.
DOZE_WAKE_SHARE = 0.1
MIN_DOZE_SECS = 5.0

KeepAliveKind = KeepAliveMode


class Action(StrEnum):
    KEEP = "keep"  # leave the model as it is
    UNLOAD = "unload"  # idle unload (the lifecycle still checks in-flight requests)
    PREWARM = "prewarm"  # load it ahead of the predicted request, from free budget only


@dataclass(frozen=True)
class Window:
    """After a request: stay loaded ``keep_alive_secs``; with ``prewarm_after_secs``, unload at once and load
    again that long after the request."""

    keep_alive_secs: float
    prewarm_after_secs: float | None = None
    pattern: bool = False  # True: learned from the idle times; False: the fixed timeout
    reason: str = "fixed idle timeout"


class FixedKeepAlive:
    """Unload ``idle_timeout_secs`` after the last request, or after the last load (a freshly loaded model
    gets the full timeout, as the lifecycle's ``idle_since`` does today). Never pre-warms."""

    kind: KeepAliveKind = KeepAliveMode.FIXED

    def __init__(self, idle_timeout_secs: float) -> None:
        if not idle_timeout_secs > 0:
            raise ValueError(f"idle_timeout_secs must be > 0, got {idle_timeout_secs!r}")
        self.idle_timeout_secs = idle_timeout_secs
        self._fixed = Window(idle_timeout_secs)
        self.last_request: float | None = None
        self.load_secs = DEFAULT_LOAD_SECS
        self.prewarm_loads = 0
        self.prewarm_used = 0
        self.prewarm_wasted = 0
        self.prewarmed_unused = False  # loaded by a pre-warm and no request since: evict it first
        self._anchor: float | None = None  # the keep-alive window counts from here
        self._held_until = -math.inf  # an explicit load holds the model for the fixed timeout
        self._prewarmed_for: float | None = None  # one pre-warm per request, even if it gets evicted

    # ------------------------------------------------------------------ what the lifecycle reports

    def on_request(self, now: float) -> None:
        if self.prewarmed_unused:
            self.prewarm_used += 1
            self.prewarmed_unused = False
        if self.last_request is not None and now <= self.last_request:
            return  # the same or an older observation (activator and sweeper may both report one request)
        if self.last_request is not None:
            self._record_idle(now - self.last_request)
        self.last_request = now
        self._anchor = now if self._anchor is None else max(self._anchor, now)

    def on_loaded(
        self, now: float, *, prewarm: bool = False, explicit: bool = False, load_secs: float | None = None
    ) -> None:
        """The model became ready. ``prewarm``: this policy asked for it; ``explicit``: an operator's load
        (API, CLI); ``load_secs``: how long the load took (the lead time of the next pre-warm)."""
        if load_secs is not None and load_secs > 0:
            self.load_secs = load_secs
        if prewarm:
            self.prewarm_loads += 1
            self.prewarmed_unused = True
            self._prewarmed_for = self.last_request
        elif self._anchor is None or self._load_restarts_window(explicit):
            self._anchor = now if self._anchor is None else max(self._anchor, now)
        if explicit:
            self._held_until = now + self.idle_timeout_secs

    def on_served(self, now: float) -> None:
        """A request reported by ``on_request`` at its arrival was answered at ``now``. The fixed window counts
        from the last moment the model was in use; a learned one from the request (like a cold start's load)."""
        if self._anchor is not None and self._load_restarts_window(False):
            self._anchor = max(self._anchor, now)

    def on_unloaded(self, now: float) -> None:
        if self.prewarmed_unused:
            self.prewarm_wasted += 1
            self.prewarmed_unused = False

    # ------------------------------------------------------------------ decisions

    def window(self) -> Window:
        return self._fixed

    def keep_alive_until(self, last_request: float) -> float:
        """When to unload if no request comes after ``last_request``."""
        return last_request + self.window().keep_alive_secs

    def prewarm_at(self, last_request: float) -> float | None:
        """When to load again before the predicted next request; None: no pre-warm (stay loaded instead)."""
        after = self.window().prewarm_after_secs
        return None if after is None else last_request + after

    def decide(self, now: float, *, loaded: bool) -> Action:
        anchor = self._anchor
        if anchor is None or (loaded and now < self._held_until):
            return Action.KEEP
        until, at = self.keep_alive_until(anchor), self.prewarm_at(anchor)
        if loaded:
            waiting_for_prewarm = at is not None and now < at and not self.prewarmed_unused
            return Action.UNLOAD if now >= until or waiting_for_prewarm else Action.KEEP
        if at is not None and at <= now < until and self._prewarmed_for != self.last_request:
            return Action.PREWARM
        return Action.KEEP

    def next_decision_at(self, now: float) -> float | None:
        """The next instant after ``now`` at which ``decide`` may answer otherwise if no request comes (the
        sweeper may sleep until then; the replay jumps there)."""
        if self._anchor is None:
            return None
        candidates = (self._held_until, self.keep_alive_until(self._anchor), self.prewarm_at(self._anchor))
        return min((t for t in candidates if t is not None and t > now), default=None)

    def doze_after(self, default: float) -> float:
        """How long after a request a model that can doze dozes: ``default`` (the server's ``doze_after_secs``)
        until a pattern is learned (``AdaptiveKeepAlive``)."""
        return default

    def windows(self) -> dict[str, Any]:
        """For ``status``: the policy's current windows and its pre-warm counts."""
        w = self.window()
        return {
            "policy": self.kind,
            "pattern": w.pattern,
            "reason": w.reason,
            "samples": self.samples,
            "keep_alive_secs": round(w.keep_alive_secs, 3),
            "prewarm_after_secs": None if w.prewarm_after_secs is None else round(w.prewarm_after_secs, 3),
            "prewarm_loads": self.prewarm_loads,
            "prewarm_used": self.prewarm_used,
            "prewarm_wasted": self.prewarm_wasted,
            "prewarmed_unused": self.prewarmed_unused,
        }

    @property
    def samples(self) -> int:
        return 0

    def idle_times(self) -> list[float]:
        """The idle times on record, oldest first."""
        return []

    def _record_idle(self, secs: float) -> None:
        pass

    def _load_restarts_window(self, explicit: bool) -> bool:
        return True


class AdaptiveKeepAlive(FixedKeepAlive):
    """Learned keep-alive and pre-warm windows (module docstring); the fixed timeout until a pattern shows."""

    kind: KeepAliveKind = KeepAliveMode.ADAPTIVE

    def __init__(
        self,
        idle_timeout_secs: float,
        *,
        history: int | None = None,
        min_samples: int = MIN_SAMPLES,
        min_unloaded_secs: float = MIN_UNLOADED_SECS,
    ) -> None:
        """``min_samples`` / ``min_unloaded_secs``: MIN_SAMPLES and MIN_UNLOADED_SECS for this model (the
        server's ``keep_alive_min_samples`` / ``keep_alive_min_unloaded_secs``; lower for callers whose period
        is seconds, and for tests)."""
        super().__init__(idle_timeout_secs)
        if min_samples < 1 or min_unloaded_secs < 0:
            raise ValueError(
                f"min_samples must be >= 1 and min_unloaded_secs >= 0, got {min_samples} and {min_unloaded_secs}"
            )
        self.min_samples, self.min_unloaded_secs = min_samples, min_unloaded_secs
        self._idle: deque[float] = deque(maxlen=history or HISTORY)
        self._cached: Window | None = None
        self._doze: float | None = None  # the learned doze time, until the idle times change

    @property
    def samples(self) -> int:
        return len(self._idle)

    def idle_times(self) -> list[float]:
        return list(self._idle)

    def _record_idle(self, secs: float) -> None:
        self._idle.append(secs)
        self._cached, self._doze = None, None

    def _load_restarts_window(self, explicit: bool) -> bool:
        # the window counts from the request: a cold start's load time must not shift the next pre-warm
        return explicit

    def on_loaded(
        self, now: float, *, prewarm: bool = False, explicit: bool = False, load_secs: float | None = None
    ) -> None:
        if load_secs is not None and load_secs != self.load_secs:
            self._cached = None
        super().on_loaded(now, prewarm=prewarm, explicit=explicit, load_secs=load_secs)

    def window(self) -> Window:
        if self._cached is None:
            self._cached = self._learn()
        return self._cached

    def windows(self) -> dict[str, Any]:
        return {**super().windows(), "min_samples": self.min_samples}

    def doze_after(self, default: float) -> float:
        """The learned doze time: the keep-alive's search (``best_window``, awake from the request on) at the price
        of a wake from doze (``DOZE_WAKE_SHARE`` of a cold start), at least ``MIN_DOZE_SECS``; ``default`` until
        ``min_samples`` idle times are on record."""
        if len(self._idle) < self.min_samples:
            return default
        if self._doze is None:
            idle = np.sort(np.fromiter(self._idle, dtype=float))
            price = 1.0 / (DOZE_WAKE_SHARE * self.idle_timeout_secs)
            _, end, caught = best_window(idle, price=price, min_start=math.inf)  # no pre-warm: awake from the request
            self._doze = max(end * (1 + MARGIN), MIN_DOZE_SECS) if caught else MIN_DOZE_SECS
        return self._doze

    def _learn(self) -> Window:
        if len(self._idle) < self.min_samples:
            return Window(
                self.idle_timeout_secs, reason=f"learning: {len(self._idle)} of {self.min_samples} idle times seen"
            )
        idle = np.sort(np.fromiter(self._idle, dtype=float))
        price = 1.0 / self.idle_timeout_secs
        min_start = (self.min_unloaded_secs + self.load_secs) / (1 - MARGIN)
        start, end, caught = best_window(idle, price=price, min_start=min_start)
        if caught == 0:
            reason = f"requests too sparse to keep loaded (most idle times beyond {self.idle_timeout_secs:g} s)"
            return Window(MIN_KEEP_ALIVE_SECS, pattern=True, reason=reason)
        reason = f"{100 * caught:.0f}% of recent idle times fall in {start:.1f}-{end:.1f} s"
        keep = max(end * (1 + MARGIN), MIN_KEEP_ALIVE_SECS)
        tail_n = min(TAIL_SAMPLES, idle.size - 1)  # fewer only where min_samples is set below TAIL_SAMPLES + 1
        if end == idle[-1] and tail_n > 0:  # the window reaches the longest idle time seen: trust the tail's rate
            tail = idle[-tail_n:] - idle[-tail_n - 1]
            rate = tail_n / max(float(tail.sum()), 1e-9)
            if rate > price:
                keep = max(keep, end + TAIL_SPAN / rate)
        prewarm = start * (1 - MARGIN) - self.load_secs if start else None
        return Window(keep, prewarm, pattern=True, reason=reason)


def best_window(idle: np.ndarray, *, price: float, min_start: float) -> tuple[float, float, float]:
    """The window ``[start, end]`` (seconds after a request) in which the next request most likely comes, as
    ``(start, end, share of the idle times it holds)``. ``start == 0``: stay loaded from the request on;
    ``(0, 0, 0)``: no window is worth its memory. Of the candidate windows (edges at recorded idle times, a
    pre-warm window starting at ``min_start`` or later and holding at least PREWARM_MIN_SHARE of them), the
    one that, replayed over the recorded idle times ``idle`` (sorted), catches the most requests minus
    ``price`` times the loaded seconds it costs. O(n^2) on at most HISTORY values."""
    n = len(idle)
    prefix = np.concatenate(([0.0], np.cumsum(idle)))
    cand = np.flatnonzero(idle >= min_start)
    cand = cand[cand <= n - PREWARM_MIN_SHARE * n]  # later starts cannot hold enough of the idle times
    starts = np.concatenate(([0], cand))  # index of the first caught idle time; 0: stay loaded
    lo = np.where(np.arange(starts.size) == 0, 0.0, idle[starts])[:, None]
    i, j = starts[:, None], np.arange(n)[None, :]
    caught = j - i + 1  # idle[i..j]; those below idle[i] come while unloaded (cold), those above idle[j] too
    # loaded seconds: a caught gap holds the model from the start to its request, a later gap the whole window
    cost = prefix[j + 1] - prefix[i] - caught * lo + (n - 1 - j) * (idle[j] - lo)
    # a pre-warm is a bet on where the next request falls: take it only where most recent idle times agree
    valid = (caught > 0) & ((lo == 0) | (caught >= PREWARM_MIN_SHARE * n))
    score = np.where(valid, caught - price * cost, -np.inf)
    a, b = np.unravel_index(int(np.argmax(score)), score.shape)
    if score[a, b] <= 0:
        return 0.0, 0.0, 0.0
    return float(lo[a, 0]), float(idle[b]), float(caught[a, b]) / n


def keep_alive_policy(
    kind: KeepAliveKind,
    idle_timeout_secs: float,
    *,
    min_samples: int = MIN_SAMPLES,
    min_unloaded_secs: float = MIN_UNLOADED_SECS,
) -> FixedKeepAlive:
    """The policy a deployment asks for (``keep_alive`` and ``idle_timeout_secs`` of ``DeploymentSpec``); the
    keyword arguments tune the adaptive one (``AdaptiveKeepAlive``)."""
    if kind == KeepAliveMode.ADAPTIVE:
        return AdaptiveKeepAlive(idle_timeout_secs, min_samples=min_samples, min_unloaded_secs=min_unloaded_secs)
    if kind == KeepAliveMode.FIXED:
        return FixedKeepAlive(idle_timeout_secs)
    raise ValueError(f"keep_alive must be 'fixed' or 'adaptive', got {kind!r}")
