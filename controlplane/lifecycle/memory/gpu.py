"""Video memory per model and GPU: measured, budgeted per GPU, evicted in the host budget's order.

Measured per process through NVML where NVML's pids map to the ones seen here
(``gpu_memory``), else as what a load added to each GPU's used memory (loads are
serialised on a machine with a GPU, ``Admission.slot``, for that to hold). ``SNOOZE_GPU_MEMORY_BUDGET_MB`` applies to
each GPU on its own: before a load, idle models holding memory on the GPUs it needs are unloaded until
its estimate fits; after it, a measurement above the estimate evicts again; a load that fails with a
CUDA out-of-memory evicts idle models on its GPUs and is retried once. A pre-warm evicts nothing
(``fits``). Without a GPU (no NVML, no device) every call here is a no-op.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from controlplane.errors import UnavailableError
from controlplane.lifecycle.memory.gpu_budget import (
    GpuResident,
    estimate_gpu_need,
    gpu_instances_per_device,
    plan_gpu_eviction,
    plan_gpu_oom_eviction,
)
from controlplane.lifecycle.memory.gpu_memory import (
    GpuLoadDelta,
    GpuProcessReader,
    NvmlPidMap,
    NvmlReader,
    per_model_gpu_bytes,
)
from controlplane.lifecycle.memory.plan import Plan
from controlplane.lifecycle.state import ModelRecord, ModelState, ModelStates
from controlplane.settings import Settings
from controlplane.triton.processes import TritonProcesses

log = logging.getLogger("snoozeml.lifecycle")


class GpuMemory:
    def __init__(
        self,
        settings: Settings,
        states: ModelStates,
        processes: TritonProcesses,
        *,
        pending: Callable[[], Awaitable[dict[str, float]]],
        reader: GpuProcessReader | None = None,
        pid_map: NvmlPidMap | None = None,
        order: Callable[[list[ModelRecord]], list[ModelRecord]] | None = None,
    ) -> None:
        self.settings = settings
        self.states = states
        self.processes = processes
        self.reader: GpuProcessReader = reader if reader is not None else NvmlReader()
        self.pid_map = pid_map if pid_map is not None else NvmlPidMap()
        self._pending = pending
        # the eviction order host memory uses (``MemoryBudget.eviction_order``), so that both evict alike; None:
        # least recently used, pre-warms nobody used first
        self._order = order
        self._devices: list[int] | None = None  # GPU indices, read once

    async def devices(self) -> list[int]:
        if self._devices is None:
            self._devices = [d.index for d in await asyncio.to_thread(self.reader.devices)]
        return self._devices

    async def need(self, rec: ModelRecord, instances: int, config: dict[str, Any]) -> dict[int, int]:
        """Bytes per GPU the load will hold: as last measured (per instance), else the average per
        instance of the models measured so far, on the GPUs its config places instances on."""
        devices = await self.devices()
        if not devices:
            return {}
        placed = gpu_instances_per_device(config, devices)
        if rec.memory.gpu_footprint and rec.memory.gpu_instances:
            scale = instances / rec.memory.gpu_instances
            if not placed:  # a KIND_CPU/KIND_MODEL instance that uses a GPU itself: where it was seen
                return {d: int(b * scale) for d, b in rec.memory.gpu_footprint.items()}
            per_device = {d: rec.memory.gpu_instances for d in rec.memory.gpu_footprint}
            return estimate_gpu_need(placed, rec.memory.gpu_footprint, per_device)
        known = [
            sum(r.memory.gpu_footprint.values()) / r.memory.gpu_instances
            for r in self.states.values()
            if r.memory.gpu_footprint and r.memory.gpu_instances
        ]
        return estimate_gpu_need(placed, per_instance_fallback=int(sum(known) / len(known)) if known else 0)

    async def residents(self, exclude: ModelRecord) -> list[GpuResident]:
        pending = await self._pending()
        found = []
        holding = []
        for r in self.states.values():
            if r is exclude:
                continue
            held = (
                r.memory.gpu_reserved
                if r.state is ModelState.LOADING
                else (r.memory.gpu_footprint if r.holds_memory else None)
            )
            if held:
                holding.append((r, held))
        rank = {r.id: i for i, r in enumerate(self._order([r for r, _ in holding]))} if self._order else {}
        for r, held in holding:
            evictable = r.state is ModelState.READY and r.op is None and not r.held and not pending.get(r.id)
            found.append(GpuResident(r.id, dict(held), r.idle_since, evictable, r.prewarmed_unused, rank.get(r.id)))
        return found

    async def fits(self, rec: ModelRecord, need: dict[int, int]) -> bool:
        """Whether ``need`` fits each GPU's budget beside what the other models hold, without evicting."""
        budget = self.settings.gpu_memory_budget_mb
        if budget is None or not need:
            return True
        held = [dataclasses.replace(r, evictable=False) for r in await self.residents(rec)]
        try:
            plan_gpu_eviction(rec.id, need, held, budget)  # nothing evictable: it fits or it raises
        except UnavailableError:
            return False
        return True

    async def plan_room(self, rec: ModelRecord, need: dict[int, int]) -> Plan | None:
        """Idle models to unload, in the eviction order, so that ``need`` fits each GPU's budget; None when it
        fits (UnavailableError: it never can, or everything is in use). Carried out, then asked again."""
        budget = self.settings.gpu_memory_budget_mb
        if budget is None or not need:
            return None
        return self._plan(plan_gpu_eviction(rec.id, need, await self.residents(rec), budget), rec, "gpu_memory")

    async def plan_enforce(self, rec: ModelRecord) -> Plan | None:
        """After a load measured more than its estimate: others to evict until every GPU is within budget."""
        budget = self.settings.gpu_memory_budget_mb
        if budget is None or not rec.memory.gpu_footprint:
            return None
        others = await self.residents(rec)
        return self._plan(plan_gpu_eviction(rec.id, rec.memory.gpu_footprint, others, budget), rec, "gpu_memory")

    async def plan_oom(self, rec: ModelRecord, need: dict[int, int]) -> Plan | None:
        """A load failed with a CUDA out-of-memory: the idle models on its GPUs (best effort)."""
        return self._plan(plan_gpu_oom_eviction(need, await self.residents(rec)), rec, "gpu_oom")

    def _plan(self, victims: list[str], rec: ModelRecord, reason: str) -> Plan | None:
        records = [v for v in (self.states.get(m) for m in victims) if v is not None]
        return Plan(records, reason, rec.id) if records else None

    async def before_load(self) -> GpuLoadDelta | None:
        if not await self.devices():
            return None
        return GpuLoadDelta(await asyncio.to_thread(self.reader.devices))

    async def measure(self, rec: ModelRecord, instances: int, delta: GpuLoadDelta | None) -> None:
        """The model's GPU memory now: per process where NVML's pids can be mapped, else what its load
        added to each GPU (an in-place rescale adds to what it held)."""
        if not await self.devices():
            return
        found = None
        if rec.procs.stubs:
            # a preforked model's CUDA context is its worker's, not its stub's
            pids = {rec.id: [s.pid for s in rec.procs.stubs] + [w.pid for w in rec.procs.workers]}
            found = await asyncio.to_thread(per_model_gpu_bytes, pids, self.reader, self.pid_map)
        if found is not None:
            per_device = found.get(rec.id, {})
        elif delta is not None:
            added = delta.added(await asyncio.to_thread(self.reader.devices))
            per_device = dict(rec.memory.gpu_footprint or {}) if rec.loaded else {}
            for device, amount in added.items():
                per_device[device] = per_device.get(device, 0) + amount
        else:
            return
        rec.memory.gpu_footprint, rec.memory.gpu_instances = {d: b for d, b in per_device.items() if b > 0}, instances
        for device in await self.devices():
            self.states.metrics.gpu_memory_bytes.labels(model=rec.id, gpu=str(device)).set(
                rec.memory.gpu_footprint.get(device, 0)
            )

    def forget(self, rec: ModelRecord) -> None:
        for device in self._devices or []:
            self.states.metrics.gpu_memory_bytes.labels(model=rec.id, gpu=str(device)).set(0)

    @staticmethod
    def status_bytes(rec: ModelRecord) -> dict[str, int] | None:
        if not rec.loaded or rec.memory.gpu_footprint is None:
            return None
        return {str(d): b for d, b in sorted(rec.memory.gpu_footprint.items())}

    def close(self) -> None:
        close = getattr(self.reader, "close", None)
        if callable(close):
            close()


__all__ = ["GpuMemory"]
