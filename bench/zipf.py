"""Zipf popularity, the one law every bench that draws skewed traffic uses (churn, fleet, the eviction replay).

Rank i (0: the most requested) is drawn with probability proportional to 1 / (i + 1)^s. Draws go through the
caller's ``numpy.random.Generator``, so a seed gives the same requests in every bench that uses it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import overload

import numpy as np


@dataclass(frozen=True)
class Zipf:
    """Zipf(``s``) over ``n`` ranks."""

    n: int
    s: float
    weights: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"Zipf over {self.n} ranks: needs at least one")
        w = 1.0 / np.arange(1, self.n + 1) ** self.s
        object.__setattr__(self, "weights", w / w.sum())

    @overload
    def draw(self, rng: np.random.Generator, size: None = None) -> int: ...
    @overload
    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray: ...
    def draw(self, rng: np.random.Generator, size: int | None = None) -> int | np.ndarray:
        """One rank (``size`` None) or an array of ``size`` ranks."""
        if size is None:
            return int(rng.choice(self.n, p=self.weights))
        return rng.choice(self.n, size=size, p=self.weights)

    def share(self, top: int) -> float:
        """The share of requests that go to the ``top`` most requested ranks."""
        return float(self.weights[:top].sum())

    def requests(self, rng: np.random.Generator, ids: list[str], count: int) -> list[str]:
        """``count`` requests over ``ids`` (``n`` of them), the ranks given to ``ids`` in a random order."""
        if len(ids) != self.n:
            raise ValueError(f"Zipf over {self.n} ranks given {len(ids)} ids")
        ranking = list(rng.permutation(ids))
        return [ranking[k] for k in self.draw(rng, count)]
