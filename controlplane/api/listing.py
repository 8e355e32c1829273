"""`GET /v1/models` at scale: filters (state, kind, id prefix), pages after a cursor in a stable order (by id), and
the summary `snoozectl status` shows when there are many models (`GET /v1/models:summary`)."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from controlplane.lifecycle.state import ModelState, ModelStatus
from controlplane.store import PublishedModel

# How old the store catalog's scan of the repository may be for a listing: another writer's publish (a fleet's
# other node) shows within this, or sooner where the lifecycle follows the store (``ModelStore.changes``); this
# server's own publishes at once.
LIST_SCAN_SECS = 30.0
SUMMARY_TOP = 10  # the summary's lists of models: this many each


@dataclass(frozen=True)
class ListQuery:
    """A listing's filters and page. ``after``: the last id of the previous page (the cursor)."""

    state: ModelState | None = None
    kind: str | None = None
    prefix: str = ""
    limit: int | None = None
    after: str = ""


@dataclass
class ModelPage:
    """One page: its models' summaries, how many match the filters in all, the cursor of the next page (None: last)."""

    models: list[dict[str, Any] | orjson.Fragment] = field(default_factory=list)  # a Fragment: one's JSON, as is
    total: int = 0
    next_after: str | None = None


def page_of(
    models: Sequence[PublishedModel],
    query: ListQuery,
    statuses: Callable[[list[str]], list[ModelStatus]],
    summary: Callable[[PublishedModel, ModelStatus], dict[str, Any] | orjson.Fragment],
    states_of: Callable[[list[str]], list[ModelState]],
) -> ModelPage:
    """``models`` sorted by id -> the page ``query`` asks for. Statuses are read for the page only; a filter by
    state reads the states of the models the other filters kept (``states_of``: no status built)."""

    def by_id(m: PublishedModel) -> str:
        return m.id

    start = bisect.bisect_left(models, query.prefix, key=by_id) if query.prefix else 0
    end = bisect.bisect_left(models, query.prefix + "\U0010ffff", key=by_id) if query.prefix else len(models)
    chosen = models[start:end]
    if query.kind is not None:
        chosen = [m for m in chosen if m.kind.value == query.kind]
    if query.state is not None:
        states = states_of([m.id for m in chosen])
        chosen = [m for m, state in zip(chosen, states, strict=True) if state is query.state]
    total = len(chosen)
    first = bisect.bisect_right(chosen, query.after, key=by_id) if query.after else 0
    last = len(chosen) if query.limit is None else min(first + query.limit, len(chosen))
    page = chosen[first:last]
    known = {s.id: s for s in statuses([m.id for m in page])} if page else {}
    return ModelPage(
        models=[summary(m, known[m.id]) for m in page],
        total=total,
        next_after=page[-1].id if page and last < len(chosen) else None,
    )


def summarise(models: Sequence[PublishedModel], statuses: Sequence[ModelStatus], top: int) -> dict[str, Any]:
    """Counts by state and by kind, the memory models hold, and the ``top`` models by memory held and by last use."""
    by_id = {s.id: s for s in statuses}
    held = [s for s in statuses if s.memory_bytes]
    used = [s for s in statuses if s.last_access]

    def line(s: ModelStatus) -> dict[str, Any]:
        return {"id": s.id, "state": s.state.value, "memory_bytes": s.memory_bytes, "last_access": s.last_access}

    return {
        "total": len(models),
        "states": dict(Counter(by_id[m.id].state.value for m in models if m.id in by_id)),
        "kinds": dict(Counter(m.kind.value for m in models)),
        "memory_bytes": sum(s.memory_bytes or 0 for s in held),
        "largest": [line(s) for s in sorted(held, key=lambda s: -(s.memory_bytes or 0))[:top]],
        "recent": [line(s) for s in sorted(used, key=lambda s: -(s.last_access or 0))[:top]],
    }
