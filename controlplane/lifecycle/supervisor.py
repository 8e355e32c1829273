"""The lifecycle's periodic jobs: start and stop, pause and resume, the sweep (idle unloads, pre-warms, autoscaling,
Triton's health and index), the store's follower (other nodes' publishes) and the process watch (dead model
processes)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from controlplane.clock import Clock
from controlplane.errors import SnoozeError
from controlplane.heap import FREEZE_AFTER_RECORDS, freeze_long_lived
from controlplane.lifecycle.admin import AdminOperations
from controlplane.lifecycle.autoscale import autoscale_step
from controlplane.lifecycle.cancel import STOPPING, LoadCancels
from controlplane.lifecycle.dozing import Dozing
from controlplane.lifecycle.loading import Loader
from controlplane.lifecycle.run_once import RunOnce
from controlplane.lifecycle.sequences import LiveSequences, describe_live
from controlplane.lifecycle.state import ModelRecord, ModelState, ModelStates, UnloadReason
from controlplane.lifecycle.transitions import Transitions
from controlplane.lifecycle.triton_sync import TritonReadings, TritonSync
from controlplane.lifecycle.warmups import harvest
from controlplane.lifecycle.workers import parents_bytes
from controlplane.settings import Settings
from controlplane.store import SCAN_SPACING, ModelStore
from controlplane.triton.client import RepositoryEntry, TritonAdminClient
from controlplane.triton.processes import SWEEP_PSS_MAX_AGE_SECS

log = logging.getLogger("snoozeml.lifecycle")

SEQUENCE_POLL_SECS = 0.2  # how often a stop or a quiesce re-reads the live sequences it waits for
# How long a stop waits for the transitions still running (an unload: Triton's unload, at most
# SNOOZE_UNLOAD_FINALIZE_SECS of a model's clean-up) before it cancels them.
STOP_TRANSITIONS_SECS = 15.0
# How old the store's catalog may be for the sweep (the follower scans it every store_poll_secs or so).
CATALOG_MAX_AGE_SECS = 30.0


class Supervisor:
    def __init__(
        self,
        settings: Settings,
        store: ModelStore,
        states: ModelStates,
        sync: TritonSync,
        readings: TritonReadings,
        loader: Loader,
        transitions: Transitions,
        admin: AdminOperations,
        cancels: LoadCancels,
        run_once: RunOnce,
        sequences: LiveSequences,
        triton: TritonAdminClient,
        dozing: Dozing,
        *,
        journal_dir: Path | None,
        clock: Clock,
    ) -> None:
        self.settings = settings
        self.store = store
        self.states = states
        self.sync = sync
        self.readings = readings
        self.loader = loader
        self.budget = loader.budget
        self.admission = loader.admission
        self.warmth = loader.warmth
        self.transitions = transitions
        self.admin = admin
        self.cancels = cancels
        self.run_once = run_once
        self.sequences = sequences
        self.triton = triton
        self.dozing = dozing
        self.journal_dir = journal_dir
        self.clock = clock
        self._tasks: list[asyncio.Task[None]] = []
        # one lock per periodic job (sweep, process watch, store), held through one pass so that pause() can
        # wait for it; one job's long pass (the store's reloads) does not hold up the others
        self._passes: dict[str, asyncio.Lock] = {}
        self._unpublished: set[str] = set()  # models the last sweep found loaded or recorded but not published

    async def start(self) -> None:
        """Adopt what Triton has loaded (a restarted control plane keeps its models), start sweeping
        and watching model processes."""
        await self.sync.start()
        await self.budget.measure_server()
        self.budget.check_server()
        await self.admission.enforce()  # what was adopted may hold more than the budget
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._every(self._sweep_delay, self.sweep, "sweep"), name="snooze-sweeper"),
                asyncio.create_task(
                    self._every(self.settings.watch_interval_secs, self.watch, "process watch"), name="snooze-watch"
                ),
                asyncio.create_task(self._every(self._store_delay, self.follow_store, "store"), name="snooze-store"),
            ]

    async def stop(self) -> None:
        """Stop sweeping, cancel loads in flight (a load may hang: a stop never waits for one) and wait for the
        other running transitions; models stay loaded in Triton."""
        self.states.stopping = True  # a wake-up that would start a load now is answered instead
        if self.sync.backfill is not None:
            self._tasks.append(self.sync.backfill)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.cancels.cancel_all(STOPPING)
        # A loaded model's reload (a republish, a rescale, a client's new config) is a load too: not waited for.
        # The model keeps its old instances; Triton finishes or fails the reload on its own (the next control plane
        # adopts what it finds).
        if reloads := self.transitions.abandon_reloads():
            await asyncio.wait(reloads, timeout=STOP_TRANSITIONS_SECS)
        # Bounded: a Triton whose model control hangs (its repository lock held by a load that never ends)
        # must not keep the stop waiting for an unload's answer.
        left = await self.states.wait_all(timeout=STOP_TRANSITIONS_SECS)
        if left:
            log.warning("stopping: %s still in transition after %gs; no longer waited for", ", ".join(left),
                        STOP_TRANSITIONS_SECS)  # fmt: skip
        self.sequences.release_all()
        self.loader.gpu.close()

    async def pause(self) -> None:
        """Hold every change until ``resume()`` (a checkpoint is being taken): no sweep, process watch or
        store follow (so no idle unload, autoscaling, recovery or resync), and wake-ups, ``recover()`` and
        the API's load, unload, publish and delete wait instead of acting. Returns once the passes and
        transitions already under way have finished."""
        if self.states.pause_ends is None:
            self.states.pause_ends = asyncio.get_running_loop().create_future()
        for lock in list(self._passes.values()):
            async with lock:
                pass
        while ops := [r.op for r in self.states.values() if r.op is not None]:
            await asyncio.gather(*ops, return_exceptions=True)

    async def wait_for_sequences(self, timeout: float) -> dict[str, int]:
        """Wait until no loaded model has a live sequence (the runtime's notes: its END came, or Triton's
        ``max_sequence_idle_secs`` passed since its last request), at most ``timeout`` seconds. Returns
        {model: live sequences} of those still live then (empty: none). A graceful stop and the snapshot
        quiesce call it while the gateway still admits requests (the sequences' next ones must get through)."""
        deadline = self.clock.monotonic() + timeout
        said = False
        while True:
            live = self.sequences.live_counts(self.states.values(), self.clock.time())
            left = deadline - self.clock.monotonic()
            if not live or left <= 0:
                return live
            if not said:
                log.info("waiting up to %gs for %s to end", timeout, describe_live(live))
                said = True
            await asyncio.sleep(min(SEQUENCE_POLL_SECS, left))

    def resume(self) -> None:
        """End ``pause()``: whatever waited goes on, and the periodic passes run again."""
        if self.states.pause_ends is not None and not self.states.pause_ends.done():
            self.states.pause_ends.set_result(None)
        self.states.pause_ends = None

    @property
    def paused(self) -> bool:
        return self.states.pause_ends is not None

    def _store_delay(self) -> float:
        """``store_poll_secs``, or longer where a scan of the repository takes long (a stat per model): the follower
        spends at most 1 / ``SCAN_SPACING`` of its time scanning."""
        return max(self.settings.store_poll_secs, SCAN_SPACING * self.store.scan_secs)

    def _sweep_delay(self) -> float:
        """The sweep interval, shortened to the next keep-alive decision when one is due sooner."""
        return self.warmth.sweep_delay(self.warmth.with_policy(self.states.get), self.settings.sweep_interval_secs)

    async def _every(
        self, interval: float | Callable[[], float], job: Callable[[], Awaitable[None]], what: str
    ) -> None:
        while True:
            await asyncio.sleep(interval() if callable(interval) else interval)
            while self.states.pause_ends is not None:  # paused: no pass until resume()
                await asyncio.shield(self.states.pause_ends)
            try:
                async with self._passes.setdefault(what, asyncio.Lock()):
                    await job()
            except SnoozeError as e:
                log.warning("lifecycle %s: %s", what, e)
            except Exception:  # the loop must outlive any one bad pass
                log.exception("lifecycle %s failed", what)

    async def sweep(self) -> None:
        """One pass: Triton alive, state vs Triton's index, idle unloads, autoscaling, pre-warms."""
        if not await self.sync.check():
            return
        if self.sync.index_due():  # paced by what reading it costs (10,000 models: every 2-3 s)
            entries = await self.sync.resync(full=False)
            await self._leave_unpublished(entries)
        await self.dozing.hear(self.states.loaded())  # a request woke a dozing model on Triton's side: it holds more
        await self.budget.measure_server()
        await self.loader.remeasure()
        await self.admission.enforce()
        if self.budget.overhead:  # preloaded parents were seen: their memory changes, or they are gone
            self.budget.overhead = await asyncio.to_thread(
                parents_bytes, self.journal_dir, self.loader.processes.proc_root, max_age=SWEEP_PSS_MAX_AGE_SECS
            )
        ready = [r for r in self.states.loaded() if r.op is None]
        for rec, served in zip(ready, await self.readings.refresh_all(ready), strict=True):
            if served:
                self.budget.accessed(rec, served)
        pending = await self.readings.pending_counts()
        now = self.clock.time()
        self.sequences.refresh(self.states.loaded(), now)  # a held model not among them is released
        for rec in ready:
            await asyncio.to_thread(harvest, rec, self.journal_dir)
        for rec in ready:
            if rec.op is not None or rec.state is not ModelState.READY:
                continue
            if rec.in_use == 0:  # while the activator forwards, Triton's last_inference is that request's
                self.warmth.triton_access(rec)
            queued = pending.get(rec.id, 0.0)
            if rec.in_use == 0 and queued == 0 and self.warmth.unload_due(rec, now):
                self.transitions.unload(rec, UnloadReason.IDLE, seen_access=rec.idle_since)
            elif self.settings.autoscale and rec.id in pending and rec.instances > 0:
                self._autoscale(rec, queued)
        # an idle model dozes before its keep-alive unloads it (dozing.py)
        idle = {r.id for r in ready if r.in_use == 0 and pending.get(r.id, 0.0) == 0}
        await self.dozing.doze_idle(ready, idle, now)
        await self._prewarm(now)
        if self.states.made >= FREEZE_AFTER_RECORDS:  # thousands of new records: out of the collector's walks
            self.states.made = 0
            freeze_long_lived()

    async def _leave_unpublished(self, entries: dict[str, RepositoryEntry]) -> None:
        """Models no longer published leave, once two reads of the index in a row find them so (not a republish's
        swap): a record (its model unloaded first), and a copy Triton holds that has no record (a delete that met a
        wake-up, a delete while this control plane was down)."""
        records = self.states.records
        published = await asyncio.to_thread(
            self.store.catalog_ids, max_age=self.store.trusted_age(CATALOG_MAX_AGE_SECS)
        )  # no stat each
        gone = {m for m, r in records.items() if r.op is None and r.in_use == 0 and m not in published}
        gone |= {m for m, e in entries.items() if e.state == "READY" and m not in records and m not in published}
        gone = {m for m in gone if not self.store.exists(m)}  # the catalog may lag a write it did not make
        confirmed, self._unpublished = gone & self._unpublished, gone
        for model_id in sorted(confirmed):
            rec = records.get(model_id)
            if rec is None:
                log.warning("model '%s': loaded in Triton but no longer published; unloading it", model_id)
                with contextlib.suppress(SnoozeError):
                    await self.triton.unload(model_id, wait=False)
            elif rec.op is None and rec.in_use == 0 and rec.state is ModelState.READY:
                self.transitions.unloads.forget_unpublished(rec)
            elif rec.op is None and rec.in_use == 0 and not rec.memory.triton_may_hold:
                self.states.drop(model_id)

    async def _prewarm(self, now: float) -> None:
        """Start a pre-warm a policy asks for: one per pass, while a load slot is free, from free budget only (only a
        model with a policy can be due: one heard of)."""
        for rec in self.warmth.with_policy(self.states.get):
            if not self.admission.slot_free:
                return
            if rec.op is not None or rec.state is not ModelState.UNLOADED or not self.warmth.prewarm_due(rec, now):
                continue
            if not await self.admission.fits_free(rec, rec.model.deployment.instances):
                continue  # asked again at the next pass: memory may be free by then
            if rec.op is None and rec.state is ModelState.UNLOADED:
                self.warmth.prewarm_started(rec)
                self.transitions.prewarm(rec)
                return

    def _autoscale(self, rec: ModelRecord, queued: float) -> None:
        dep = rec.model.deployment
        target = autoscale_step(
            rec.scale,
            pending=queued,
            instances=rec.instances,
            base=dep.instances,
            max_instances=max(dep.max_instances, dep.instances),
            threshold=self.settings.autoscale_queue_threshold,
            window_secs=self.settings.autoscale_window_secs,
            idle_timeout_secs=dep.idle_timeout_secs,
            now=self.clock.monotonic(),
        )
        if target < rec.instances and rec.in_use > 0:
            return  # open work (a stream, a live sequence, a forward) may be on the instance that would go
        if target != rec.instances:
            direction = "up" if target > rec.instances else "down"
            log.info("model '%s': scaling %s to %d instances (%g pending)", rec.id, direction, target, queued)
            self.transitions.rescale(rec, target, direction)

    async def follow_store(self) -> None:
        """Apply what another writer of the repository did (another node of a fleet sharing it): a
        republished model that is loaded here is reloaded, a deleted one is unloaded and forgotten."""
        changed, deleted = await asyncio.to_thread(self.store.changes)
        for model_id in deleted:
            log.info("model '%s': deleted from the shared store; unloading it here", model_id)
            await self.admin.forget(model_id)
        for model_id in changed:
            log.info("model '%s': republished in the shared store; reloading it here if loaded", model_id)
            await self.admin.published(model_id)

    async def watch(self) -> None:
        """One pass of the process watch (``RunOnce.watch``). An embedded tritonserver that exited is taken down and
        restarted from here, at once."""
        if self.sync.server_exited():
            await self.sync.check()
            return
        await self.run_once.watch()
