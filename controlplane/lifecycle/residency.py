"""A model's stay in memory, as its record keeps it: what is noted when its processes go, and what is cleared when
it leaves (an unload, an eviction, Triton gone). The loader and the unload transitions both end a stay."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from controlplane.clock import Clock
from controlplane.lifecycle.memory.gpu import GpuMemory
from controlplane.lifecycle.recovery import crashes_among, note_deaths
from controlplane.lifecycle.state import ModelRecord
from controlplane.lifecycle.warmth import Warmth
from controlplane.metrics import SnoozeMetrics
from controlplane.triton.processes import StubProcess, TritonProcesses

log = logging.getLogger("snoozeml.lifecycle")


class Residency:
    def __init__(
        self,
        warmth: Warmth,
        gpu: GpuMemory,
        metrics: SnoozeMetrics,
        processes: TritonProcesses,
        *,
        journal_dir: Path | None,
        clock: Clock,
    ) -> None:
        self.warmth = warmth
        self.gpu = gpu
        self.metrics = metrics
        self.processes = processes
        self.journal_dir = journal_dir
        self.clock = clock

    async def note_crashes(self, rec: ModelRecord, leaving: list[StubProcess]) -> None:
        """Before the record lets go of ``leaving`` (its processes, at an unload, a reload or a cancel): those that
        crashed under the transition are noted with the requests they took (``recovery.crashes_among``)."""
        if leaving and self.processes.can_observe:
            crashed = await asyncio.to_thread(crashes_among, self.processes, self.journal_dir, leaving)
            if crashed:
                note_deaths(rec, crashed, self.journal_dir, self.clock)

    def forget_loaded(self, rec: ModelRecord) -> None:
        """The model left memory (unloaded, evicted, or Triton gone)."""
        self.warmth.unloaded(rec)
        rec.instances, rec.memory.triton_may_hold, rec.access.served_seen = 0, False, 0
        rec.load.override_loaded = False  # Triton loads an unloaded model from its files again (measured)
        rec.procs.stubs = ()
        rec.procs.workers = ()
        self.gpu.forget(rec)
        self.metrics.instances.labels(model=rec.id).set(0)
        self.metrics.memory_bytes.labels(model=rec.id).set(0)
