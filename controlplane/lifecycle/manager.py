"""The lifecycle manager: builds the lifecycle's parts, hands each what it needs, and answers for them.

Its methods are the lifecycle's public operations (``controlplane.lifecycle.port.LifecyclePort``, what the API and
the gateway call; the stack and the snapshot entrypoint start, stop and pause it); each is one call into the part
that owns it. docs/internals.md ("The lifecycle's parts") says which part owns which job, and why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.clock import SYSTEM_CLOCK, Clock
from controlplane.lifecycle.admin import AdminOperations
from controlplane.lifecycle.cancel import LoadCancels
from controlplane.lifecycle.dozing import Dozing
from controlplane.lifecycle.groups import Groups
from controlplane.lifecycle.loading import Loader
from controlplane.lifecycle.memory.cgroup import CgroupMemory, TritonCgroup
from controlplane.lifecycle.memory.gpu import GpuMemory
from controlplane.lifecycle.memory.gpu_memory import GpuProcessReader, NvmlPidMap
from controlplane.lifecycle.memory.host import MemoryBudget
from controlplane.lifecycle.overrides import KEEP_OVERRIDE
from controlplane.lifecycle.request_path import RequestPath
from controlplane.lifecycle.residency import Residency
from controlplane.lifecycle.run_once import RunOnce
from controlplane.lifecycle.sequences import LiveSequences
from controlplane.lifecycle.state import ModelState, ModelStates, ModelStatus, UnloadReason
from controlplane.lifecycle.supervisor import Supervisor
from controlplane.lifecycle.transitions import Transitions, Unloads
from controlplane.lifecycle.triton_sync import TritonReadings, TritonSync, TritonUp
from controlplane.lifecycle.unloading import Unloader
from controlplane.lifecycle.warmth import Warmth
from controlplane.metrics import SnoozeMetrics
from controlplane.settings import Settings
from controlplane.store import ModelStore
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.processes import TritonProcesses
from controlplane.triton.stub_control import SocketStubControl, StubControl

if TYPE_CHECKING:
    from controlplane.triton.launcher import EmbeddedTriton


class LifecycleManager:
    """Wake on request, idle unload, memory budget and eviction, autoscaling, recovery: the parts, wired."""

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
        stub_control: StubControl | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``gpu_reader`` / ``gpu_pid_map``: NVML and its pid mapping (tests inject them: no GPU here); ``cgroup``:
        reads Triton's memory cgroup (default: found through tritonserver's pid under /proc and /sys);
        ``stub_control``: asks stubs to doze (default: their sockets in the journal folder); ``clock``: what every
        part reads time from (the fast tier's is virtual)."""
        if processes is None:
            processes = triton_process.processes() if triton_process is not None else TritonProcesses.unseen()
        if journal_dir is None and triton_process is not None:
            journal_dir = triton_process.journal_dir
        self.settings = settings
        self.store = store
        self.processes = processes
        self.journal_dir = journal_dir
        self.metrics = metrics = metrics or SnoozeMetrics()
        self.states = states = ModelStates(store, metrics)
        self.warmth = Warmth(settings, metrics, clock=clock.time)
        self.sequences = LiveSequences(journal_dir)  # live sequences hold their model as a user
        self.triton_up = TritonUp(settings, restarts=triton_process is not None)
        self.groups = Groups(self.states)
        readings = TritonReadings(triton)
        self.budget = budget = MemoryBudget(
            settings,
            states,
            pending=readings.pending_counts,
            server_memory=processes.server_memory,
            cgroup=cgroup if cgroup is not None else TritonCgroup.of(processes).read,
            groups=self.groups,
            refresh=readings.refresh_all,
        )
        states.on_drop.append(budget.forget)
        gpu = GpuMemory(
            settings,
            states,
            processes,
            pending=readings.pending_counts,
            reader=gpu_reader,
            pid_map=gpu_pid_map,
            order=budget.eviction_order,
        )
        self.dozing = Dozing(
            settings,
            states,
            stub_control if stub_control is not None else SocketStubControl(journal_dir, processes.proc_root),
            budget,
            readings,
            processes,
            metrics,
            journal_dir=journal_dir,
            clock=clock,
        )
        self._build_parts(settings, store, triton, readings, gpu, triton_process, clock)

    def _build_parts(
        self,
        settings: Settings,
        store: ModelStore,
        triton: TritonAdminClient,
        readings: TritonReadings,
        gpu: GpuMemory,
        triton_process: EmbeddedTriton | None,
        clock: Clock,
    ) -> None:
        """The parts over the records, the budgets and Triton's readings, each handed what it uses."""
        states, warmth, metrics, budget, up = self.states, self.warmth, self.metrics, self.budget, self.triton_up
        processes, journal_dir = self.processes, self.journal_dir
        residency = Residency(warmth, gpu, metrics, processes, journal_dir=journal_dir, clock=clock)
        self.unloader = Unloader(
            settings, triton, processes, metrics, pending=readings.pending_counts, journal_dir=journal_dir, clock=clock
        )
        unloads = Unloads(
            states, self.unloader, budget, residency, processes, metrics, self.groups, readings=readings, clock=clock
        )
        self.loader = loader = Loader(
            settings,
            states,
            triton,
            processes,
            budget,
            gpu,
            metrics,
            warmth,
            residency,
            wait_for_triton=up.wait_until_up,
            # the budgets plan evictions; the loader carries them out with this (a victim that can doze dozes first)
            evict=self.dozing.doze_first(unloads.evict),
            hear=self.dozing.hear_dozing,
            journal_dir=journal_dir,
            clock=clock,
        )
        self.transitions = transitions = Transitions(states, store, triton, loader, unloads, warmth, metrics)
        self.sync = sync = TritonSync(
            settings,
            store,
            states,
            triton,
            processes,
            metrics,
            up=up,
            budget=budget,
            residency=residency,
            transitions=transitions,
            triton_process=triton_process,
            clock=clock,
        )
        cancels = LoadCancels(
            states, processes, triton, transitions, loader.admission, journal_dir=journal_dir, clock=clock
        )
        self.requests = RequestPath(
            settings,
            states,
            warmth,
            up,
            loader.admission,
            transitions,
            metrics,
            self.groups,
            asked_by=self.dozing.asked_by,
            clock=clock,
        )
        self.run_once = RunOnce(
            states,
            processes,
            transitions,
            residency,
            self.groups,
            wake=self.requests.ensure_ready,
            journal_dir=journal_dir,
            clock=clock,
        )
        self.admin = AdminOperations(
            store,
            states,
            transitions,
            cancels,
            loader,
            warmth,
            processes,
            self.groups,
            wake=self.requests.wake_step,
            journal_dir=journal_dir,
            doze_after=self.dozing.doze_after,
        )
        self.supervisor = Supervisor(
            settings,
            store,
            states,
            sync,
            readings,
            loader,
            transitions,
            self.admin,
            cancels,
            self.run_once,
            self.sequences,
            triton,
            self.dozing,
            journal_dir=journal_dir,
            clock=clock,
        )

    # ------------------------------------------------------------------ the request path and run-once

    async def ensure_ready(self, model_id: str, *, timeout: float | None = None) -> None:
        await self.requests.ensure_ready(model_id, timeout=timeout)

    def serving(self, model_id: str, *, timeout: float | None = None) -> contextlib.AbstractAsyncContextManager[None]:
        return self.requests.serving(model_id, timeout=timeout)

    async def admit(self, model_id: str, request_id: str) -> None:
        await self.run_once.admit(model_id, request_id)

    async def admit_doze_wake(self, model_id: str, stub: tuple[int, int] | None, *, timeout: float) -> dict[str, Any]:
        if self.paused or self.states.stopping:  # no eviction runs (a snapshot; a stop): the wake goes ahead
            self.metrics.doze_wake_rooms.labels(model=model_id, outcome="unasked").inc()
            return {"admitted": False, "why": "the control plane is " + ("paused" if self.paused else "stopping")}
        return await self.requests.admit_doze_wake(model_id, stub, timeout=timeout)

    async def after_dead_answer(self, model_id: str, request_id: str) -> None:
        await self.run_once.after_dead_answer(model_id, request_id)

    async def recover(self, model_id: str, cause: str) -> None:
        await self.run_once.recover(model_id, cause)

    def add_state_listener(self, listener: Callable[[str, ModelState | None], None]) -> None:
        self.requests.add_state_listener(listener)

    def remove_state_listener(self, listener: Callable[[str, ModelState | None], None]) -> None:
        self.requests.remove_state_listener(listener)

    # ------------------------------------------------------------------ the admin operations

    async def load(
        self, model_id: str, *, instances: int | None = None, override: dict[str, Any] | None | object = KEEP_OVERRIDE
    ) -> ModelStatus:
        return await self.admin.load(model_id, instances=instances, override=override)

    async def unload(self, model_id: str, *, reason: UnloadReason | str = UnloadReason.API) -> ModelStatus:
        return await self.admin.unload(model_id, reason=reason)

    async def published(self, model_id: str) -> None:
        await self.admin.published(model_id)

    async def forget(self, model_id: str) -> None:
        await self.admin.forget(model_id)

    def config_override(self, model_id: str) -> dict[str, Any] | None:
        return self.admin.config_override(model_id)

    def status(self, model_id: str) -> ModelStatus:
        return self.admin.status(model_id)

    def statuses(self, model_ids: list[str] | None = None) -> list[ModelStatus]:
        return self.admin.statuses(model_ids)

    def states_of(self, model_ids: list[str]) -> list[ModelState]:
        """Each model's state (a listing's filter by state: no status built, no record read or made; 50,000
        models: one dictionary lookup each)."""
        active, unloaded = self.states.active, ModelState.UNLOADED
        return [active.get(m, unloaded) for m in model_ids]

    def runtime(self) -> dict[str, Any]:
        return self.admin.runtime()

    # ------------------------------------------------------------------ the periodic jobs

    async def start(self) -> None:
        await self.supervisor.start()

    async def stop(self) -> None:
        await self.supervisor.stop()

    async def pause(self) -> None:
        await self.supervisor.pause()

    def resume(self) -> None:
        self.supervisor.resume()

    @property
    def paused(self) -> bool:
        return self.supervisor.paused

    async def wait_for_sequences(self, timeout: float) -> dict[str, int]:
        return await self.supervisor.wait_for_sequences(timeout)

    async def sweep(self) -> None:
        await self.supervisor.sweep()

    async def watch(self) -> None:
        await self.supervisor.watch()

    async def follow_store(self) -> None:
        await self.supervisor.follow_store()
