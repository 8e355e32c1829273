"""The lifecycle manager: wake on request, idle unload, memory budget and eviction, autoscaling, recovery.

The policies live in modules of their own (``state`` the state machine and single flight, ``memory``
the budget and eviction, ``autoscale`` the scaling rule, ``recovery`` what a dead model process means
for its requests, ``processes`` how Triton's processes are seen, ``loading`` Triton loads); this class
runs them: the public operations the API and the activator call, the transitions, the sweeper (idle
unloads, autoscaling, Triton's health) and the process watch (dead model processes).

What Triton 2.51 answers while a model is being unloaded (measured on the embedded tritonserver):
a request that is already queued or executing when the unload starts completes normally; a request
that arrives while the model is UNLOADING, or after it is unloaded, gets HTTP 404
``{"error":"Request for unknown model: '<m>' has no available versions"}`` / gRPC NOT_FOUND with the
same message (a model Triton never loaded: "... '<m>' is not found"). The gateway retries exactly
these to the activator, whose ``ensure_ready`` waits for the unload to finish and loads the model
again, so no request is lost: before unloading, the model is taken out of service here (state
UNLOADING, so wake-ups wait for the unload instead of racing it) and Triton must report zero
pending requests for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from controlplane.clock import SYSTEM_CLOCK, Clock
from controlplane.lifecycle.loading import Loader
from controlplane.lifecycle.memory import MemoryBudget
from controlplane.lifecycle.memory.cgroup import CgroupMemory, TritonCgroup
from controlplane.lifecycle.memory.gpu import GpuMemory
from controlplane.lifecycle.memory.gpu_memory import GpuProcessReader, NvmlPidMap
from controlplane.lifecycle.operations import Operations
from controlplane.lifecycle.request_path import RequestPath
from controlplane.lifecycle.sequences import LiveSequences
from controlplane.lifecycle.state import ModelStates
from controlplane.lifecycle.supervisor import Supervisor
from controlplane.lifecycle.triton_sync import TritonSync
from controlplane.lifecycle.unloading import Unloader
from controlplane.lifecycle.warmth import Warmth
from controlplane.metrics import SnoozeMetrics
from controlplane.settings import Settings
from controlplane.store import ModelStore
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.processes import TritonProcesses

if TYPE_CHECKING:
    from controlplane.triton.launcher import EmbeddedTriton

log = logging.getLogger("snoozeml.lifecycle")


class LifecycleManager(Supervisor, RequestPath, Operations):
    """Wires the lifecycle's parts; its jobs live in ``supervisor`` (periodic), ``request_path`` (wake, hold, run
    once) and ``operations`` (the API's operations and the transitions)."""

    def __init__(
        self,
        settings: Settings,
        store: ModelStore,
        triton: TritonAdminClient,
        *,
        triton_process: EmbeddedTriton | None = None,
        processes: TritonProcesses | None = None,
        journal_dir: Path | None = None,
        metrics: SnoozeMetrics | None = None,
        gpu_reader: GpuProcessReader | None = None,
        gpu_pid_map: NvmlPidMap | None = None,
        cgroup: Callable[[], CgroupMemory | None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``gpu_reader`` / ``gpu_pid_map``: NVML and its pid mapping (tests inject them: no GPU here); ``cgroup``:
        reads Triton's memory cgroup (default: found through tritonserver's pid under /proc and /sys); ``clock``:
        what every part reads time from (the fast tier's is virtual)."""
        self.settings = settings
        self.clock = clock
        self.store = store
        self.triton = triton
        self.triton_process = triton_process  # the embedded child, which this manager may restart
        if processes is None:
            processes = triton_process.processes() if triton_process is not None else TritonProcesses.unseen()
        self.processes = processes
        if journal_dir is None and triton_process is not None:
            journal_dir = triton_process.journal_dir
        self.journal_dir = journal_dir
        self.metrics = metrics or SnoozeMetrics()
        self.states = ModelStates(store, self.metrics)
        self.warmth = Warmth(settings, self.metrics, clock=clock.time)
        self.sequences = LiveSequences(journal_dir)  # live sequences hold their model as a user
        self.sync = TritonSync(
            settings, store, self.states, triton, processes, self.metrics, triton_process=triton_process
        )
        self.budget = MemoryBudget(
            settings,
            self.states,
            pending=self.sync.pending_counts,
            server_memory=processes.server_memory,
            cgroup=cgroup if cgroup is not None else TritonCgroup.of(processes).read,
        )
        self.states.on_drop.append(self.budget.forget)
        self.budget.unrecorded = self.sync.unrecorded
        self.gpu = GpuMemory(
            settings,
            self.states,
            processes,
            pending=self.sync.pending_counts,
            reader=gpu_reader,
            pid_map=gpu_pid_map,
            order=self.budget.eviction_order,
        )
        self.loader = Loader(
            settings,
            self.states,
            triton,
            processes,
            self.budget,
            self.gpu,
            self.metrics,
            self.warmth,
            wait_for_triton=self.sync.wait_until_up,
            evict=self._evict_one,  # the budgets plan evictions; the loader carries them out with this
            journal_dir=journal_dir,
            clock=clock,
        )
        self.sync.loader, self.sync.warmth, self.sync.accessed = self.loader, self.warmth, self.budget.accessed
        self.unloader = Unloader(
            settings,
            triton,
            processes,
            self.metrics,
            pending=self.sync.pending_counts,
            journal_dir=journal_dir,
            clock=clock,
        )
        self._tasks: list[asyncio.Task[None]] = []
        # one lock per periodic job (sweep, process watch, store), held through one pass so that pause() can
        # wait for it; one job's long pass (the store's reloads) does not hold up the others
        self._passes: dict[str, asyncio.Lock] = {}
        self._unpublished: set[str] = set()  # models the last sweep found loaded or recorded but not published
