"""Dozing: the level between awake and unloaded (``python_backend/doze.py`` is the stub's side).

A loaded model whose code runs in a preforked worker (``worker = "preforked"``) dozes after ``doze_after_secs``
without a request (with ``keep_alive = "adaptive"``, after the time its policy learned from its idle times, once it
has seen enough of them: ``AdaptiveKeepAlive.doze_after``): each of its stubs is asked (``StubControl.doze``) to
end its worker, whose memory (and VRAM) goes back to the OS, while the stub lives on and Triton keeps the model
READY. Its next request goes the warm path to the stub, which forks a fresh worker from the preloaded parent and
runs ``load()`` there first; the control plane is on that path only to make room for it (the stub's ask, below),
and hears of the wake at its next sweep, or before it admits a load or another wake (``hear_dozing``), whichever
comes first (the stub's worker note names a live worker again).
``idle_timeout_secs`` keeps its meaning: the keep-alive unloads the model after it, dozing or not.

A preforked ONNX model (the python backend's onnxruntime runner) dozes alike. Other models cannot doze: an in-stub
model's memory is the stub's own (a Python process does not give a freed heap back to the OS, and a framework's
imports stay), and Triton's own backends (ONNX Runtime, TensorRT) hold their sessions inside tritonserver, out of
snoozeml's reach.

Under memory pressure an eviction dozes an awake model that can doze before it unloads any (``doze_first``): a victim
already dozing is unloaded. Accounting: a dozing model is charged what its stubs hold (their PSS, read when it dozes and
at each sweep); what it held awake is kept, so that a wake or a later load is estimated at its full size. A wake happens
inside a request, in the stub, but the stub asks first (``python_backend/doze.py``, ``RequestPath.admit_doze_wake``):
from the ask until the wake is heard the model counts what it held awake and is no victim (``ModelRecord.held``), and
idle models are evicted for it first, one wake at a time (requests straight to several dozing models within one sweep
interval woke them all beside a full budget: dozing machine seed 2526912484, 630 MiB against 300 plus one model of 300).
A record that did not know the asking stub dozes (adopted dozing and not yet asked, or reset by a state change) learns
it from the ask (``asked_by``). An ask whose wake is never heard is forgotten after its bound (``_forget_asks``). A wake
whose stub could not ask (no control plane, no answer in time) is admitted by no one: the next sweep measures it and the
budget's enforcement evicts, and a load admitted before that sweep is admitted against what the woken model holds
(admission hears the wakes first). An ensemble's request wakes all its dozing steps at once, so where the control plane
is on its path (the ensemble's own wake) it admits each step's wake first (``RequestPath.wake_step``). A model found
dozing at adoption (a restarted control plane) is recorded so; the load it was measured at learns no growth
(``loading.UNKNOWN_LOAD_PRIVATE``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path

from controlplane.clock import SYSTEM_CLOCK, Clock
from controlplane.lifecycle.loading import LOAD_ABANDON_SECS
from controlplane.lifecycle.memory.host import MemoryBudget
from controlplane.lifecycle.memory.plan import EvictFn
from controlplane.lifecycle.state import DozeRecord, ModelRecord, ModelState, ModelStates, UnloadReason
from controlplane.lifecycle.triton_sync import TritonReadings
from controlplane.lifecycle.workers import WorkerProcess, worker_bytes, workers_of
from controlplane.metrics import SnoozeMetrics
from controlplane.modes import Worker
from controlplane.settings import Settings
from controlplane.triton.processes import StubProcess, TritonProcesses
from controlplane.triton.stub_control import StubControl, Wake

log = logging.getLogger("snoozeml.lifecycle")


def _key(stub: StubProcess) -> tuple[int, int]:
    return stub.pid, stub.start_ticks


class Dozing:
    """Which loaded models doze, telling their stubs, and hearing their wakes."""

    def __init__(
        self,
        settings: Settings,
        states: ModelStates,
        control: StubControl,
        budget: MemoryBudget,
        readings: TritonReadings,
        processes: TritonProcesses,
        metrics: SnoozeMetrics,
        *,
        journal_dir: Path | None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.settings = settings
        self.states = states
        self.control = control
        self.budget = budget
        self.readings = readings
        self.processes = processes
        self.metrics = metrics
        self.journal_dir = journal_dir
        self.clock = clock
        states.listeners.append(self._state_changed)

    # ------------------------------------------------------------------ which models

    @staticmethod
    def _preforked(rec: ModelRecord) -> bool:
        return rec.is_python and rec.model.deployment.worker == Worker.PREFORKED

    def can_doze(self, rec: ModelRecord) -> bool:
        """A preforked model (custom, or ONNX in the python backend), with a doze time below its idle timeout (else
        it is unloaded first), and no sequences (a live sequence's state is in its worker)."""
        dep = rec.model.deployment
        after = self.settings.doze_after_secs
        return self._preforked(rec) and dep.sequence is None and 0 < after < dep.idle_timeout_secs

    def doze_after(self, rec: ModelRecord) -> float | None:
        """How long the model stays awake after a request: ``doze_after_secs``, or the time its adaptive keep-alive
        learned (``AdaptiveKeepAlive.doze_after``); None where it cannot doze."""
        if not self.can_doze(rec):
            return None
        policy = rec.access.keep_alive
        default = self.settings.doze_after_secs
        return default if policy is None else policy.doze_after(default)

    def due(self, rec: ModelRecord, now: float) -> bool:
        """Idle for its doze time with a stub still awake (the caller checks that nothing uses it)."""
        after = self.doze_after(rec)
        if after is None or not rec.procs.stubs:
            return False
        awake = [s for s in rec.procs.stubs if _key(s) not in rec.doze.stubs]
        return bool(awake) and now - rec.idle_since >= after

    # ------------------------------------------------------------------ the sweep's pass

    async def hear(self, records: Iterable[ModelRecord]) -> None:
        """The sweep's first step: wakes of dozing models, heard and measured before the budget is checked; then
        the models adopted while they dozed."""
        records = list(records)
        self._forget_asks(records)
        await self.hear_dozing(records)
        for rec in records:
            idle = rec.op is None and rec.state is ModelState.READY and not rec.doze.dozing
            if idle and rec.doze.checked != rec.generation and self._preforked(rec):
                await self._find_dozing(rec)

    def _forget_asks(self, records: list[ModelRecord]) -> None:
        """Asked wakes never heard within their bound (the ask's wait for room, then the load's): the wake failed, and
        the stub dozes on. The model counts its doze again."""
        now = self.clock.monotonic()
        for rec in records:
            asked = rec.doze.asked
            bound = self.settings.wake_queue_timeout_secs + rec.model.load_timeout_secs + LOAD_ABANDON_SECS
            for key, at in [(k, at) for k, at in asked.items() if now - at > bound]:
                del asked[key]
                log.info("model '%s': a wake its stub asked room for %.0f s ago was never heard", rec.id, now - at)

    async def _find_dozing(self, rec: ModelRecord) -> None:
        """Stubs that doze though the record says awake: a model adopted while it dozed (a control plane restarted,
        Triton kept it), asked once per generation of the record."""
        generation = rec.generation
        stubs = list(rec.procs.stubs)
        flags = [await asyncio.to_thread(self.control.dozing, s) for s in stubs]
        if rec.generation != generation or rec.state is not ModelState.READY:
            return
        rec.doze.checked = generation
        dozing = {_key(s) for s, flag in zip(stubs, flags, strict=True) if flag}
        if dozing:
            # what it holds awake is not known here (measured dozing at adoption; a reset record's figure may be
            # the doze's): at least what the record counts, and what an unknown model of its kind is estimated at
            awake = self.budget.estimate(rec, len(stubs), own=False)
            rec.doze.awake_footprint = max(rec.memory.footprint or 0, awake)
            rec.doze.stubs, rec.doze.since = frozenset(dozing), self.clock.time()
            await self._measure(rec)
            self.metrics.set_level(rec.id, rec.level)
            log.info("model '%s': found dozing (%d of %d stubs)", rec.id, len(dozing), len(stubs))

    def asked_by(self, rec: ModelRecord, stub: tuple[int, int] | None) -> None:
        """A stub of the model asks room for its wake from doze (``RequestPath.admit_doze_wake``): it dozes, whether or
        not the record knew it (a restarted control plane adopted the model dozing and has not asked its stubs yet;
        a state change reset the record). Such a record learns it as ``_find_dozing`` would, at what the model is
        estimated to hold awake, so that the ask makes room for that and it counts until the wake is heard (dozing
        machine seed 4214762718: adopted dozing at 40 MiB, two stubs woke to 300 with the ask answered as fitting)."""
        known = stub is not None and any(_key(s) == stub for s in rec.procs.stubs)
        if known and stub not in rec.doze.stubs:
            if not rec.doze.dozing:
                awake = self.budget.estimate(rec, len(rec.procs.stubs), own=False)
                rec.doze.awake_footprint = max(rec.memory.footprint or 0, awake)
                rec.doze.since = self.clock.time()
            assert stub is not None
            rec.doze.stubs |= {stub}
            self.metrics.set_level(rec.id, rec.level)
        if rec.doze.dozing:
            rec.doze.asked[stub if known else None] = self.clock.monotonic()

    async def doze_idle(self, ready: Iterable[ModelRecord], idle: set[str], now: float) -> None:
        """The sweep's last step: doze the models due (``idle``: the ids nobody uses or queues for)."""
        for rec in ready:
            if rec.op is None and rec.state is ModelState.READY and rec.id in idle and self.due(rec, now):
                await self.doze(rec)

    async def doze(self, rec: ModelRecord) -> bool:
        """Ask each of its awake stubs to doze; whether any did. A stub running a batch says busy: asked again at a
        later sweep."""
        generation = rec.generation
        awake = [s for s in rec.procs.stubs if _key(s) not in rec.doze.stubs]
        answers = [await asyncio.to_thread(self.control.doze, s) for s in awake]
        if rec.generation != generation or rec.state is not ModelState.READY:
            return False  # it left meanwhile (an unload, a crash): its stubs go with it
        dozed = [s for s, a in zip(awake, answers, strict=True) if a.dozed]
        for stub, answer in zip(awake, answers, strict=True):
            if not answer.dozed and not answer.busy:
                log.debug("model '%s': stub %d did not doze: %s", rec.id, stub.pid, answer.why)
        if not dozed:
            return False
        if not rec.doze.dozing:
            rec.doze.awake_footprint = rec.memory.footprint
        rec.doze.stubs |= {_key(s) for s in dozed}
        rec.doze.since = self.clock.time()
        self.metrics.dozes.labels(model=rec.id).inc(len(dozed))
        await self._measure(rec)
        self.metrics.set_level(rec.id, rec.level)
        log.info("model '%s': dozing (%d of %d stubs; its workers ended)", rec.id, len(dozed), len(rec.procs.stubs))
        return True

    async def hear_dozing(self, records: Iterable[ModelRecord] | None = None) -> None:
        """Stubs of dozing models (``records``, else every loaded one) that a request woke since (their note names a
        live worker again), their notes read in one pass: counted as wakes from doze with the stub's own wake time,
        and measured. The sweep hears them first, and admission before it admits a load: a wake on the warm path is
        not admitted, and until it is heard a dozing model is charged its stubs alone (a load admitted against that
        charge went ahead beside a model woken to its full size, the budget plus two models: dozing machine seed
        2526912484, woken to 300 MiB, charged 40, a load of 150 beside it)."""
        ready = ModelState.READY
        heard = [
            (rec, rec.generation, s)
            for rec in (self.states.loaded() if records is None else records)
            if rec.op is None and rec.state is ready and rec.doze.dozing
            for s in rec.procs.stubs
            if _key(s) in rec.doze.stubs
        ]
        if not heard:
            return
        woke = await asyncio.to_thread(lambda: [self.control.woke(s) for _, _, s in heard])
        found: dict[str, tuple[ModelRecord, int, list[tuple[StubProcess, Wake | None]]]] = {}
        for (rec, generation, stub), wake in zip(heard, woke, strict=True):
            if wake is not None:
                found.setdefault(rec.id, (rec, generation, []))[2].append((stub, wake))
        for rec, generation, stubs in found.values():
            await self._woke(rec, generation, stubs)

    async def _woke(self, rec: ModelRecord, generation: int, read: list[tuple[StubProcess, Wake | None]]) -> None:
        """Counted and measured: the stubs read as woken (``read``) that its record still has dozing (the sweep and
        an admission may both read one wake: it is counted once). Its memory is read first and the record changed in
        one step after it: a record that no longer lists a woken stub dozing is charged what it holds (a check
        between the two saw a model heard awake but charged its doze, dozing machine seed 748220775)."""
        if rec.generation != generation or not rec.doze.dozing:
            return
        if not any(w is not None and _key(s) in rec.doze.stubs for s, w in read):
            return
        measured = await self._read_memory(rec)
        if rec.generation != generation or not rec.doze.dozing:
            return
        awake = [(s, w) for s, w in read if w is not None and _key(s) in rec.doze.stubs]
        if not awake:
            return  # heard meanwhile by the other reader
        for _, wake in awake:
            self.metrics.wakes.labels(model=rec.id, origin="doze").inc()
            if wake.secs is not None:
                self.metrics.wake_seconds.labels(origin="doze").observe(wake.secs)
        rec.doze.stubs -= {_key(s) for s, _ in awake}
        for key in [None, *(_key(s) for s, _ in awake)]:  # their asks are heard (one the record did not know too)
            rec.doze.asked.pop(key, None)
        # its request may still run, unseen by Triton's statistics: idle from now at the earliest, not from before
        rec.access.woke = self.clock.time()
        if not rec.doze.dozing:
            self._restore(rec)
        if measured is not None:
            self._charge(rec, *measured)
        self.metrics.set_level(rec.id, rec.level)
        log.info("model '%s': woke from doze (%d stubs)", rec.id, len(awake))
        # a request woke it: its access is read now, before the budget picks what to evict
        if served := await self.readings.refresh_access(rec):
            self.budget.accessed(rec, served)

    def doze_first(self, unload: EvictFn) -> EvictFn:
        """The evictions the budgets plan (``memory.plan.carry_out``), dozing an awake victim that can doze instead
        of unloading it: its worker's memory goes, its stub stays. A victim already dozing is unloaded, and so is
        every victim of an out-of-memory load (OOM, GPU_OOM: what was measured did not hold). The budget
        asks again after a plan is carried out, measured: when the doze freed too little, it plans once more."""

        async def evict(victim: ModelRecord, reason: str, for_model: str) -> bool:
            # a planned eviction (the budget's arithmetic); after a real out-of-memory a victim goes whole
            planned = reason in (UnloadReason.MEMORY, UnloadReason.GPU_MEMORY)
            awake = self.can_doze(victim) and not victim.doze.dozing and victim.procs.stubs
            if planned and awake and await self.doze(victim):
                log.info(
                    "model '%s': dozed to make room for '%s' (%s) instead of unloaded", victim.id, for_model, reason
                )
                return True
            return await unload(victim, reason, for_model)

        return evict

    # ------------------------------------------------------------------ accounting

    async def _measure(self, rec: ModelRecord) -> None:
        """What its stubs and live workers hold now (a dozing stub has no worker note): the footprint charged."""
        measured = await self._read_memory(rec)
        if measured is not None:
            self._charge(rec, *measured)

    async def _read_memory(self, rec: ModelRecord) -> tuple[tuple[WorkerProcess, ...], int] | None:
        """Its live workers and what they and its stubs hold now; None where its record changed meanwhile."""
        generation = rec.generation
        stubs = list(rec.procs.stubs)

        def read() -> tuple[tuple[WorkerProcess, ...], int]:
            workers = tuple(workers_of(self.journal_dir, stubs))
            pss = worker_bytes(workers, self.processes.proc_root)[0] if workers else 0
            return workers, self.processes.memory(stubs) + pss

        measured = await asyncio.to_thread(read)
        return measured if rec.generation == generation else None

    def _charge(self, rec: ModelRecord, workers: tuple[WorkerProcess, ...], size: int) -> None:
        rec.procs.workers = workers
        if rec.memory.footprint_source == "measured" and size:
            # dozing: what is held now; awake again: at least what it held before it dozed, until a sweep reads it
            rec.memory.footprint = size if rec.doze.dozing else max(size, rec.memory.footprint or 0)
            self.budget.dozed(rec)
            self.metrics.memory_bytes.labels(model=rec.id).set(rec.memory.footprint)

    def _restore(self, rec: ModelRecord) -> None:
        """Awake again (or leaving): estimated at what it held awake until measured."""
        if rec.doze.awake_footprint is not None:
            rec.memory.footprint = max(rec.memory.footprint or 0, rec.doze.awake_footprint)
        rec.doze = DozeRecord()

    def _state_changed(self, model_id: str, state: ModelState | None) -> None:
        """Any state change ends the record of a doze: its stubs are asked again at the next sweep (``_find_dozing``;
        an in-place rescale keeps a dozing stub), and until then the model is estimated at what it held awake. That
        holds for a change to READY too: a reload in place (a republish, a rescale) starts so, with the old stubs
        dozing, and a request during it wakes them on the warm path, unadmitted; the reload counts them awake
        beside the new version (dozing machine seed 219470420: counted at the doze's 40 MiB, woken to 300)."""
        rec = self.states.get(model_id)
        if rec is not None and rec.doze.dozing:
            self._restore(rec)
        elif rec is not None:
            rec.doze = DozeRecord()
        if state is not None:
            self.metrics.set_level(model_id, rec.level if rec is not None else "unloaded")
