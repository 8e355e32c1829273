"""The default run's share of a parametrized test's variants: every value of every parameter at least once.

A fault test crossed with two topologies, two workers and two protocols is eight stacks' worth of minutes, and most
of what each variant checks is checked by the others. ``each_choice`` keeps, per test function, the fewest variants
(greedily) that still run each value of each parameter once (every topology, every worker, every protocol, every
fault), and marks the rest ``slow``: ``make test-all`` (or ``-m 'slow or not slow'``) runs the whole cross product.
The choice depends only on the variants' ids, so every pytest-xdist worker makes the same one.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path

import pytest

EXACT_UP_TO = 12  # variants of one test: a search of every subset (4,096 at most) finds the smallest cover


def each_choice(items: list[pytest.Item], under: Path) -> list[pytest.Item]:
    """Mark slow the variants of each parametrized test under ``under`` that the default run can do without; the
    items so marked."""
    groups: dict[tuple[str, str], list[pytest.Item]] = defaultdict(list)
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or not callspec.params or item.get_closest_marker("slow") is not None:
            continue
        if under not in Path(str(item.path)).parents:
            continue
        groups[(str(item.path), getattr(item, "originalname", item.name))].append(item)
    dropped = []
    for variants in groups.values():
        kept = {id(item) for item in keep(variants)}
        for item in variants:
            if id(item) not in kept:
                item.add_marker(pytest.mark.slow)
                dropped.append(item)
    return dropped


def _pairs(item: pytest.Item) -> set[tuple[str, str]]:
    return {(name, repr(value)) for name, value in item.callspec.params.items()}  # type: ignore[attr-defined]


def _stack(item: pytest.Item) -> tuple[tuple[str, str], ...]:
    """The values of the item's module-scoped (or broader) parametrized fixtures: the stack it shares with others."""
    defs = item._fixtureinfo.name2fixturedefs  # type: ignore[attr-defined]
    params = item.callspec.params  # type: ignore[attr-defined]
    return tuple(
        sorted(
            (name, repr(value)) for name, value in params.items() if name in defs and defs[name][-1].scope != "function"
        )
    )


def keep(variants: list[pytest.Item]) -> list[pytest.Item]:
    """The fewest variants that cover every (parameter, value) pair, among them those that need the fewest shared
    stacks (module-scoped fixtures), then the first by id; beyond ``EXACT_UP_TO`` variants, greedily the one covering
    most pairs not yet covered (ties: the first by id)."""
    ordered = sorted(variants, key=lambda i: i.nodeid)
    pairs = [_pairs(i) for i in ordered]
    wanted = set().union(*pairs) if pairs else set()
    if len(ordered) <= EXACT_UP_TO:
        for size in range(1, len(ordered) + 1):
            covers = [
                chosen
                for chosen in itertools.combinations(range(len(ordered)), size)
                if set().union(*(pairs[k] for k in chosen)) == wanted
            ]
            if covers:
                best = min(covers, key=lambda chosen: (len({_stack(ordered[k]) for k in chosen}), chosen))
                return [ordered[k] for k in best]
    kept: list[pytest.Item] = []
    left = list(range(len(ordered)))
    while wanted:
        top = max(left, key=lambda k: len(pairs[k] & wanted))
        kept.append(ordered[top])
        left.remove(top)
        wanted -= pairs[top]
    return kept
