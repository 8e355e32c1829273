"""The GPU memory budget: which idle models to unload before a load, and what a GPU out-of-memory says.

``SNOOZE_GPU_MEMORY_BUDGET_MB`` is one number that applies to each GPU on its own. A load that
would take a GPU past it first unloads idle models holding memory on that
GPU (``plan_gpu_eviction``; in the host budget's order where ``rank`` carries it: a pre-warmed model not used
yet first, then gdsf or lru per SNOOZE_EVICTION_POLICY); a load that fails
with a GPU out-of-memory (``oom.classify_oom``) evicts idle models on its GPUs (``plan_gpu_oom_eviction``)
and retries once, as for host memory.
Everything here is pure: the lifecycle gathers the numbers, unloads the victims, and calls again if
one of them could not be unloaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controlplane.errors import UnavailableError
from controlplane.lifecycle.memory.eviction import bets_first
from controlplane.lifecycle.memory.units import MIB


@dataclass(frozen=True)
class GpuResident:
    """A model that holds (or, while loading, has reserved) GPU memory."""

    model: str
    bytes_by_device: Mapping[int, int]
    last_access: float  # epoch seconds; the least recent goes first
    evictable: bool  # READY, not in use, no pending requests and no transition running
    prewarmed_unused: bool = False  # loaded by a pre-warm and not used yet: evicted before any other
    # its place in the eviction order host memory uses (``MemoryBudget.eviction_order``: the unused pre-warms,
    # then the policy's); None: least recently used
    rank: int | None = None


def _in_order(residents: Iterable[GpuResident]) -> list[GpuResident]:
    """In ``rank`` order where given (one order for host and GPU memory), else least recently used first; the
    unused pre-warms first either way (``eviction.bets_first``)."""
    ranked = sorted(residents, key=lambda r: (r.rank if r.rank is not None else -1, r.last_access, r.model))
    return bets_first(ranked, lambda r: r.prewarmed_unused)


def plan_gpu_eviction(
    model: str, need: Mapping[int, int], residents: Iterable[GpuResident], budget_mb: float | None
) -> list[str]:
    """The models to unload so that ``model``'s ``need`` (bytes per GPU) fits under the per-GPU budget.

    Per GPU the model needs room on, idle residents holding memory there are taken in eviction
    order (``_in_order``); a victim frees its memory on every GPU it holds. ``residents`` leaves out ``model``
    itself and includes loading models (with their reservation, not evictable). Returns the victims,
    in that order ([] when it fits or there is no budget); raises ``UnavailableError``
    naming the model, the GPU and the MiB when even unloading every idle model would not do.
    """
    if budget_mb is None:
        return []
    budget = int(budget_mb * MIB)
    for device, amount in sorted(need.items()):
        if amount > budget:
            raise UnavailableError(
                f"model '{model}' needs about {amount / MIB:.0f} MiB on GPU {device}, more than the whole GPU "
                f"memory budget ({budget_mb:g} MiB per GPU)",
                hint="raise SNOOZE_GPU_MEMORY_BUDGET_MB, or load the model with fewer instances on that GPU",
            )
    residents = list(residents)
    held: dict[int, int] = {}
    for r in residents:
        for device, amount in r.bytes_by_device.items():
            held[device] = held.get(device, 0) + amount
    candidates = _in_order(r for r in residents if r.evictable)
    victims: list[GpuResident] = []
    for device, amount in sorted(need.items()):
        if amount <= 0:
            continue
        for r in candidates:
            if held.get(device, 0) + amount <= budget:
                break
            if any(v is r for v in victims) or r.bytes_by_device.get(device, 0) <= 0:
                continue
            victims.append(r)
            for d, b in r.bytes_by_device.items():
                held[d] -= b
        if held.get(device, 0) + amount > budget:
            _raise_full(model, device, amount, held.get(device, 0), budget_mb, residents, victims)
    return [r.model for r in _in_order(victims)]


def _raise_full(
    model: str,
    device: int,
    amount: int,
    held: int,
    budget_mb: float,
    residents: list[GpuResident],
    victims: list[GpuResident],
) -> None:
    busy = sorted(
        r.model for r in residents if all(v is not r for v in victims) and r.bytes_by_device.get(device, 0) > 0
    )
    raise UnavailableError(
        f"GPU memory budget full on GPU {device}: model '{model}' needs about {amount / MIB:.0f} MiB and "
        f"{held / MIB:.0f} of {budget_mb:g} MiB are held by models in use ({', '.join(busy)})",
        hint="retry when they are idle, raise SNOOZE_GPU_MEMORY_BUDGET_MB, or place the model on another GPU "
        "(instance_group gpus)",
        retry_after=5,
    )


def plan_gpu_oom_eviction(need: Mapping[int, int], residents: Iterable[GpuResident]) -> list[str]:
    """After a load failed with a GPU out-of-memory: the idle models to unload before its one retry.

    Per GPU in ``need`` (every GPU a resident holds memory on, when ``need`` is empty because the
    placement is unknown), idle residents holding memory there, in eviction order, until they
    free the need there (at least one model, as a need of 0 means "not known"). Best effort: [] when
    no idle model holds memory there, and the caller reports the out-of-memory with ``GPU_OOM_HINT``.
    """
    residents = list(residents)
    amounts = {d: max(n, 1) for d, n in need.items()}
    if not amounts:
        amounts = {d: 1 for r in residents for d, b in r.bytes_by_device.items() if b > 0}
    candidates = _in_order(r for r in residents if r.evictable)
    victims: list[GpuResident] = []
    freed: dict[int, int] = {}
    for device, amount in sorted(amounts.items()):
        for r in candidates:
            if freed.get(device, 0) >= amount:
                break
            if any(v is r for v in victims) or r.bytes_by_device.get(device, 0) <= 0:
                continue
            victims.append(r)
            for d, b in r.bytes_by_device.items():
                freed[d] = freed.get(d, 0) + b
    return [r.model for r in _in_order(victims)]


def gpu_instances_per_device(config: Mapping[str, Any], devices: Sequence[int]) -> dict[int, int]:
    """How many instances of a model Triton puts on each GPU, from its config (the load-override JSON).

    Triton places ``count`` instances of a KIND_GPU group on each GPU in ``gpus``, or on each visible
    GPU when ``gpus`` is empty; KIND_AUTO means GPU when there is one. KIND_CPU and KIND_MODEL hold none
    that Triton places (a KIND_MODEL model picks its own device).
    """
    placed: dict[int, int] = {}
    for group in config.get("instance_group") or [{}]:
        kind = group.get("kind", "KIND_AUTO")
        if kind not in ("KIND_GPU", "KIND_AUTO") or not devices:
            continue
        count = int(group.get("count") or 1)
        for device in group.get("gpus") or devices:
            placed[int(device)] = placed.get(int(device), 0) + count
    return placed


def estimate_gpu_need(
    instances_by_device: Mapping[int, int],
    measured: Mapping[int, int] | None = None,
    measured_instances: Mapping[int, int] | None = None,
    per_instance_fallback: int = 0,
) -> dict[int, int]:
    """Bytes a load will take on each GPU: per instance as last measured on that GPU, else the average
    per instance of the GPUs it was measured on, else ``per_instance_fallback`` (declared or typical)."""
    measured, measured_instances = measured or {}, measured_instances or {}
    per_device = {d: measured[d] / n for d, n in measured_instances.items() if n > 0 and d in measured}
    average = sum(per_device.values()) / len(per_device) if per_device else per_instance_fallback
    return {d: int(per_device.get(d, average) * n) for d, n in instances_by_device.items() if n > 0}
