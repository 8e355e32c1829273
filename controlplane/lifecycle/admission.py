"""Where a load waits before it starts: the wake queue (a load slot, then memory, in the order loads asked), and
the room the memory accountant's plans make for it (idle models evicted first, host and GPU). The loader has one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from controlplane.clock import Clock
from controlplane.errors import UnavailableError
from controlplane.lifecycle.configs import config_for, config_with_instances
from controlplane.lifecycle.memory.gpu import GpuMemory
from controlplane.lifecycle.memory.host import BudgetInUse, MemoryBudget
from controlplane.lifecycle.memory.plan import EvictFn, carry_out
from controlplane.lifecycle.state import ModelRecord, ModelStates
from controlplane.metrics import SnoozeMetrics
from controlplane.settings import Settings
from controlplane.triton.processes import TritonProcesses

log = logging.getLogger("snoozeml.lifecycle")
# A wait bound closer than this has passed (a shorter timer would not move a clock at its resolution).
DEADLINE_SLACK_SECS = 1e-3
# How often a wake-up waiting for memory (held by loads and requests in flight) looks again.
MEMORY_WAIT_POLL_SECS = 0.05


class WakeQueueTimeout(UnavailableError):
    """A wake-up whose load could not start within its requests' wait bound (``wake_queue_timeout_secs``)."""

    def __init__(self, model_id: str, waiting_for: str, waited: float, queue: dict[str, Any], retry_after: float):
        ahead = [w["model"] for w in queue["waiting"] if w["model"] != model_id]
        fix = (
            "raise SNOOZE_MEMORY_BUDGET_MB so more models stay loaded"
            if waiting_for == "memory"
            else "raise SNOOZE_MAX_CONCURRENT_LOADS (or SNOOZE_MEMORY_BUDGET_MB, so fewer loads are needed)"
        )
        super().__init__(
            f"model '{model_id}' is asleep and its load could not start within {waited:.1f}s: it waited for "
            f"{waiting_for} ({len(ahead)} other load(s) waiting: {', '.join(ahead) or 'none'})",
            hint=f"retry after {retry_after:g}s; {fix}; or raise SNOOZE_WAKE_QUEUE_TIMEOUT_SECS to wait longer",
            retry_after=retry_after,
        )
        self.model_id = model_id
        self.waiting_for = waiting_for
        self.kind = "memory" if waiting_for == "memory" else "slot"  # the metric's label


class NoRoomToPrewarm(UnavailableError):
    """A pre-warm whose estimate does not fit the free memory budget: skipped, nothing evicted for it."""


class Admission:
    """The wake queue and the room a load needs (``Loader``'s waiting half). ``evict`` carries out the budgets'
    plans (the unload transitions' ``Unloads.evict``); ``hear`` reads the wakes of dozing models
    (``Dozing.hear_dozing``), so that a load is admitted against what a woken model holds, not its doze."""

    def __init__(
        self,
        settings: Settings,
        states: ModelStates,
        budget: MemoryBudget,
        gpu: GpuMemory,
        processes: TritonProcesses,
        metrics: SnoozeMetrics,
        *,
        evict: EvictFn,
        hear: Callable[[], Awaitable[None]] | None = None,
        clock: Clock,
    ) -> None:
        self.settings = settings
        self.states = states
        self.budget = budget
        self.gpu = gpu
        self.processes = processes
        self.clock = clock
        self._evict_one = evict
        self._hear = hear
        # Host-memory loads run side by side (each reserves its memory first); on a machine with a GPU they run
        # one at a time: a load's GPU memory may be measured as what the GPU's used memory grew by (gpu.py).
        self._slots = asyncio.Semaphore(settings.max_concurrent_loads)
        self._one_at_a_time = asyncio.Lock()
        # wakes from doze make room one at a time (each pass: hear, plan, evict), not across their waits for memory
        self._wake_rooms = asyncio.Lock()
        # the wake queue: model -> (monotonic seconds it began waiting, what for: "a load slot" or "memory")
        self.queue: dict[str, tuple[float, str]] = {}
        # every load waiting for memory (wake-ups, and reloads, API loads and recoveries too): model -> since when;
        # they take turns in this order
        self._line: dict[str, float] = {}
        metrics.wake_queue_length.set_function(lambda: len(self.queue))
        metrics.wake_queue_oldest_seconds.set_function(self._oldest_wait)

    @property
    def slot_free(self) -> bool:
        """A load could start now without waiting for another to end."""
        return not self._slots.locked() and not self._one_at_a_time.locked()

    def queued(self, rec: ModelRecord) -> bool:
        """The model's load waits to start (for a load slot, or for memory)."""
        return rec.id in self.queue

    def wake_queue(self) -> dict[str, Any]:
        """Loads waiting to start, oldest first: what they wait for and since how long (seconds)."""
        now = self.clock.monotonic()
        waiting = sorted(self.queue.items(), key=lambda item: item[1][0])
        return {
            "length": len(waiting),
            "oldest_wait_secs": round(self._oldest_wait(), 3),
            "wait_bound_secs": self.settings.wake_queue_timeout_secs,
            "waiting": [
                {"model": m, "waiting_for": what, "wait_secs": round(now - since, 3)} for m, (since, what) in waiting
            ],
        }

    def _oldest_wait(self) -> float:
        queue = list(self.queue.values())  # read from the metrics' thread too
        return self.clock.monotonic() - min(since for since, _ in queue) if queue else 0.0

    def queue_retry_after(self) -> float:
        """Seconds until the queue ahead has probably drained: its loads at their last measured times."""
        times = sorted(r.load.last_cold_start for r in self.states.values() if r.load.last_cold_start)
        typical = times[len(times) // 2] if times else 1.0
        return max(1.0, round(len(self.queue) * typical / self.settings.max_concurrent_loads, 1))

    def gave_up(self, rec: ModelRecord, what: str) -> WakeQueueTimeout:
        since = self.queue.get(rec.id, (self.clock.monotonic(), what))[0]
        waited = self.clock.monotonic() - since
        return WakeQueueTimeout(rec.id, what, waited, self.wake_queue(), self.queue_retry_after())

    @contextlib.asynccontextmanager
    async def slot(self, rec: ModelRecord, *, bounded: bool) -> AsyncIterator[None]:
        """A load slot; ``bounded``: given up (``WakeQueueTimeout``) when ``rec.load.wake_deadline`` passes first."""
        self.queue[rec.id] = (self.clock.monotonic(), "a load slot")
        try:
            while True:
                left = (
                    rec.load.wake_deadline - self.clock.monotonic()
                    if bounded and rec.load.wake_deadline is not None
                    else None
                )
                if left is None or not self._slots.locked():
                    await self._slots.acquire()
                    break
                if left <= DEADLINE_SLACK_SECS:  # not a timer shorter than the clock's resolution
                    raise self.gave_up(rec, "a load slot")
                try:
                    await asyncio.wait_for(self._slots.acquire(), left)
                    break
                except TimeoutError:
                    continue  # a request that came since may have moved the deadline
        finally:
            self.queue.pop(rec.id, None)
        try:
            if await self.gpu.devices():
                async with self._one_at_a_time:
                    yield
            else:
                yield
        finally:
            self._slots.release()

    async def make_room(
        self, rec: ModelRecord, instances: int, need: int, gpu_need: dict[int, int], *, bounded: bool, beside: int = 0
    ) -> int:
        """Evict for the load (``beside``: what the loaded version holds while a reload builds the new one). While
        the memory is held by loads and requests in flight (nothing idle to evict), a bounded wake-up waits for
        it, without its reservation, until its deadline; other loads wait without a bound.

        A model of unknown size (nothing measured yet, nothing declared, its processes in view) loads alone and
        reserves all the free memory: no other load starts beside it until it is measured (four such loads at
        once, each estimated at 0 MiB, then a fifth estimated from the first to finish, overran the budget). Loads
        waiting meanwhile are estimated again once it is. Returns the estimate the load went ahead with."""
        try:
            while True:
                if self._hear is not None:  # a warm-path wake since the last sweep: charged at its full size first
                    await self._hear()
                if unknown := self._size_unknown(rec, need):
                    need = self.budget.estimate(rec, instances)  # another load may have been measured since
                    unknown = self._size_unknown(rec, need)
                reserve = 0 if unknown else need + beside
                rec.memory.reserved, rec.memory.gpu_reserved = reserve, gpu_need
                # Loads run side by side where memory allows: one that must evict waits for the loads in
                # flight (theirs are about to be measured, and their reservations would push out models the
                # policy keeps for a reason). Measured: churn, 40 models, 8 clients, hot set p50 1.4 s with
                # four evicting loads at once, 17 ms with one.
                alone = not self._loading_beside(rec) and self._first_in_line(rec)
                if unknown and alone:
                    rec.memory.reserved = max(self.budget.free(rec), 0)
                    await self._gpu_room(rec, gpu_need)
                    return need
                if not unknown and (self.budget.fits(rec, reserve) or alone):
                    try:
                        await self._gpu_room(rec, gpu_need)
                        await self._host_room(rec, need, beside=beside)
                        return need
                    except BudgetInUse:
                        if not bounded or rec.load.wake_deadline is None:
                            raise
                self._line.setdefault(rec.id, self.clock.monotonic())
                if bounded and rec.load.wake_deadline is not None:
                    self.queue.setdefault(rec.id, (self.clock.monotonic(), "memory"))
                    if self.clock.monotonic() >= rec.load.wake_deadline:
                        raise self.gave_up(rec, "memory") from None
                rec.memory.reserved, rec.memory.gpu_reserved = 0, {}  # waiting: the others may use what it would take
                await asyncio.sleep(MEMORY_WAIT_POLL_SECS)
        finally:
            self.queue.pop(rec.id, None)
            self._line.pop(rec.id, None)

    async def wake_room(self, rec: ModelRecord, *, until: float | None = None) -> str | None:
        """Room for the wake of a dozing model (an ensemble's step that its request is about to wake inside Triton,
        ``RequestPath.wake_step``; a stub about to fork, ``RequestPath.admit_doze_wake``), which the caller has made
        count what it held awake (``MemoryBudget.held``): idle models are evicted to make room, one wake's pass at a
        time. While the memory is
        held by models in use, it waits for it until ``until`` (the clock's monotonic seconds; None: it does not
        wait). Best effort: None once there is room, else why the wake goes ahead over the budget (a sweep evicts
        once it can). A record that stops dozing meanwhile (a failed rescale resets it, awake) counts what it holds
        awake, and room is made for that: it was answered as made while the tree held 400 MiB of 300 (dozing
        machine seed 3601441757)."""
        awake = rec.doze.awake_footprint or self.budget.estimate(rec, max(len(rec.procs.stubs), 1), own=False)
        while True:
            async with self._wake_rooms:
                need = awake if rec.doze.dozing else self.budget.held(rec)
                # other wakes heard before victims are picked (an awake victim dozes, not unloads); where it fits, no
                # victim is picked and no stub's note is read (every wake that asked already counts awake)
                if self._hear is not None and not self.budget.fits(rec, need):
                    await self._hear()
                    need = awake if rec.doze.dozing else self.budget.held(rec)
                try:
                    await self._host_room(rec, need)
                    return None
                except UnavailableError as e:
                    held = isinstance(e, BudgetInUse) and rec.op is None and rec.ready
                    if not held or until is None or self.clock.monotonic() + MEMORY_WAIT_POLL_SECS > until:
                        log.info("model '%s': its wake from doze goes ahead over the budget: %s", rec.id, e.message)
                        return e.message
            await asyncio.sleep(MEMORY_WAIT_POLL_SECS)  # not holding the others' turns meanwhile

    async def _host_room(self, rec: ModelRecord, need: int, *, beside: int = 0) -> None:
        """Carry out the host budget's plans until the load fits (BudgetInUse: nothing idle left to evict)."""
        while (plan := await self.budget.plan_room(rec, need, beside=beside)) is not None:
            if await carry_out(plan, self._evict_one):
                continue
            if (wait := self.budget.still_over(rec, need, beside=beside)) is not None:
                raise wait

    async def _gpu_room(self, rec: ModelRecord, need: dict[int, int]) -> None:
        """Carry out the GPU budget's plans until the load fits each GPU (or nothing more could be evicted)."""
        for _ in range(len(self.states.records) + 1):  # each pass unloads at least one model, or stops
            plan = await self.gpu.plan_room(rec, need)
            if plan is None or not await carry_out(plan, self._evict_one):
                return

    async def enforce(self, rec: ModelRecord | None = None, *, estimate: int | None = None) -> list[str]:
        """Evict idle models (not ``rec``) until the host budget and Triton's cgroup ceiling hold again; their ids.
        A plan whose victims dozed is planned again, on what they measured dozing: a doze may free too little (its
        stubs stay), and the next plan unloads it whole in the same sweep (dozing machine seed 3118721135: a doze
        left the tree 20 MiB over until the next sweep). Not after unloads alone, nor over the cgroup's ceiling:
        its usage is read once a sweep, and planning again on it would evict more than was needed."""
        evicted: list[str] = []
        for _ in range(len(self.states.records) + 1):  # each round dozes a model at least, or it is the last
            plan = await self.budget.plan_enforce(rec)
            if plan is None:
                break
            done = await carry_out(plan, self._evict_one)
            self.budget.enforced(plan, done, rec, estimate=estimate)
            evicted += done
            dozed = any((r := self.states.get(m)) is not None and r.doze.dozing for m in done)
            if plan.ceiling or not dozed:
                break
        return evicted

    async def evict(self, rec: ModelRecord | None, amount: int, reason: str) -> list[str]:
        """Unload idle models but ``rec`` in the eviction order until ``amount`` bytes are freed; their ids."""
        return await carry_out(await self.budget.plan_evict(rec, amount, reason), self._evict_one)

    def _size_unknown(self, rec: ModelRecord, need: int) -> bool:
        """No estimate for the model's memory although it will be measured (a python model, processes in view)."""
        return not need and self.budget.budget_mb is not None and rec.is_python and self.processes.visible

    def _first_in_line(self, rec: ModelRecord) -> bool:
        """No other load has waited for memory longer (evicting loads take turns in arrival order)."""
        mine = self._line.get(rec.id)
        others = [since for m, since in list(self._line.items()) if m != rec.id]
        return not others or (mine is not None and mine <= min(others))

    def _loading_beside(self, rec: ModelRecord) -> bool:
        """Another load holds a reservation now: it is making room or loading in Triton (a cold load, or a reload
        or rescale of a loaded model)."""
        return any(r is not rec and r.memory.reserved for r in self.states.values())

    async def fits_free(self, rec: ModelRecord, instances: int, *, measured: bool = False) -> bool:
        """Whether the model with ``instances`` fits the free host and GPU budgets without evicting anything: its
        estimate, or (``measured``) what it holds now that it is loaded."""
        if measured:
            need, gpu_need = rec.memory.footprint or 0, dict(rec.memory.gpu_footprint or {})
        else:
            need = self.budget.estimate(rec, instances)
            placed = config_for(rec.model, rec.load.config_override)
            gpu_need = await self.gpu.need(rec, instances, config_with_instances(placed, instances))
        return self.budget.fits(rec, need) and await self.gpu.fits(rec, gpu_need)
