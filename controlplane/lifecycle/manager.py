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
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from controlplane.errors import ConflictError, NotFoundError, SnoozeError, UnavailableError
from controlplane.lifecycle.autoscale import LoadWindow, autoscale_step
from controlplane.lifecycle.cancel import cancel_load
from controlplane.lifecycle.loading import LOAD_ABANDON_SECS, Loader, NoRoomToPrewarm, WakeQueueTimeout, rendered_config
from controlplane.lifecycle.memory import MemoryBudget
from controlplane.lifecycle.memory.cgroup import CgroupMemory, TritonCgroup
from controlplane.lifecycle.memory.gpu import GpuMemory
from controlplane.lifecycle.memory.gpu_memory import GpuProcessReader, NvmlPidMap
from controlplane.lifecycle.overrides import KEEP_OVERRIDE, apply_override
from controlplane.lifecycle.recovery import ModelProcessDiedError, RequestFate, fate_of, note_deaths, recent_deaths
from controlplane.lifecycle.sequences import LiveSequences, describe_live
from controlplane.lifecycle.state import ModelRecord, ModelState, ModelStates, ModelStatus
from controlplane.lifecycle.triton_sync import TritonSync
from controlplane.lifecycle.unloading import Unloader
from controlplane.lifecycle.warmth import Warmth
from controlplane.lifecycle.warmups import harvest, status_line
from controlplane.lifecycle.workers import parent_status, parents, parents_bytes
from controlplane.metrics import SnoozeMetrics
from controlplane.settings import Settings
from controlplane.store import ModelStore
from controlplane.triton.client import RepositoryEntry, TritonAdminClient
from controlplane.triton.processes import SWEEP_PSS_MAX_AGE_SECS, StubDeath, StubProcess, TritonProcesses

if TYPE_CHECKING:
    from controlplane.triton.launcher import EmbeddedTriton

log = logging.getLogger("snoozeml.lifecycle")

# Where Triton's processes cannot be seen, a dead stub shows only as failing requests: they reach
# recover() just after the first of them reloaded the model, and a model (re)loaded this recently
# is not reloaded again.
RECOVERY_DEDUP_SECS = 2.0
SEQUENCE_POLL_SECS = 0.2  # how often a stop or a quiesce re-reads the live sequences it waits for


class LifecycleManager:
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
    ) -> None:
        """``gpu_reader`` / ``gpu_pid_map``: NVML and its pid mapping (tests inject them: no GPU here); ``cgroup``:
        reads Triton's memory cgroup (default: found through tritonserver's pid under /proc and /sys)."""
        self.settings = settings
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
        self.warmth = Warmth(settings, self.metrics)
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
        )
        self.sync.loader, self.sync.warmth, self.sync.accessed = self.loader, self.warmth, self.budget.accessed
        self.unloader = Unloader(
            settings, triton, processes, self.metrics, pending=self.sync.pending_counts, journal_dir=journal_dir
        )
        self._tasks: list[asyncio.Task[None]] = []
        # one lock per periodic job (sweep, process watch, store), held through one pass so that pause() can
        # wait for it; one job's long pass (the store's reloads) does not hold up the others
        self._passes: dict[str, asyncio.Lock] = {}
        self._unpublished: set[str] = set()  # models the last sweep found loaded or recorded but not published

    # ------------------------------------------------------------------------------------------
    # Start, stop, sweep, watch

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
        await self.states.wait_all()
        self.sequences.release_all()
        self.gpu.close()

    async def pause(self) -> None:
        """Hold every change until ``resume()`` (a checkpoint is being taken): no sweep, process watch or
        store follow (so no idle unload, autoscaling, recovery or resync), and wake-ups, ``recover()`` and
        the API's load, unload, publish and delete wait instead of acting. Returns once the passes and
        transitions already under way have finished."""
        if self.states.resumed is None:
            self.states.resumed = asyncio.get_running_loop().create_future()
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
        deadline = time.monotonic() + timeout
        said = False
        while True:
            live = self.sequences.live_counts(self.states.values(), time.time())
            left = deadline - time.monotonic()
            if not live or left <= 0:
                return live
            if not said:
                log.info("waiting up to %gs for %s to end", timeout, describe_live(live))
                said = True
            await asyncio.sleep(min(SEQUENCE_POLL_SECS, left))

    def resume(self) -> None:
        """End ``pause()``: whatever waited goes on, and the periodic passes run again."""
        if self.states.resumed is not None and not self.states.resumed.done():
            self.states.resumed.set_result(None)
        self.states.resumed = None

    @property
    def paused(self) -> bool:
        return self.states.resumed is not None

    def _sweep_delay(self) -> float:
        """The sweep interval, shortened to the next keep-alive decision when one is due sooner."""
        return self.warmth.sweep_delay(self.states.values(), self.settings.sweep_interval_secs)

    async def _every(
        self, interval: float | Callable[[], float], job: Callable[[], Awaitable[None]], what: str
    ) -> None:
        while True:
            await asyncio.sleep(interval() if callable(interval) else interval)
            while self.states.resumed is not None:  # paused: no pass until resume()
                await asyncio.shield(self.states.resumed)
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
        now = time.time()
        self.sequences.refresh(self.states.values(), now)
        for rec in ready:
            await asyncio.to_thread(harvest, rec, self.journal_dir)
        for rec in ready:
            if rec.op is not None or rec.state is not ModelState.READY:
                continue
            if rec.users == 0:  # while the activator forwards, Triton's last_inference is that request's
                self.warmth.triton_access(rec)
            queued = pending.get(rec.id, 0.0)
            if rec.users == 0 and queued == 0 and self.warmth.unload_due(rec, now):
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
        gone = {m for m, r in records.items() if r.op is None and r.users == 0 and not self.store.exists(m)}
        gone |= {m for m, e in entries.items() if e.state == "READY" and m not in records and not self.store.exists(m)}
        confirmed, self._unpublished = gone & self._unpublished, gone
        for model_id in sorted(confirmed):
            rec = records.get(model_id)
            if rec is None:
                log.warning("model '%s': loaded in Triton but no longer published; unloading it", model_id)
                with contextlib.suppress(SnoozeError):
                    await self.triton.unload(model_id, wait=False)
            elif rec.op is None and rec.users == 0 and rec.state is ModelState.READY:
                self.states.spawn(rec, ModelState.UNLOADING, "deleted", self._forget_op(rec))
            elif rec.op is None and rec.users == 0 and not rec.draining:
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
            now=time.monotonic(),
        )
        if target < rec.instances and rec.users > 0:
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
        """One pass over the processes of every loaded python model: a crashed one starts its recovery."""
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
        note_deaths(rec, deaths, self.journal_dir)
        if rec.op is not None or rec.state is not ModelState.READY or self.paused:
            return rec.op
        what = ", ".join(f"{d.stub.instance or d.stub.pid} {d.describe()}" for d in deaths)
        return self.states.spawn(rec, ModelState.LOADING, f"recovering: process died ({what})", self._recover_op(rec))

    # ------------------------------------------------------------------------------------------
    # What the activator and the API call

    async def ensure_ready(self, model_id: str, *, timeout: float | None = None) -> None:
        """Return once the model is READY, loading it (single flight) if needed.

        Raises NotFoundError if it is not published, UnavailableError (with retry_after) if the load
        fails or outlives ``timeout`` (default: settings.wake_timeout_secs, else the model's
        load_timeout_secs), or cannot start (no load slot, no memory) within
        settings.wake_queue_timeout_secs: the wake queue.
        """
        rec = self.states.get(model_id)
        if rec is not None and rec.state is ModelState.READY:
            self.warmth.request(rec)
            rec.touched = time.time()
            return
        rec = self.states.record(model_id, refresh=True)
        self.warmth.request(rec)
        wait = (
            timeout
            if timeout is not None
            else (self.settings.wake_timeout_secs or rec.model.load_timeout_secs + LOAD_ABANDON_SECS)
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        # the wake queue: its load must start by then, else this request is answered 503 at once
        queue_bound = min(loop.time() + self.settings.wake_queue_timeout_secs, deadline)
        # the loader's clock is time.monotonic(), which is the loop's
        rec.wake_deadline = max(rec.wake_deadline or 0.0, time.monotonic() + queue_bound - loop.time())
        queue_checked = False
        started = time.monotonic()
        self.metrics.wake_waits.labels(model=model_id).inc()
        rec.users += 1
        try:
            while rec.state is not ModelState.READY:
                # While paused, a wake-up waits for resume() (within its deadline) instead of loading.
                op = (
                    rec.op
                    or self.states.resumed
                    or self.states.spawn(rec, ModelState.LOADING, "wake-up", self._cold_load_op(rec, "request"))
                )
                try:
                    until = deadline if queue_checked else queue_bound
                    await asyncio.wait_for(asyncio.shield(op), max(until - loop.time(), 0))
                except TimeoutError:
                    if not queue_checked:  # the queue bound passed: its load must have started
                        queue_checked = True
                        if self.loader.queued(rec):
                            gave_up = self.loader.gave_up(rec, self.loader.queue[rec.id][1])
                            self.metrics.wake_queue_timeouts.labels(model=model_id, waiting_for=gave_up.kind).inc()
                            raise gave_up from None
                        continue  # it started in time (or is not a load yet): wait up to the deadline
                    self.metrics.wake_timeouts.labels(model=model_id).inc()
                    raise UnavailableError(
                        f"model '{model_id}' is not ready after {wait:g}s (it is {rec.state.value})",
                        hint="retry later; if its load takes longer, raise the model's load_timeout_secs "
                        "(or SNOOZE_WAKE_TIMEOUT_SECS)",
                        retry_after=self._retry_after(rec),
                    ) from None
                except asyncio.CancelledError:
                    if not op.cancelled() or self._cancelled_why(rec, op) is None:
                        raise  # this request itself was cancelled
                    raise self._cancelled_error(rec, op) from None
                except WakeQueueTimeout as e:  # the load gave up the queue: the last of its wake-ups' bounds passed
                    self.metrics.wake_queue_timeouts.labels(model=model_id, waiting_for=e.kind).inc()
                    raise UnavailableError(e.message, hint=e.hint, retry_after=e.retry_after) from e
                except SnoozeError as e:
                    if self._cancelled_why(rec, op) is not None:  # it failed because it was cancelled
                        raise self._cancelled_error(rec, op) from e
                    if rec.state is ModelState.FAILED:
                        raise UnavailableError(
                            f"model '{model_id}' is unavailable: {rec.reason}",
                            hint=e.hint or "fix the model and publish it again; the next request retries the load",
                            retry_after=self._retry_after(rec),
                        ) from e
        finally:
            rec.users -= 1
            self.metrics.wake_wait_seconds.labels(model=model_id).observe(time.monotonic() - started)
        rec.touched = time.time()

    def add_state_listener(self, listener: Callable[[str, ModelState | None], None]) -> None:
        """Call ``listener(model_id, state)`` now for every model, then on every state change (``None``: the
        model's record was dropped), synchronously, before the transition awaits anything."""
        self.states.listeners.append(listener)
        for rec in self.states.values():
            listener(rec.id, rec.state)

    def remove_state_listener(self, listener: Callable[[str, ModelState | None], None]) -> None:
        with contextlib.suppress(ValueError):
            self.states.listeners.remove(listener)

    @contextlib.asynccontextmanager
    async def serving(self, model_id: str, *, timeout: float | None = None) -> AsyncIterator[None]:
        """``ensure_ready``, then keep the model from idle unload and eviction until the block ends
        (for the activator's forward: between the wake-up and Triton receiving the request)."""
        rec = self.states.record(model_id)
        rec.users += 1
        try:
            await self.ensure_ready(model_id, timeout=timeout)
            yield
        finally:
            rec.users -= 1
            rec.touched = time.time()
            self.warmth.served(rec, rec.touched)

    async def admit(self, model_id: str, request_id: str) -> None:
        """Before the activator sends a request on: refuse one that already reached a model process
        that died (``ModelProcessDiedError``), so that no request runs twice.

        Where Triton's processes cannot be seen, a request for a model Triton has loaded can only have
        come here because Triton failed it, and it may have run: it is refused too.
        """
        rec = self.states.record(model_id)
        fate, death = await self._fate(rec, request_id)
        if fate is RequestFate.RAN or (fate is RequestFate.UNKNOWN and recent_deaths(rec)):
            raise ModelProcessDiedError(model_id, death)  # unknown: a process died without a journal
        if (
            not self.processes.can_observe
            and rec.state is ModelState.READY
            and rec.op is None
            and time.time() - rec.ready_at >= RECOVERY_DEDUP_SECS
        ):
            self.states.spawn(rec, ModelState.LOADING, "recovering: a request failed", self._recover_op(rec))
            raise ModelProcessDiedError(model_id, None)

    async def after_dead_answer(self, model_id: str, request_id: str) -> None:
        """Triton answered the activator's send with "stub not healthy". Returns once the model is
        recovered when the request never reached a live model process (send it again); raises
        ``ModelProcessDiedError`` (recovery goes on) when it did, or when that cannot be told."""
        rec = self.states.record(model_id)
        fate, death = await self._fate(rec, request_id)
        if fate is RequestFate.NOT_RUN:
            await self.recover(model_id, "dead_stub")
            return
        if rec.op is None and rec.state is ModelState.READY and not rec.stubs:
            self.states.spawn(rec, ModelState.LOADING, "recovering: a request failed", self._recover_op(rec))
        raise ModelProcessDiedError(model_id, death)

    async def _fate(self, rec: ModelRecord, request_id: str) -> tuple[RequestFate, StubDeath | None]:
        # The watch may not have passed since the death: look at the model's processes first.
        if rec.stubs and rec.state is ModelState.READY:
            deaths = await self._observe(rec)
            if deaths:
                self._start_recovery(rec, deaths)
        return fate_of(rec, request_id)

    async def recover(self, model_id: str, cause: str) -> None:
        """Reload a model whose python stub died (Triton 2.51 does not restart stubs).

        Where the processes can be seen, a model whose processes are all alive is left alone (someone
        recovered it already); where they cannot, a model (re)loaded in the last seconds is.
        """
        rec = self.states.record(model_id)
        await self.states.settle(rec)
        if rec.state is ModelState.READY:
            if rec.stubs:
                deaths = await self._observe(rec)
                if not deaths:
                    return
                op = self._start_recovery(rec, deaths)
            elif time.time() - rec.ready_at < RECOVERY_DEDUP_SECS:
                return
            else:
                op = self.states.spawn(rec, ModelState.LOADING, f"recovering: {cause}", self._recover_op(rec))
        elif rec.state is ModelState.FAILED:
            op = self.states.spawn(rec, ModelState.LOADING, f"recovering: {cause}", self._recover_op(rec))
        else:
            return  # not loaded: the next wake-up loads it fresh
        if op is None:
            return
        try:
            await asyncio.shield(op)
        except SnoozeError as e:
            raise UnavailableError(
                f"model '{model_id}' could not be recovered ({cause}): {rec.reason}",
                hint=e.hint,
                retry_after=self._retry_after(rec),
            ) from e

    async def load(
        self, model_id: str, *, instances: int | None = None, override: dict[str, Any] | None | object = KEEP_OVERRIDE
    ) -> ModelStatus:
        """Load (API): cold load, or change the instance count of a loaded model in place.

        ``override`` (a repository load: the client's config override, or None for a load without one) is
        checked against the published config before anything (``overrides.apply_override``); then it holds
        for every load until the next repository load without one, a republish or a delete. A loaded model
        whose override changes is reloaded with the new config; a load that fails keeps the previous one.
        """
        rec = self.states.record(model_id, refresh=True)
        dep = rec.model.deployment
        limit = max(dep.max_instances, dep.instances)
        if instances is not None and not 1 <= instances <= limit:
            raise ConflictError(
                f"model '{model_id}': {instances} instances requested, allowed 1..{limit}",
                hint="raise the model's max_instances and publish it again",
            )
        await self.states.settle(rec)
        if override is not KEEP_OVERRIDE:
            given = cast("dict[str, Any] | None", override)
            apply_override(rendered_config(rec.model.config_text, where=f"model '{model_id}'"), given, model_id)
            previous, rec.config_override = rec.config_override, given or None
            try:
                if rec.state is ModelState.READY and (rec.config_override is not None or rec.override_loaded):
                    reloading = self._reconfigure_op(rec)
                    await asyncio.shield(self.states.spawn(rec, ModelState.READY, "new config", reloading))
                    return self.status(model_id)
                if rec.state is not ModelState.READY:
                    loading = self._cold_load_op(rec, "api", instances)
                    await self._loading(rec, self.states.spawn(rec, ModelState.LOADING, "loading", loading))
                return self.status(model_id)
            except BaseException:
                rec.config_override = previous  # Triton keeps the model (and its config) as it was
                raise
        if rec.state is ModelState.READY:
            if instances is not None and instances != rec.instances:
                scaling = self._rescale_op(rec, instances, None)
                await asyncio.shield(
                    self.states.spawn(rec, ModelState.READY, f"scaling to {instances} instances", scaling)
                )
        else:
            await self._loading(
                rec, self.states.spawn(rec, ModelState.LOADING, "loading", self._cold_load_op(rec, "api", instances))
            )
        return self.status(model_id)

    @staticmethod
    def _cancelled_why(rec: ModelRecord, load: asyncio.Task[Any]) -> str | None:
        return rec.load_cancelled[1] if rec.load_cancelled is not None and rec.load_cancelled[0] is load else None

    def _cancelled_error(self, rec: ModelRecord, load: asyncio.Task[Any]) -> SnoozeError:
        """What a request (or an API load) that waited on a cancelled load is answered."""
        why = self._cancelled_why(rec, load)
        if why == "deleted":  # as for any model that is not published
            return NotFoundError(f"model '{rec.id}' was deleted during its load", hint="publish it again to serve it")
        return UnavailableError(
            f"model '{rec.id}' is not loaded: its load was cancelled ({why})",
            hint="retry: the next request loads the model again if it is still published",
            retry_after=self._retry_after(rec),
        )

    async def _loading(self, rec: ModelRecord, load: asyncio.Task[Any]) -> None:
        """Await an API load: a cancelled one (an unload, a delete, a republish or a stop came) is a 503."""
        try:
            await asyncio.shield(load)
        except (asyncio.CancelledError, SnoozeError) as e:
            itself = isinstance(e, asyncio.CancelledError) and not load.cancelled()  # this caller was cancelled
            if itself or self._cancelled_why(rec, load) is None:
                raise
            raise self._cancelled_error(rec, load) from None

    async def cancel_loads(self, why: str) -> list[str]:
        """Cancel every load in flight (a stop); the models whose load was cancelled."""
        records = list(self.states.values())
        done = await asyncio.gather(*(self.cancel_load(rec, why) for rec in records))
        return [rec.id for rec, cancelled in zip(records, done, strict=True) if cancelled]

    async def cancel_load(self, rec: ModelRecord, why: str) -> bool:
        """End the model's load in flight now (cancel.py); False when none was."""
        queued = self.loader.queued(rec)
        return await cancel_load(self.states, self.processes, self.journal_dir, self.triton, rec, why, queued=queued)

    async def unload(self, model_id: str, *, reason: str = "api") -> ModelStatus:
        rec = self.states.record(model_id)
        await self.cancel_load(rec, "unloaded")  # an unload does not wait for a load (it may hang)
        await self.states.settle(rec)
        if rec.state is ModelState.READY:
            await asyncio.shield(self.states.spawn(rec, ModelState.UNLOADING, reason, self._unload_op(rec, reason)))
        elif rec.state is ModelState.FAILED:
            self.states.set_state(rec, ModelState.UNLOADED)
        return self.status(model_id)

    async def published(self, model_id: str) -> None:
        """After a (re)publish: reload a loaded model so it runs the new files and config.

        A failed reload leaves Triton serving the previous version: the model stays READY and its
        status reason says what failed.
        """
        rec = self.states.get(model_id)
        if rec is None:
            return
        cancelled = await self.cancel_load(rec, "republished")  # the new version loads on the next request
        await self.states.settle(rec)
        rec.model = self.store.get(model_id)
        rec.config_override = None  # a republish ends a client's override: the new config is what loads
        rec.warmup = None  # and its learned warm-up (the folder was replaced): the new config's source
        if cancelled:
            self.states.set_state(rec, ModelState.UNLOADED, "republished during its load; loads on the next request")
        if rec.state is ModelState.FAILED:
            self.states.set_state(rec, ModelState.UNLOADED, "republished; loads on the next request")
        elif rec.state is ModelState.READY:
            await asyncio.shield(
                self.states.spawn(rec, ModelState.READY, "reloading after publish", self._reload_op(rec))
            )

    async def forget(self, model_id: str) -> None:
        """Before a delete: unload the model if loaded and drop its state and metrics."""
        rec = self.states.get(model_id)
        if rec is None:
            return
        await self.cancel_load(rec, "deleted")
        await self.states.settle(rec)
        if rec.state is ModelState.READY:
            await asyncio.shield(
                self.states.spawn(rec, ModelState.UNLOADING, "deleted", self._unload_op(rec, "deleted"))
            )
        if not rec.draining:  # else kept while Triton still holds its memory; a later sweep lets it go
            self.states.drop(model_id)

    def config_override(self, model_id: str) -> dict[str, Any] | None:
        """The client's config override the model loads with (a repository load's), or None."""
        rec = self.states.get(model_id)
        return rec.config_override if rec is not None else None

    def status(self, model_id: str) -> ModelStatus:
        rec = self.states.record(model_id)
        loaded = rec.loaded
        measured = loaded and rec.footprint_source is not None
        harvest(rec, self.journal_dir)  # a few small files: the warm-up line is current right after a load
        return ModelStatus(
            id=rec.id,
            state=rec.state,
            reason=rec.reason,
            instances=rec.instances,
            last_access=rec.last_access,
            idle_timeout_secs=rec.model.deployment.idle_timeout_secs,
            memory_bytes=rec.footprint if measured else None,
            memory_source=rec.footprint_source if measured else None,
            last_cold_start_secs=rec.last_cold_start,
            load_count=rec.load_count,
            processes=len(rec.stubs) if loaded and rec.stubs else None,
            last_crash=rec.last_crash,
            gpu_memory_bytes=self.gpu.status_bytes(rec),
            keep_alive=self.warmth.windows(rec),
            worker=rec.model.deployment.worker if rec.is_python and rec.model.kind == "custom" else None,
            warmup=status_line(rec),
        )

    def statuses(self) -> list[ModelStatus]:
        ids = set(self.store.ids()) | set(self.states.records)
        return [self.status(i) for i in sorted(ids)]

    def runtime(self) -> dict[str, Any]:
        """What serves models besides their own processes: the preloaded parents of preforked models, each
        with its own memory (the pages its workers share with it, counted once; blocking: psutil reads)."""
        found = parents(self.journal_dir, self.processes.proc_root)
        lines = [parent_status(p) for p in found]
        self.budget.overhead = sum(line["memory_bytes"] or 0 for line in lines)
        return {
            "preloaded_parents": lines,
            "overhead_bytes": self.budget.overhead,
            "triton_server_bytes": self.budget.server,
            **self.budget.totals(),
            "eviction_policy": self.budget.policy.describe(),
            "wake_queue": self.loader.wake_queue(),
        }

    # ------------------------------------------------------------------------------------------
    # Transitions (each runs as the model's single op task)

    async def _cold_load_op(self, rec: ModelRecord, trigger: str, instances: int | None = None) -> None:
        try:
            await self.loader.load(rec, instances or rec.model.deployment.instances, trigger=trigger)
        except WakeQueueTimeout as e:  # never started: nothing failed, the next request queues again
            self.states.set_state(rec, ModelState.UNLOADED, f"not loaded: waited {e.waiting_for} too long")
            raise
        except SnoozeError as e:
            self.loader.load_failed(rec, e)
            self.states.set_state(rec, ModelState.FAILED, str(e.message))
            raise

    async def _prewarm_op(self, rec: ModelRecord) -> None:
        """A load ahead of a predicted request (the sweeper told the policy it started). A failure is left in
        the model's state; a request waiting for it loads the model itself."""
        try:
            await self.loader.load(rec, rec.model.deployment.instances, trigger="prewarm", evict=False)
        except NoRoomToPrewarm as e:
            self.warmth.unloaded(rec)
            self.states.set_state(rec, ModelState.UNLOADED, str(e.message))
            return
        except SnoozeError as e:
            self.warmth.unloaded(rec)
            self.loader.load_failed(rec, e)
            self.states.set_state(rec, ModelState.FAILED, f"pre-warm failed: {e.message}")
            return
        if not await self.loader.fits_free(rec, rec.instances, measured=True):
            # it measured above its estimate: a pre-warm leaves the room to others rather than evicting them
            self.states.set_state(rec, ModelState.UNLOADING, "pre-warm over the memory budget")
            await self._unload_op(rec, "memory", seen_access=rec.idle_since)

    async def _recover_op(self, rec: ModelRecord) -> None:
        """Out of service first, then a fresh load.

        The unload returns at once and from then on Triton answers 404, which the gateway sends to the
        activator, which waits for this op: no request meets the dead stub any more. Triton 2.51 may
        never finish unloading a model whose dead stub failed a request (measured: over 90 s), but a
        load right after the unload request builds new instances in ~0.15 s (measured).
        """
        instances = rec.instances or rec.model.deployment.instances
        cause = "dead_stub" if rec.deaths else "failed_request"
        try:
            with contextlib.suppress(SnoozeError):
                await self.triton.unload(rec.id, wait=False)
            await self.loader.load(rec, instances)
        except SnoozeError as e:
            self.loader.load_failed(rec, e)
            rec.draining = rec.instances > 0  # Triton may still be unloading the old instances: still counted
            self.states.set_state(rec, ModelState.FAILED, str(e.message))
            raise
        self.metrics.recoveries.labels(model=rec.id, cause=cause).inc()
        log.info("model '%s': recovered with %d new instance(s)", rec.id, instances)

    async def _rescale_op(self, rec: ModelRecord, instances: int, direction: str | None) -> None:
        before = rec.instances
        try:
            await self.loader.load(rec, instances, how="in_place")
        except SnoozeError as e:
            # Triton keeps the model as it was when a reload fails.
            self.states.set_state(rec, ModelState.READY, f"scaling to {instances} instances failed: {e.message}")
            rec.scale = LoadWindow()
            if direction is None:
                raise
            log.warning("model '%s': %s", rec.id, rec.reason)
            return
        if direction is not None:
            self.metrics.scale_events.labels(model=rec.id, direction=direction).inc()
        log.info("model '%s': %d -> %d instances", rec.id, before, instances)

    async def _reconfigure_op(self, rec: ModelRecord) -> None:
        """Reload a loaded model with its instances and the config override now set (or none)."""
        try:
            await self.loader.load(rec, rec.instances or rec.model.deployment.instances)
        except SnoozeError as e:
            self.loader.load_failed(rec, e)
            self.states.set_state(rec, ModelState.READY, f"the client's config failed to load: {e.message}")
            raise

    async def _reload_op(self, rec: ModelRecord) -> None:
        try:
            await self.loader.load(rec, rec.model.deployment.instances)
        except SnoozeError as e:
            self.loader.load_failed(rec, e)
            self.states.set_state(
                rec,
                ModelState.READY,
                f"the republished model failed to load; Triton keeps serving the previous version: {e.message}",
            )

    async def _unload_op(self, rec: ModelRecord, reason: str, *, seen_access: float | None = None) -> bool:
        """Unload; for idle unloads and evictions (``seen_access`` given) first make sure nothing uses it.

        Returns False when the model turned out to be in use and stays READY.
        """
        if seen_access is not None:
            # The model is already out of service (UNLOADING: wake-ups wait for this op). Anything
            # still queued in Triton, a wake-up waiting, or a request since the decision keeps it.
            await self.sync.refresh_access(rec)
            pending = (await self.sync.pending_counts()).get(rec.id, 0.0)
            if pending > 0 or rec.users > 0 or rec.idle_since > seen_access:
                self.states.set_state(rec, ModelState.READY)
                return False
        try:
            await self.unloader.unload(rec)  # returns once its memory is free (unloading.py)
        except SnoozeError as e:
            rec.draining = True  # Triton may still hold it: the budget counts it until Triton's index lets go
            self.states.set_state(rec, ModelState.FAILED, f"unload ({reason}) failed: {e}")
            raise
        self.loader.forget_loaded(rec)
        self.states.set_state(rec, ModelState.UNLOADED, reason)
        if reason == "idle":
            self.metrics.idle_unloads.labels(model=rec.id).inc()
        elif reason in ("memory", "oom", "gpu_memory", "gpu_oom"):
            self.metrics.evictions.labels(model=rec.id, reason=reason).inc()
        log.info("model '%s': unloaded (%s)", rec.id, reason)
        return True

    async def _evict_one(self, victim: ModelRecord, reason: str, for_model: str) -> bool:
        op = self.states.spawn(
            victim,
            ModelState.UNLOADING,
            f"evicted ({reason}) for '{for_model}'",
            self._unload_op(victim, reason, seen_access=victim.idle_since),
        )
        return bool(await asyncio.shield(op))

    def _retry_after(self, rec: ModelRecord) -> float:
        return max(1.0, round(rec.last_cold_start or 1.0, 1))

