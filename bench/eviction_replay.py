"""Eviction policies replayed in virtual time: the policy code the lifecycle runs (``controlplane/lifecycle/
memory/eviction.py``, through the same ``accessed`` / ``loaded`` / ``evicted`` / ``order`` calls ``MemoryBudget``
makes) over request traces, on a memory budget of fixed size, each model with its own memory and load time.

    python -m bench --only eviction            # the synthetic traces below (seconds, no server)

What the replay models: requests one after another (the keep-alive replay's virtual time, without the
concurrency of loads: a miss loads the model before the next request). A request for a loaded model is a hit;
a miss evicts loaded models in the policy's order until the model fits, loads it and charges the client its
load time (the client-visible cold-start seconds). Every request is told to the policy (the lifecycle hears
them, in batches, from Triton's success counts at each sweep). Models never go idle here: only memory
pressure evicts.

Each trace is also replayed with unit sizes (every model the same memory, the budget a number of models),
where the offline optimum is known: Belady's (evict the model whose next request is furthest away) has the
most hits a cache of that many models can have. With varied sizes the optimum is NP-hard; none is shown.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bench.zipf import Zipf
from controlplane.lifecycle.memory.eviction import POLICIES, Candidate, EvictionPolicy, eviction_policy
from controlplane.lifecycle.memory.units import MIB

MODELS = 40
BUDGET_MIB = 400.0  # the churn scenario: 40 models of about 100 MiB each, a 400 MiB budget
UNIT_SLOTS = 4  # the unit-size replay: a budget of this many models
BELADY = "belady (offline optimum)"


@dataclass(frozen=True)
class ReplayModel:
    size_mib: float
    load_secs: float


@dataclass
class ReplayResult:
    policy: str
    requests: int = 0
    hits: int = 0
    loads: int = 0
    cold_start_s: float = 0.0  # what the misses cost their clients: the models' load times

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.requests if self.requests else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_ratio": round(self.hit_ratio, 4), "cold_start_s": round(self.cold_start_s, 1)}


def replay(
    requests: Sequence[str],
    models: dict[str, ReplayModel],
    budget_mib: float,
    policy: EvictionPolicy,
    *,
    name: str | None = None,
) -> ReplayResult:
    """``requests`` (model ids, in order) against ``policy`` on a budget of ``budget_mib``."""
    res = ReplayResult(name or policy.name)
    loaded: dict[str, float] = {}  # model -> its last access (the request's index: the replay's clock)
    used = 0.0
    for now, model_id in enumerate(requests):
        res.requests += 1
        m = models[model_id]
        if model_id in loaded:
            res.hits += 1
        else:
            while loaded and used + m.size_mib > budget_mib:
                candidates = [
                    Candidate(i, models[i].size_mib * MIB, models[i].load_secs, last) for i, last in loaded.items()
                ]
                victim = policy.order(candidates)[0]
                policy.evicted(victim)
                used -= models[victim.id].size_mib
                del loaded[victim.id]
            used += m.size_mib
            res.loads += 1
            res.cold_start_s += m.load_secs
            policy.loaded(model_id)
        loaded[model_id] = float(now)
        policy.accessed(model_id)
    return res


def belady(requests: Sequence[str], models: dict[str, ReplayModel], slots: int) -> ReplayResult:
    """The offline optimum for unit sizes: on a miss with every slot taken, evict the model whose next request
    is furthest in the future (never requested again: first)."""
    res = ReplayResult(BELADY)
    next_use = [0] * len(requests)
    seen: dict[str, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        next_use[i] = seen.get(requests[i], len(requests))
        seen[requests[i]] = i
    loaded: dict[str, int] = {}  # model -> index of its next request
    for i, model_id in enumerate(requests):
        res.requests += 1
        if model_id in loaded:
            res.hits += 1
        else:
            if len(loaded) >= slots:
                del loaded[max(loaded, key=lambda k: loaded[k])]
            res.loads += 1
            res.cold_start_s += models[model_id].load_secs
        loaded[model_id] = next_use[i]
    return res


# ------------------------------------------------------------------------------ synthetic models and traces


def make_models(rng: np.random.Generator, n: int = MODELS, prefix: str = "m") -> dict[str, ReplayModel]:
    """``n`` models of 20-250 MiB (log-uniform, mean about 100 MiB), each loading in 0.1 s plus 2 ms per MiB,
    times a factor of 0.5-4 (some models build or warm up much longer than their size says)."""
    sizes = np.exp(rng.uniform(np.log(20), np.log(250), n))
    loads = (0.1 + 0.002 * sizes) * np.exp(rng.uniform(np.log(0.5), np.log(4.0), n))
    return {
        f"{prefix}{i:03d}": ReplayModel(round(float(s), 1), round(float(t), 3))
        for i, (s, t) in enumerate(zip(sizes, loads, strict=True))
    }


def zipf_ids(rng: np.random.Generator, ids: list[str], s: float, count: int) -> list[str]:
    """``count`` requests over ``ids``, Zipf(``s``) over a random ranking of them."""
    return Zipf(len(ids), s).requests(rng, ids, count)


def zipf_trace(s: float) -> Callable[[np.random.Generator, dict[str, ReplayModel], int], list[str]]:
    def make(rng: np.random.Generator, models: dict[str, ReplayModel], count: int) -> list[str]:
        return zipf_ids(rng, list(models), s, count)

    return make


def scan_trace(rng: np.random.Generator, models: dict[str, ReplayModel], count: int) -> list[str]:
    """Zipf(1.0) traffic; every 500 requests a scan of 20 models requested once and never again (a batch job
    sweeping through its models, or someone trying every model) flushes through. The one-off models are
    added to ``models``."""
    base = zipf_ids(rng, list(models), 1.0, count)
    out: list[str] = []
    one_offs = make_models(rng, n=count // 500 * 20 + 20, prefix="once")
    pool = iter(one_offs)
    for i, model_id in enumerate(base):
        if i and i % 500 == 0:
            for _ in range(20):
                once = next(pool)
                models[once] = one_offs[once]
                out.append(once)
        out.append(model_id)
    return out


def shifting_trace(rng: np.random.Generator, models: dict[str, ReplayModel], count: int) -> list[str]:
    """Zipf(1.0) whose ranking changes four times: the hot set moves to other models."""
    phases = 4
    out: list[str] = []
    for p in range(phases):
        out += zipf_ids(rng, list(models), 1.0, count // phases if p < phases - 1 else count - len(out))
    return out


@dataclass(frozen=True)
class EvictionTrace:
    name: str
    description: str
    make: Callable[[np.random.Generator, dict[str, ReplayModel], int], list[str]]


TRACES: tuple[EvictionTrace, ...] = (
    EvictionTrace("zipf-1.0", "Zipf s=1.0 over 40 models", zipf_trace(1.0)),
    EvictionTrace("zipf-0.8", "Zipf s=0.8 over 40 models (a flatter popularity)", zipf_trace(0.8)),
    EvictionTrace("zipf-1.2", "Zipf s=1.2 over 40 models (a steeper popularity)", zipf_trace(1.2)),
    EvictionTrace("scan", "Zipf s=1.0, and every 500 requests 20 one-off models flushing through", scan_trace),
    EvictionTrace("shifting", "Zipf s=1.0 whose hot set moves to other models 3 times", shifting_trace),
)


# ------------------------------------------------------------------------------ comparing policies


def compare(
    requests: Sequence[str],
    models: dict[str, ReplayModel],
    budget_mib: float,
    *,
    unit_slots: int | None = None,
) -> list[ReplayResult]:
    """Every policy over the same requests (a new policy object each); with ``unit_slots``, Belady too."""
    rows = [replay(requests, models, budget_mib, eviction_policy(p)) for p in POLICIES]
    if unit_slots is not None:
        rows.append(belady(requests, models, unit_slots))
    return rows


def verdict(rows: list[ReplayResult], default: str) -> dict[str, Any]:
    """The issue's test: the default policy at or above LRU's hit ratio (and by how much)."""
    by = {r.policy: r for r in rows}
    chosen, lru = by[default], by["lru"]
    out: dict[str, Any] = {
        "hit_ratio_minus_lru": round(chosen.hit_ratio - lru.hit_ratio, 4),
        "cold_start_s_vs_lru": round(chosen.cold_start_s / lru.cold_start_s, 3) if lru.cold_start_s else None,
        "ok": chosen.hits >= lru.hits,
    }
    if BELADY in by:
        opt = by[BELADY]
        out["hit_ratio_of_optimum"] = round(chosen.hit_ratio / opt.hit_ratio, 4) if opt.hits else None
        out["lru_hit_ratio_of_optimum"] = round(lru.hit_ratio / opt.hit_ratio, 4) if opt.hits else None
    return out


def run(root: Any = None, *, requests: int = 20000, seed: int = 20261201, default: str = "gdsf") -> dict[str, Any]:
    """The ``eviction`` bench section: every policy over every synthetic trace, sized and unit-sized."""
    started = time.perf_counter()
    out: dict[str, Any] = {}
    for i, spec in enumerate(TRACES):
        rng = np.random.default_rng(seed + i)
        models = make_models(rng)
        trace = spec.make(rng, models, requests)
        used = {m: models[m] for m in dict.fromkeys(trace)}
        unit = {m: ReplayModel(1.0, models[m].load_secs) for m in used}
        sized_rows = compare(trace, used, BUDGET_MIB)
        unit_rows = compare(trace, unit, float(UNIT_SLOTS), unit_slots=UNIT_SLOTS)
        out[spec.name] = {
            "description": spec.description,
            "requests": len(trace),
            "models": len(used),
            "memory_mib": round(sum(m.size_mib for m in used.values())),
            "sized": {"rows": [r.to_dict() for r in sized_rows], "verdict": verdict(sized_rows, default)},
            "unit": {"rows": [r.to_dict() for r in unit_rows], "verdict": verdict(unit_rows, default)},
        }
    return {
        "source": f"synthetic, seed {seed} (+ trace index), {requests} requests per trace",
        "default_policy": default,
        "budget_mib": BUDGET_MIB,
        "unit_slots": UNIT_SLOTS,
        "traces": out,
        "ok": all(t["sized"]["verdict"]["ok"] and t["unit"]["verdict"]["ok"] for t in out.values()),
        "replay_wall_s": round(time.perf_counter() - started, 2),
    }
