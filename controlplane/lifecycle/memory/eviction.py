"""Which idle model leaves memory first when a load needs room: the eviction policies.

- ``lru``: the least recently used model goes first (snoozeml's policy before ``gdsf``).
- ``gdsf``: GreedyDual-Size-Frequency (Cherkasova, 1998). Each model has a priority
  ``H = L + F * C / S``: ``L`` the policy's clock when the model was last loaded or used, ``F`` its request
  frequency, ``C`` what a miss costs a client (its measured load time, seconds) and ``S`` the memory it holds
  (MiB). The model with the lowest ``H`` goes first, and the clock ``L`` rises to that ``H``: a model not used
  for a while falls behind models loaded or used since, however hot it once was. ``F`` is kept across unloads
  (a hot model evicted once comes back as hot) and ages: every ``AGING_REQUESTS_PER_MODEL`` requests per known
  model, all frequencies halve (TinyLFU's reset), so a hot set that moves on loses its weight.

No admission filter (W-TinyLFU's): a request can only be served by loading its model, so every miss is
admitted; a one-off model enters with ``F`` = 1 and is the next to go, which is what keeps a scan from
flushing the hot set.

The lifecycle (``MemoryBudget.evict``) and the replay (``bench/eviction_replay.py``) drive these same classes:
the caller tells the policy of requests (``accessed``), loads (``loaded``) and evictions (``evicted``) and asks
it to order the models it may evict (``order``). A pre-warmed model no request used yet goes before any of
them; that rule is the caller's (``MemoryBudget``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from controlplane.lifecycle.memory.units import MIB
from controlplane.modes import EvictionMode

POLICIES = tuple(EvictionMode)
T = TypeVar("T")
# TinyLFU's sample size is ten times the cache's capacity; here: ten requests per model the policy knows
AGING_REQUESTS_PER_MODEL = 10
MIN_AGING_WINDOW = 100  # requests: a handful of models still age over a meaningful sample


@dataclass(frozen=True)
class Candidate:
    """A loaded model that could be evicted, as the policy sees it."""

    id: str
    size_bytes: float  # what it holds (its footprint, else its estimate)
    cost_secs: float  # what a miss costs a client: its measured load time
    last_access: float  # seconds on any clock, the same for every candidate


class EvictionPolicy:
    """Least recently used: the base of every policy (no state beyond what the candidates carry)."""

    name: ClassVar[str] = "lru"

    def accessed(self, model_id: str, count: float = 1.0) -> None:
        """``count`` requests for the model were served (or woke it)."""

    def loaded(self, model_id: str) -> None:
        """The model entered memory."""

    def evicted(self, victim: Candidate) -> None:
        """The model left memory to make room for another."""

    def forget(self, model_id: str) -> None:
        """The model was deleted."""

    def order(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """``candidates`` in eviction order, the first to go first."""
        return sorted(candidates, key=lambda c: (c.last_access, c.id))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


class GreedyDualSizeFrequency(EvictionPolicy):
    name: ClassVar[str] = "gdsf"

    def __init__(self, *, aging_per_model: int = AGING_REQUESTS_PER_MODEL) -> None:
        self.clock = 0.0  # L: the priority of the last model evicted (it only rises)
        self.frequency: dict[str, float] = {}
        self.base: dict[str, float] = {}  # the clock when the model was last loaded or used
        self.aging_per_model = aging_per_model
        self.counted = 0.0  # requests since the last halving
        self.halvings = 0

    @property
    def aging_window(self) -> float:
        return max(self.aging_per_model * len(self.frequency), MIN_AGING_WINDOW)

    def accessed(self, model_id: str, count: float = 1.0) -> None:
        if count <= 0:
            return
        self.frequency[model_id] = self.frequency.get(model_id, 0.0) + count
        self.base[model_id] = self.clock
        self.counted += count
        if self.counted >= self.aging_window:
            self._age()

    def loaded(self, model_id: str) -> None:
        self.frequency.setdefault(model_id, 0.0)
        self.base[model_id] = self.clock

    def evicted(self, victim: Candidate) -> None:
        self.clock = max(self.clock, self.priority(victim))

    def forget(self, model_id: str) -> None:
        self.frequency.pop(model_id, None)
        self.base.pop(model_id, None)

    def priority(self, c: Candidate) -> float:
        """``H = L + F * C / S``; F is at least 1 (a model loaded by the API or a pre-warm, never used yet)."""
        size_mib = max(c.size_bytes / MIB, 1.0)
        return self.base.get(c.id, self.clock) + max(self.frequency.get(c.id, 0.0), 1.0) * c.cost_secs / size_mib

    def order(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        return sorted(candidates, key=lambda c: (self.priority(c), c.last_access, c.id))

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "clock": round(self.clock, 6),
            "aging_window_requests": self.aging_window,
            "halvings": self.halvings,
        }

    def _age(self) -> None:
        for model_id in self.frequency:
            self.frequency[model_id] /= 2
        self.counted /= 2
        self.halvings += 1


def bets_first(items: Iterable[T], unused: Callable[[T], bool]) -> list[T]:
    """``items`` (in a policy's order) with the pre-warms no request used yet first: each was a bet on a request
    that has not come; stable, so the policy's order holds within each group. The one rule for host and GPU."""
    return sorted(items, key=lambda item: not unused(item))


def eviction_policy(name: str) -> EvictionPolicy:
    """A new policy by its setting's name (``SNOOZE_EVICTION_POLICY``)."""
    if name == EvictionMode.LRU:
        return EvictionPolicy()
    if name == EvictionMode.GDSF:
        return GreedyDualSizeFrequency()
    raise ValueError(f"unknown eviction policy {name!r}: expected one of {', '.join(POLICIES)}")
