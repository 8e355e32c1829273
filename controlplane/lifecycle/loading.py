"""Loading a model into Triton: the config override, the memory reservation, the OOM retry, the hang limit.

Triton waits for a python model's ``initialize`` (the user's ``load``) without a limit and keeps the
model LOADING meanwhile, so a load that outlives ``load_timeout_secs`` is abandoned: the stub
processes it started are killed (where they can be seen), Triton fails the load and the next request
can try again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from controlplane.clock import SYSTEM_CLOCK, Clock
from controlplane.errors import SnoozeError, TritonModelLoadError, UnavailableError
from controlplane.lifecycle.admission import Admission, NoRoomToPrewarm
from controlplane.lifecycle.autoscale import LoadWindow
from controlplane.lifecycle.configs import config_for, config_with_instances
from controlplane.lifecycle.groups import ensemble_steps
from controlplane.lifecycle.memory.gpu import GpuMemory
from controlplane.lifecycle.memory.gpu_memory import GpuLoadDelta
from controlplane.lifecycle.memory.host import MemoryBudget, declared_bytes
from controlplane.lifecycle.memory.oom import GPU_OOM_HINT, OOM_HINT, classify_oom
from controlplane.lifecycle.memory.plan import EvictFn, carry_out
from controlplane.lifecycle.residency import Residency
from controlplane.lifecycle.state import ModelRecord, ModelState, ModelStates, UnloadReason
from controlplane.lifecycle.warmth import Warmth
from controlplane.lifecycle.warmups import keep_pending
from controlplane.lifecycle.workers import end_model_processes, parents_bytes, worker_bytes, workers_of
from controlplane.metrics import SnoozeMetrics
from controlplane.modes import Worker
from controlplane.settings import Settings
from controlplane.spec.schema import PackageKind
from controlplane.tasks import read_task
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.journal import hung_phase, initialize_started
from controlplane.triton.processes import SWEEP_PSS_MAX_AGE_SECS, TritonProcesses

log = logging.getLogger("snoozeml.lifecycle")
UNKNOWN_LOAD_PRIVATE = 1 << 62  # a load measured with a dozing stub: no growth is learned from it

# After load_timeout_secs, how long Triton gets to fail a load whose stubs were killed; a wake-up
# waits this much longer than load_timeout_secs, so that it reports the load's failure.
LOAD_ABANDON_SECS = 5.0
# How long a load's leftover stubs (instances removed in place) get to exit before the model's
# processes are noted.
STUBS_SETTLE_SECS = 3.0


class Loader:
    """Loads into Triton: the wake queue and the room a load needs first (``admission``), then Triton's load
    (abandoned past the model's load timeout, retried once after an out-of-memory), then its measurements."""

    def __init__(
        self,
        settings: Settings,
        states: ModelStates,
        triton: TritonAdminClient,
        processes: TritonProcesses,
        budget: MemoryBudget,
        gpu: GpuMemory,
        metrics: SnoozeMetrics,
        warmth: Warmth,
        residency: Residency,
        *,
        wait_for_triton: Callable[[ModelRecord], Awaitable[None]],
        evict: EvictFn,
        hear: Callable[[], Awaitable[None]] | None = None,
        journal_dir: Path | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``evict``: the unload of an idle model that carries out the memory budgets' plans; ``hear``: reads the
        wakes of dozing models before a load is admitted (``Admission``)."""
        self.settings = settings
        self.clock = clock
        self.journal_dir = journal_dir  # where preforked models' stubs name their workers (workers.py)
        self.warmth = warmth
        self.residency = residency
        self.states = states
        self.triton = triton
        self.processes = processes
        self.budget = budget
        self.gpu = gpu
        self.metrics = metrics
        self._wait_for_triton = wait_for_triton
        self._evict_one = evict
        self.admission = Admission(
            settings, states, budget, gpu, processes, metrics, evict=evict, hear=hear, clock=clock
        )
        self._swept: frozenset[tuple[int, int]] = frozenset()  # the stubs the last sweep measured

    async def load(
        self, rec: ModelRecord, instances: int, *, trigger: str | None = None, how: str = "files", evict: bool = True
    ) -> float:
        """Load with ``instances``; the seconds Triton's load took. ``trigger`` marks a cold start ("request",
        "api") or a pre-warm ("prewarm").

        ``how``: "files" loads what is published (a reload picks up new files); "in_place" changes
        only the instance count of the loaded model; "replace" rebuilds every instance. ``evict=False``
        (pre-warms): unload nothing to make room, raise ``NoRoomToPrewarm`` where the estimate does not fit.
        """
        loaded = rec.model
        rec.model = self.states.store.get(rec.id)  # Triton reads what is published now
        # a loaded model republished since: Triton builds every instance anew from the new files, even for a change of
        # the instance count alone, beside the old ones (plain machine seed 106818158: a rescale admitted as in place)
        rebuilt = rec.state is ModelState.READY and rec.model.publish != loaded.publish
        if rec.state is not ModelState.READY:  # from unloaded: Triton reads the folder afresh (a loaded one: never)
            keep_pending(rec)
        await self._wait_for_triton(rec)
        bounded = trigger == "request"  # a wake-up gives up the queue when its requests' wait bounds pass
        async with self.admission.slot(rec, bounded=bounded):
            # tritonserver's own memory counts in the budget (memory.py), and it grows with each load
            server_before = await self.budget.measure_server()
            need = self.budget.estimate(rec, instances)
            # A reload (a republish) builds every new instance beside the old ones, which Triton unloads only once
            # the new ones are ready: both count until then (an instance count changed in place keeps the old).
            # Beside the model: what tritonserver itself is expected to grow by (about 2 MiB a python model: without
            # it, a load admitted within the budget left the tree over it once measured).
            kept = how == "in_place" and not rebuilt  # old instances kept as they are: not counted twice
            beside = (rec.memory.footprint or 0) if rec.state is ModelState.READY and not kept else 0
            beside += self.budget.server_growth
            placed = config_for(rec.model, rec.load.config_override)
            gpu_need = await self.gpu.need(rec, instances, config_with_instances(placed, instances))
            # reserved before making room: a load beside it (parallel loads) counts these bytes as taken
            rec.memory.reserved, rec.memory.gpu_reserved = need + beside, gpu_need
            try:
                if evict:
                    need = await self.admission.make_room(
                        rec, instances, need, gpu_need, bounded=bounded, beside=beside
                    )
                elif not (self.budget.fits(rec, need + beside) and await self.gpu.fits(rec, gpu_need)):
                    raise NoRoomToPrewarm(f"model '{rec.id}': not pre-warmed, the free memory budget is too small")
                if how == "in_place" and self.states.store.get(rec.id).publish != rec.model.publish:
                    # republished since this change of instances was admitted (it waited, for a slot or a pause):
                    # Triton would build every instance from the new files under the old version's estimate
                    # (plain machine seed 106818158); the republish's own reload follows, admitted for them
                    raise UnavailableError(
                        f"model '{rec.id}' was republished while its instances were changing",
                        hint="retry: the new version is loaded first",
                        retry_after=1,
                    )
                delta = await self.gpu.before_load()
                started = self.clock.monotonic()
                await self._load_retrying_oom(rec, instances, need, gpu_need, how, evict=evict)
                if how == "files":  # an in-place change keeps the config Triton has
                    rec.load.override_loaded = rec.load.config_override is not None
                elapsed = self.clock.monotonic() - started
                await self.loaded(rec, instances, gpu_delta=delta)  # measured: the reservation can go
                self.budget.hold_floor(rec, need)  # ... but not below the estimate until it has answered
                await self.budget.measure_server()
                self.budget.note_server_growth(server_before)
            finally:
                rec.memory.reserved, rec.memory.gpu_reserved = 0, {}
            self.budget.loaded(rec)
        if evict:
            await self.admission.enforce(rec, estimate=need)
            if (plan := await self.gpu.plan_enforce(rec)) is not None:
                await carry_out(plan, self._evict_one)
        self.warmth.loaded(rec, trigger, elapsed if trigger is not None else None)
        if trigger == "prewarm":
            self.metrics.prewarm_loads.labels(model=rec.id).inc()
            log.info("model '%s': pre-warmed in %.3fs", rec.id, elapsed)
        elif trigger is not None:
            rec.load.last_cold_start = elapsed
            self.metrics.cold_starts.labels(model=rec.id, trigger=trigger).inc()
            self.metrics.cold_start_seconds.labels(model=rec.id).observe(elapsed)
            if trigger == "request":
                self.metrics.wakes.labels(model=rec.id, origin="unloaded").inc()
                self.metrics.wake_seconds.labels(origin="unloaded").observe(elapsed)
            log.info("model '%s': cold start (%s) in %.3fs", rec.id, trigger, elapsed)
        return elapsed

    # ------------------------------------------------------------------ the wake queue

    async def _load_retrying_oom(
        self, rec: ModelRecord, instances: int, need: int, gpu_need: dict[int, int], how: str, *, evict: bool
    ) -> None:
        config = await self._config(rec, instances, how)
        timeout = rec.model.load_timeout_secs
        try:
            await self._load_within(rec, config, timeout)
            return
        except TritonModelLoadError as e:
            kind = classify_oom(e.reason, on_gpu=bool(gpu_need))
            if not evict or kind is None:
                raise
            first, cuda = e, kind == "gpu"
        # A CUDA out-of-memory frees GPU memory, any other frees host memory: the same eviction order, once.
        if cuda:
            plan = await self.gpu.plan_oom(rec, gpu_need)
            evicted = await carry_out(plan, self._evict_one) if plan is not None else []
        else:
            evicted = await self.admission.evict(rec, max(need, 1), UnloadReason.OOM)
        if not evicted:
            raise TritonModelLoadError(
                rec.id,
                f"out of memory, and no idle model could be unloaded to make room ({first.reason})",
                hint=GPU_OOM_HINT if cuda else OOM_HINT,
            ) from first
        log.warning("model '%s': out of memory at load; evicted %s, retrying once", rec.id, evicted)
        try:
            await self._load_within(rec, config, timeout)
        except TritonModelLoadError as e:
            if classify_oom(e.reason, on_gpu=bool(gpu_need)) is None:
                raise
            raise TritonModelLoadError(
                rec.id,
                f"out of memory even after unloading {', '.join(evicted)} ({e.reason})",
                hint=GPU_OOM_HINT if cuda else OOM_HINT,
            ) from e

    def _steps_loaded(self, rec: ModelRecord) -> None:
        """An ensemble's load starts only with its published steps loaded: Triton would load a missing one itself,
        behind the lifecycle (its records, its memory budget). The wake loaded them; one that left since (a delete,
        an unload or a republish of the step, forced meanwhile) fails this load, retryably. The steps are the ones
        published now, which Triton reads: a republish of the ensemble since its wake may name a step not woken."""
        model = rec.model
        if model.kind is PackageKind.TRITON_ENSEMBLE:
            with contextlib.suppress(SnoozeError):  # deleted meanwhile: Triton's load fails, saying so
                model = self.states.store.get(rec.id)
        for step in ensemble_steps(model):
            step_rec = self.states.get(step)
            if (step_rec is None or step_rec.state is not ModelState.READY) and self.states.store.exists(step):
                raise UnavailableError(
                    f"model '{rec.id}': its ensemble step '{step}' is not loaded (it was deleted, unloaded or "
                    "republished while the ensemble loaded, or the ensemble was republished with it)",
                    hint="retry: the next request wakes the ensemble with its steps",
                    retry_after=1,
                )

    async def _load_within(self, rec: ModelRecord, config: dict[str, Any] | None, timeout: float) -> None:
        """Triton's load, abandoned after ``timeout`` seconds (killing the stubs it started)."""
        before = {s.pid for s in await self._stubs(rec)}
        self._steps_loaded(rec)
        try:
            load = read_task(self.triton.load(rec.id, config=config, timeout=timeout + LOAD_ABANDON_SECS))
            # shielded: a load this task gives up on is still Triton's, and its end is waited for (bounded)
            await asyncio.wait_for(asyncio.shield(load), timeout)
            return
        except TimeoutError:
            pass
        except asyncio.CancelledError:
            await self._abandoned(rec, before, load)
            raise
        started = [s for s in await self._stubs(rec) if s.pid not in before]
        # read before the kill: the notes go with the stubs
        phase = hung_phase(self.journal_dir, started, self.clock.time())
        killed = await asyncio.to_thread(end_model_processes, self.processes, self.journal_dir, started)
        if self.processes.visible:
            log.warning("model '%s': load exceeded %gs; killed its model processes %s", rec.id, timeout, killed)
        else:
            log.warning(
                "model '%s': load exceeded %gs; Triton's processes cannot be seen from here, so the hanging "
                "load keeps running in Triton",
                rec.id,
                timeout,
            )
        deadline = self.clock.monotonic() + LOAD_ABANDON_SECS
        with contextlib.suppress(SnoozeError):  # let Triton finish failing it, so a retry starts clean
            while self.clock.monotonic() < deadline and any(
                e.name == rec.id and e.state == "LOADING" for e in await self.triton.repository_index()
            ):
                await asyncio.sleep(0.1)
        raise TritonModelLoadError(
            rec.id,
            f"load exceeded load_timeout_secs={timeout:g}" + (f": it hung in {phase}" if phase else ""),
            hint="make the model's load() faster, or raise load_timeout_secs in its snooze_model.json",
        )

    async def _abandoned(self, rec: ModelRecord, before: set[int], load: asyncio.Future[None]) -> None:
        """The load's task was cancelled (a stop abandons a reload; cancel.py ends a cold load's processes itself):
        the stubs it started leave, so that Triton fails the load instead of running it on, every later model
        control operation waiting behind it, and Triton's answer is waited for (bounded). Only stubs past their
        start are ended (cancel.py: one killed before would wedge Triton)."""
        started = [s for s in await self._stubs(rec) if s.pid not in before]
        if self.journal_dir is not None:
            journal_dir = self.journal_dir
            started = [s for s in started if initialize_started(journal_dir, s)]
        if started:
            killed = await asyncio.to_thread(end_model_processes, self.processes, self.journal_dir, started)
            log.warning("model '%s': load abandoned; ended the model processes it started %s", rec.id, killed)
        await asyncio.wait({load}, timeout=LOAD_ABANDON_SECS)

    async def _config(self, rec: ModelRecord, instances: int, how: str) -> dict[str, Any] | None:
        """The config override for a load, or None to load config.pbtxt as published."""
        if how in ("in_place", "replace"):
            # Start from Triton's own (normalised) config: an override built from config.pbtxt differs
            # from it in defaults, and Triton then reloads every instance instead of adding or removing
            # some. Also, a load without an override does not undo an earlier one when the files are
            # unchanged (measured), so going back to the published count needs an override too.
            with contextlib.suppress(SnoozeError):
                current = await self.triton.model_config(rec.id)
                return config_with_instances(current, instances, replace=how == "replace")
        # A loaded model keeps an earlier override through a load without one (measured): dropping a client's
        # override from a loaded model takes the published config sent as one.
        if (
            instances == rec.model.deployment.instances
            and rec.load.config_override is None
            and not rec.load.override_loaded
        ):
            return None
        return config_with_instances(config_for(rec.model, rec.load.config_override), instances)

    async def _stubs(self, rec: ModelRecord) -> list[Any]:
        if not rec.is_python:
            return []
        return await asyncio.to_thread(self.processes.stubs, rec.id)

    async def loaded(
        self, rec: ModelRecord, instances: int, *, count: bool = True, gpu_delta: GpuLoadDelta | None = None
    ) -> None:
        """The model is READY with ``instances``: note its model processes and measure its footprints."""
        stubs = await self._stubs(rec)
        # Triton runs the instances once per version it serves (a Triton folder's version_policy): all theirs.
        expected = instances * max(len(rec.model.versions), 1)
        deadline = self.clock.monotonic() + STUBS_SETTLE_SECS
        while stubs and len(stubs) > expected and self.clock.monotonic() < deadline:
            # An instance fewer in place: Triton ends the leaving stub just after the load returns.
            await asyncio.sleep(0.05)
            stubs = await self._stubs(rec)
        rec.instances, rec.memory.triton_may_hold = instances, False
        await self.residency.note_crashes(rec, [s for s in rec.procs.stubs if s not in stubs])
        rec.procs.stubs = tuple(stubs)
        rec.procs.workers = tuple(workers_of(self.journal_dir, stubs))
        if stubs:
            measured = await asyncio.to_thread(self._footprint, rec)
            # A stub grows once it has answered (remeasure notes by how much). Loaded again as it was (the same
            # deployment and instances), a model counts that growth from the start: no other load is admitted into
            # room its first request takes back (then over the budget, a sweep evicted a whole model for 1-3 MiB).
            if not (
                rec.memory.footprint_source == "measured"
                and rec.memory.footprint_instances == instances
                and rec.memory.footprint_deployment == rec.model.deployment
            ):
                rec.memory.growth = 0
            rec.memory.load_footprint, rec.memory.load_private = measured, measured - rec.memory.shared
            if rec.model.deployment.worker == Worker.PREFORKED and len(rec.procs.workers) < len(stubs):
                # a stub without its worker (it dozes: adopted so, or kept by an in-place rescale): the worker its
                # wake brings back is no growth of this load's, which is then not learned (dozing.py)
                rec.memory.load_private = UNKNOWN_LOAD_PRIVATE
            rec.memory.footprint = measured + rec.memory.growth
            rec.memory.footprint_instances, rec.memory.footprint_source = instances, "measured"
            rec.memory.footprint_deployment = rec.model.deployment
        elif (declared := declared_bytes(rec)) is not None:
            rec.memory.footprint, rec.memory.footprint_instances, rec.memory.footprint_source = (
                declared,
                instances,
                "declared",
            )
        else:
            rec.memory.footprint_source = None
        await self.gpu.measure(rec, instances, gpu_delta)
        rec.load.ready_at = self.clock.time()
        rec.load.load_count += count
        rec.scale = LoadWindow()
        self.states.set_state(rec, ModelState.READY)
        self.metrics.instances.labels(model=rec.id).set(instances)
        held = rec.memory.footprint if rec.memory.footprint_source else None
        self.metrics.memory_bytes.labels(model=rec.id).set(held or 0)

    async def remeasure(self) -> None:
        """Read again what loaded python models hold (each sweep), stubs and workers: a stub grows after its load
        (measured: a model of 85 MiB at its load held 88 MiB once it had answered a request), and its share of the
        pages it shares with other processes (libpython, numpy) falls as more models load and rises as they leave;
        the budget counts what is held now. One smaps_rollup read per process (``bench/pss_sweep.py``)."""
        seen = [
            (r, r.generation)
            for r in self.states.values()
            if r.state is ModelState.READY
            and r.op is None
            and r.procs.stubs
            and r.memory.footprint_source == "measured"
        ]
        if not seen or self.budget.budget_mb is None:
            return

        def read() -> list[int | None]:
            live: dict[str, list[Any]] = {}
            stubs = self.processes.stubs()
            for stub in stubs:
                live.setdefault(stub.model, []).append(stub)
            # Processes came or went since the last sweep: every share of the pages they share moved, so every Pss
            # is read afresh (a cached one would count what a model held beside the others as they were)
            pids = frozenset((s.pid, s.start_ticks) for s in stubs)
            max_age = SWEEP_PSS_MAX_AGE_SECS if pids == self._swept else 0.0
            self._swept = pids
            # a model whose processes are changing (an instance leaving, one that died) is measured at its next load
            return [
                self._held(r, live[r.id], max_age=max_age) if len(live.get(r.id, ())) == r.instances else None
                for r, _ in seen
            ]

        sizes = await asyncio.to_thread(read)
        for (rec, generation), size in zip(seen, sizes, strict=True):
            if size and rec.generation == generation and rec.op is None:
                # growth is private memory: a share of shared pages moves as other models come and go
                grown = max(size - rec.memory.shared - rec.memory.load_private, 0)
                # what it holds now; until its first request, plus the growth that request brings (counted ahead)
                rec.memory.footprint = size if rec.access.served_seen else size + max(rec.memory.growth - grown, 0)
                rec.memory.growth = max(rec.memory.growth, grown)
                self.budget.measured(rec)
                self.metrics.memory_bytes.labels(model=rec.id).set(rec.memory.footprint)

    def _footprint(self, rec: ModelRecord) -> int:
        """What the model's processes hold (``_held``); a preforked model's parents are read again beside it."""
        used = self._held(rec, rec.procs.stubs)
        if rec.procs.workers:
            self.budget.overhead = parents_bytes(self.journal_dir, self.processes.proc_root)
        return used

    def _held(self, rec: ModelRecord, stubs: Any, *, max_age: float = 0.0) -> int:
        """The Pss of the model's stubs and of their preforked workers: each shared page split among the processes
        mapping it (the parents' share is the budget's overhead), so the sums over models count what is held
        (``max_age``: a sweep's, ``held_bytes``)."""
        used, private = self.processes.memory_split(stubs, max_age=max_age)
        workers = rec.procs.workers
        if rec.model.deployment.worker == Worker.PREFORKED:  # a doze or a wake on Triton's side changes them
            workers = tuple(workers_of(self.journal_dir, stubs))
        if workers:
            pss, own = worker_bytes(workers, self.processes.proc_root, max_age=max_age)
            used, private = used + pss, private + own
        rec.memory.shared = max(used - private, 0)
        return used

    def load_failed(self, rec: ModelRecord, error: SnoozeError) -> None:
        kind = "oom" if classify_oom(str(error)) is not None else "error"
        self.metrics.load_failures.labels(model=rec.id, kind=kind).inc()
        log.warning("model '%s': load failed: %s", rec.id, error)
