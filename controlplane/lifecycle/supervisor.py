"""The lifecycle's periodic jobs: start and stop, pause and resume, the sweep (idle unloads, pre-warms, autoscaling,
Triton's health and index), the store's follower (other nodes' publishes) and the process watch (dead model
processes)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from controlplane.errors import SnoozeError
from controlplane.lifecycle.autoscale import autoscale_step
from controlplane.lifecycle.manager_parts import ManagerParts
from controlplane.lifecycle.recovery import note_deaths
from controlplane.lifecycle.sequences import describe_live
from controlplane.lifecycle.state import ModelRecord, ModelState
from controlplane.lifecycle.warmups import harvest
from controlplane.lifecycle.workers import parents_bytes
from controlplane.triton.client import RepositoryEntry
from controlplane.triton.processes import SWEEP_PSS_MAX_AGE_SECS, StubDeath, StubProcess

if TYPE_CHECKING:
    pass


from controlplane.lifecycle.manager_parts import SEQUENCE_POLL_SECS

log = logging.getLogger("snoozeml.lifecycle")

# How long a stop waits for the transitions still running (an unload: Triton's unload, at most
# SNOOZE_UNLOAD_FINALIZE_SECS of a model's clean-up) before it cancels them.
STOP_TRANSITIONS_SECS = 15.0


class Supervisor(ManagerParts):
    """The periodic side of ``LifecycleManager``."""


    async def start(self) -> None:
        """Adopt what Triton has loaded (a restarted control plane keeps its models), start sweeping
        and watching model processes."""
        await self.sync.start()
        await self.budget.measure_server()
        self.budget.check_server()
        await self.loader.enforce()  # what was adopted may hold more than the budget
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(
                    self._every(self._sweep_delay, self.sweep, "sweep"), name="snooze-sweeper"
                ),
                asyncio.create_task(
                    self._every(self.settings.watch_interval_secs, self.watch, "process watch"), name="snooze-watch"
                ),
                asyncio.create_task(
                    self._every(self.settings.store_poll_secs, self.follow_store, "store"), name="snooze-store"
                ),
            ]

    async def stop(self) -> None:
        """Stop sweeping, cancel loads in flight (a load may hang: a stop never waits for one) and wait for the
        other running transitions; models stay loaded in Triton."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.cancel_loads("stopping")
        # A loaded model's reload (a republish, a rescale, a client's new config) is a load too: not waited for.
        # Its task goes; the model keeps its old instances, and Triton finishes or fails the reload on its own (the
        # next control plane adopts what it finds).
        reloads = [r.op for r in self.states.values() if r.state is ModelState.READY and r.op is not None]
        for op in reloads:
            op.cancel()
        if reloads:
            await asyncio.wait(reloads, timeout=STOP_TRANSITIONS_SECS)
        # Bounded: a Triton whose model control hangs (its repository lock held by a load that never ends)
        # must not keep the stop waiting for an unload's answer.
        left = await self.states.wait_all(timeout=STOP_TRANSITIONS_SECS)
        if left:
            log.warning("stopping: %s still in transition after %gs; no longer waited for", ", ".join(left),
                        STOP_TRANSITIONS_SECS)  # fmt: skip
        self.sequences.release_all()
        self.gpu.close()

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

    def _sweep_delay(self) -> float:
        """The sweep interval, shortened to the next keep-alive decision when one is due sooner."""
        return self.warmth.sweep_delay(self.states.values(), self.settings.sweep_interval_secs)

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
        entries = await self.sync.resync(full=False)
        await self._leave_unpublished(entries)
        await self.budget.measure_server()
        await self.loader.remeasure()
        await self.loader.enforce()
        if self.budget.overhead:  # preloaded parents were seen: their memory changes, or they are gone
            self.budget.overhead = await asyncio.to_thread(
                parents_bytes, self.journal_dir, self.processes.proc_root, max_age=SWEEP_PSS_MAX_AGE_SECS
            )
        ready = [r for r in self.states.values() if r.state is ModelState.READY and r.op is None]
        await asyncio.gather(*(self.sync.refresh_access(r) for r in ready))
        pending = await self.sync.pending_counts()
        now = self.clock.time()
        self.sequences.refresh(self.states.values(), now)
        for rec in ready:
            await asyncio.to_thread(harvest, rec, self.journal_dir)
        for rec in ready:
            if rec.op is not None or rec.state is not ModelState.READY:
                continue
            if rec.in_use == 0:  # while the activator forwards, Triton's last_inference is that request's
                self.warmth.triton_access(rec)
            queued = pending.get(rec.id, 0.0)
            if rec.in_use == 0 and queued == 0 and self.warmth.unload_due(rec, now):
                self.states.spawn(
                    rec, ModelState.UNLOADING, "idle", self._unload_op(rec, "idle", seen_access=rec.idle_since)
                )
            elif self.settings.autoscale and rec.id in pending and rec.instances > 0:
                self._autoscale(rec, queued)
        await self._prewarm(now)

    async def _leave_unpublished(self, entries: dict[str, RepositoryEntry]) -> None:
        """Models no longer published leave, once two sweeps in a row find them so (not a republish's swap): a
        record (its model unloaded first), and a copy Triton holds that has no record (a delete that met a
        wake-up, a delete while this control plane was down)."""
        records = self.states.records
        gone = {m for m, r in records.items() if r.op is None and r.in_use == 0 and not self.store.exists(m)}
        gone |= {m for m, e in entries.items() if e.state == "READY" and m not in records and not self.store.exists(m)}
        confirmed, self._unpublished = gone & self._unpublished, gone
        for model_id in sorted(confirmed):
            rec = records.get(model_id)
            if rec is None:
                log.warning("model '%s': loaded in Triton but no longer published; unloading it", model_id)
                with contextlib.suppress(SnoozeError):
                    await self.triton.unload(model_id, wait=False)
            elif rec.op is None and rec.in_use == 0 and rec.state is ModelState.READY:
                self.states.spawn(rec, ModelState.UNLOADING, "deleted", self._forget_op(rec))
            elif rec.op is None and rec.in_use == 0 and not rec.triton_may_hold:
                self.states.drop(model_id)

    async def _forget_op(self, rec: ModelRecord) -> None:
        if await self._unload_op(rec, "deleted"):
            self.states.drop(rec.id)

    async def _prewarm(self, now: float) -> None:
        """Start a pre-warm a policy asks for: one per pass, while a load slot is free, from free budget only."""
        for rec in self.states.values():
            if not self.loader.slot_free:
                return
            if rec.op is not None or rec.state is not ModelState.UNLOADED or not self.warmth.prewarm_due(rec, now):
                continue
            if not await self.loader.fits_free(rec, rec.model.deployment.instances):
                continue  # asked again at the next pass: memory may be free by then
            if rec.op is None and rec.state is ModelState.UNLOADED:
                self.warmth.prewarm_started(rec)
                self.states.spawn(rec, ModelState.LOADING, "pre-warm", self._prewarm_op(rec))
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
            self.states.spawn(
                rec, ModelState.READY, f"scaling to {target} instances", self._rescale_op(rec, target, direction)
            )

    async def follow_store(self) -> None:
        """Apply what another writer of the repository did (another node of a fleet sharing it): a
        republished model that is loaded here is reloaded, a deleted one is unloaded and forgotten."""
        changed, deleted = await asyncio.to_thread(self.store.changes)
        for model_id in deleted:
            log.info("model '%s': deleted from the shared store; unloading it here", model_id)
            await self.forget(model_id)
        for model_id in changed:
            log.info("model '%s': republished in the shared store; reloading it here if loaded", model_id)
            await self.published(model_id)

    async def watch(self) -> None:
        """One pass over the processes of every loaded python model: a crashed one starts its recovery. An
        embedded tritonserver that exited is taken down and restarted from here, at once."""
        if self.sync.server_exited():
            await self.sync.check()
            return
        watched = [r for r in self.states.values() if r.state is ModelState.READY and r.op is None and r.stubs]
        if not watched:
            return
        seen = [(r, r.generation) for r in watched]
        found = await asyncio.to_thread(lambda: [self._crashes(r) for r, _ in seen])
        for (rec, generation), crashes in zip(seen, found, strict=True):
            deaths = self._noted(rec, generation, crashes)
            if deaths and rec.op is None and rec.state is ModelState.READY:
                self._start_recovery(rec, deaths)

    def _crashes(self, rec: ModelRecord) -> tuple[list[StubDeath], tuple[StubProcess, ...] | None]:
        """Dead processes of a loaded model, and its live ones when they replace ``rec.stubs``. A stub Triton
        reaped itself was ended on purpose (an instance fewer), unless the model now has fewer processes than
        instances. Runs in a worker thread: it only reads (``_noted`` writes, on the event loop)."""
        deaths = self.processes.deaths(rec.stubs)
        crashed = [d for d in deaths if not d.reaped]
        if len(crashed) < len(deaths):
            live = self.processes.stubs(rec.id)
            if len(live) >= rec.instances:
                return crashed, tuple(live)
        return deaths, None

    @staticmethod
    def _noted(
        rec: ModelRecord, generation: int, crashes: tuple[list[StubDeath], tuple[StubProcess, ...] | None]
    ) -> list[StubDeath]:
        """On the event loop: note the live processes ``_crashes`` found, unless the model changed meanwhile."""
        deaths, live = crashes
        if live is not None and rec.generation == generation and rec.op is None:
            rec.stubs = live
        return deaths

    async def _observe(self, rec: ModelRecord) -> list[StubDeath]:
        generation = rec.generation
        return self._noted(rec, generation, await asyncio.to_thread(self._crashes, rec))

    def _start_recovery(self, rec: ModelRecord, deaths: list[StubDeath]) -> asyncio.Task[None] | None:
        """Note the deaths (and the requests they took) and reload the model, unless a transition runs."""
        note_deaths(rec, deaths, self.journal_dir, self.clock)
        if rec.op is not None or rec.state is not ModelState.READY or self.paused:
            return rec.op
        what = ", ".join(f"{d.stub.instance or d.stub.pid} {d.describe()}" for d in deaths)
        return self.states.spawn(rec, ModelState.LOADING, f"recovering: process died ({what})", self._recover_op(rec))
