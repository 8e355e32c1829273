"""Every transition of a model starts here: each runs as the model's one op task (``ModelStates.spawn``), and the
rest of the lifecycle asks for one by name (``Transitions.cold_load``, ``Unloads.evict``, ...) and awaits the task.

``Unloads`` holds the unload transitions (idle unload, eviction, a deleted model's unload), which the loader needs
to make room: it is built before the loader and handed to it. ``Transitions`` holds the loads (a wake-up's, the
API's, a pre-warm, a recovery, a rescale, a reconfigure, a republish's reload), the adoption of a model Triton
already holds, and a cancelled load's own departure from Triton.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from controlplane.clock import Clock
from controlplane.errors import SnoozeError, UnavailableError
from controlplane.lifecycle.admission import NoRoomToPrewarm, WakeQueueTimeout
from controlplane.lifecycle.autoscale import LoadWindow
from controlplane.lifecycle.cancel import STOPPING
from controlplane.lifecycle.groups import Groups
from controlplane.lifecycle.loading import UNKNOWN_LOAD_PRIVATE, Loader
from controlplane.lifecycle.memory.host import MemoryBudget
from controlplane.lifecycle.residency import Residency
from controlplane.lifecycle.state import ModelRecord, ModelState, ModelStates, UnloadReason
from controlplane.lifecycle.triton_sync import TritonReadings
from controlplane.lifecycle.unloading import Unloader
from controlplane.lifecycle.warmth import Warmth
from controlplane.lifecycle.workers import none_alive
from controlplane.metrics import SnoozeMetrics
from controlplane.render import PUBLISH_PARAMETER
from controlplane.store import ModelStore
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.processes import TritonProcesses

log = logging.getLogger("snoozeml.lifecycle")


class Unloads:
    """The transitions that take a model out of memory."""

    def __init__(
        self,
        states: ModelStates,
        unloader: Unloader,
        budget: MemoryBudget,
        residency: Residency,
        processes: TritonProcesses,
        metrics: SnoozeMetrics,
        groups: Groups,
        *,
        readings: TritonReadings,
        clock: Clock,
    ) -> None:
        self.groups = groups
        self.clock = clock
        self.states = states
        self.unloader = unloader
        self.budget = budget
        self.residency = residency
        self.processes = processes
        self.metrics = metrics
        self.readings = readings

    def unload(self, rec: ModelRecord, reason: UnloadReason, *, seen_access: float | None = None) -> asyncio.Task[bool]:
        """Out of service (UNLOADING), then out of Triton; see ``unload_op``."""
        return self.states.spawn(
            rec, ModelState.UNLOADING, reason, self.unload_op(rec, reason, seen_access=seen_access)
        )

    async def evict(self, victim: ModelRecord, reason: str, for_model: str) -> bool:
        """Unload an idle model to make room for ``for_model`` (an ``EvictFn``: the loader carries out the memory
        budgets' plans with it); False when it turned out to be in use and stays."""
        why = UnloadReason(reason)
        if victim.op is not None or victim.state is not ModelState.READY or victim.held:
            # Taken meanwhile (the caller awaited since it chose it: a doze that the stubs refused, an earlier
            # victim's unload): a transition of its own or a request now; it stays.
            return False
        # A request since the decision keeps the victim. The decision is now: the plan may have read its last
        # access before the sweep saw its latest request, and a request before the decision is history.
        decided = max(victim.idle_since, self.clock.time())
        group = self.groups.exclusive_steps(victim)  # an ensemble leaves with the steps only it holds
        task = self.states.spawn(
            victim,
            ModelState.UNLOADING,
            f"evicted ({why}) for '{for_model}'",
            self.unload_op(victim, why, seen_access=decided),
        )
        if not await asyncio.shield(task):
            return False
        for step in group:
            step_rec = self.states.get(step)
            if step_rec is not None and step_rec.ready and step_rec.op is None and step_rec.in_use == 0:
                with contextlib.suppress(SnoozeError):
                    await self.evict(step_rec, reason, for_model)
        return True

    def forget_unpublished(self, rec: ModelRecord) -> asyncio.Task[None]:
        """A model no longer published (deleted by another writer of the store): unloaded, then its record goes."""
        return self.states.spawn(rec, ModelState.UNLOADING, UnloadReason.DELETED, self._forget_op(rec))

    async def _forget_op(self, rec: ModelRecord) -> None:
        if await self.unload_op(rec, UnloadReason.DELETED):
            self.states.drop(rec.id)

    async def ensembles_first(self, rec: ModelRecord) -> None:
        """The loaded ensembles that hold ``rec`` as a step leave before it: Triton takes an ensemble down with any
        of its steps, and brings it back when the step loads again (measured on 2.51), behind the lifecycle. An
        unload of a step held by an ensemble is a forced one (an API unload, a delete, a republish)."""
        for ensemble, steps in list(self.groups.pins.items()):
            e = self.states.get(ensemble)
            if rec.id not in steps or e is None:
                continue
            for _ in range(3):
                # Its load goes first (Triton would load the step again for it), and so does the rest of a
                # transition that made it READY already: a READY ensemble whose op still runs was passed over, and
                # Triton took it down with the step behind the records (seed 3955387526).
                op = e.op
                if op is None or e.state not in (ModelState.LOADING, ModelState.READY):
                    break
                await asyncio.wait({op})
            if e.state is ModelState.READY and e.op is None:
                task = self.states.spawn(
                    e,
                    ModelState.UNLOADING,
                    f"its step '{rec.id}' was unloaded",
                    self.unload_op(e, UnloadReason.STEP_LEFT, note=f"its step '{rec.id}' was unloaded"),
                )
                with contextlib.suppress(SnoozeError):
                    await asyncio.shield(task)

    async def unload_op(
        self, rec: ModelRecord, reason: UnloadReason, *, seen_access: float | None = None, note: str | None = None
    ) -> bool:
        """Unload; for idle unloads and evictions (``seen_access`` given) first make sure nothing uses it. ``note``:
        the status reason, when it says more than ``reason``.

        Returns False when the model turned out to be in use and stays READY.
        """
        if seen_access is not None:
            # The model is already out of service (UNLOADING: wake-ups wait for this op). Anything
            # still queued in Triton, a wake-up waiting, or a request since the decision keeps it.
            if served := await self.readings.refresh_access(rec):
                self.budget.accessed(rec, served)
            pending = (await self.readings.pending_counts()).get(rec.id, 0.0)
            if pending > 0 or rec.in_use > 0 or rec.idle_since > seen_access:
                self.states.set_state(rec, ModelState.READY)
                return False
        await self.ensembles_first(rec)
        try:
            await self.unloader.unload(rec)  # returns once its memory is free (unloading.py)
        except SnoozeError as e:
            # Triton may still hold it: the budget counts it until Triton's index lets go, unless none of a python
            # model's processes lives (a dead stub's unload may never end in Triton 2.51, and holds nothing)
            gone = rec.is_python and await asyncio.to_thread(none_alive, self.processes, rec.id)
            rec.memory.triton_may_hold = not gone
            self.states.set_state(rec, ModelState.FAILED, f"unload ({note or reason}) failed: {e}")
            raise
        await self.residency.note_crashes(rec, list(rec.procs.stubs))
        self.residency.forget_loaded(rec)
        self.states.set_state(rec, ModelState.UNLOADED, note or reason)
        if reason is UnloadReason.IDLE:
            self.metrics.idle_unloads.labels(model=rec.id).inc()
        elif reason.eviction:
            self.metrics.evictions.labels(model=rec.id, reason=reason).inc()
        log.info("model '%s': unloaded (%s)", rec.id, note or reason)
        return True


class Transitions:
    """The loads, and what else changes a model's residency: the unloads are ``unloads``'."""

    def __init__(
        self,
        states: ModelStates,
        store: ModelStore,
        triton: TritonAdminClient,
        loader: Loader,
        unloads: Unloads,
        warmth: Warmth,
        metrics: SnoozeMetrics,
    ) -> None:
        self.states = states
        self.store = store
        self.triton = triton
        self.loader = loader
        self.unloads = unloads
        self.warmth = warmth
        self.metrics = metrics
        self._in_place: dict[asyncio.Task[None], ModelRecord] = {}  # the running reloads of loaded models

    # ------------------------------------------------------------------ starting them

    def cold_load(
        self, rec: ModelRecord, *, trigger: str, reason: str, instances: int | None = None
    ) -> asyncio.Task[None]:
        """A model that is not loaded: ``trigger`` "request" (a wake-up) or "api"."""
        return self.states.spawn(rec, ModelState.LOADING, reason, self._cold_load_op(rec, trigger, instances))

    def prewarm(self, rec: ModelRecord) -> asyncio.Task[None]:
        return self.states.spawn(rec, ModelState.LOADING, "pre-warm", self._prewarm_op(rec))

    def recover(self, rec: ModelRecord, reason: str) -> asyncio.Task[None]:
        """A model whose process died (or that failed): out of service, then loaded anew."""
        return self.states.spawn(rec, ModelState.LOADING, reason, self._recover_op(rec))

    def rescale(self, rec: ModelRecord, instances: int, direction: str | None) -> asyncio.Task[None]:
        """A loaded model's instance count changed in place (``direction``: the autoscaler's "up" or "down")."""
        reason = f"scaling to {instances} instances"
        return self._in_place_op(rec, reason, self._rescale_op(rec, instances, direction))

    def reconfigure(self, rec: ModelRecord, previous: dict[str, Any] | None) -> asyncio.Task[None]:
        """A loaded model reloaded with the client's config override now set (or none); one that fails or is
        abandoned leaves the model, and its record, with the ``previous`` override, before the op ends."""
        return self._in_place_op(rec, "new config", self._reconfigure_op(rec, previous))

    def reload(self, rec: ModelRecord) -> asyncio.Task[None]:
        """A loaded model reloaded after a republish."""
        return self._in_place_op(rec, "reloading after publish", self._reload_op(rec))

    def _in_place_op(self, rec: ModelRecord, reason: str, op: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = self.states.spawn(rec, ModelState.READY, reason, op, loads=True)
        self._in_place[task] = rec
        task.add_done_callback(lambda done: self._in_place.pop(done, None))
        return task

    def abandon_reloads(self) -> list[asyncio.Task[None]]:
        """Cancel the reloads of loaded models (a stop: a reload is a load, never waited for); the tasks. Each is
        cancelled with its reason, so that the requests waiting on it are answered (503, the control plane is stopping)
        rather than cancelled with it (dozing machine seed 1154293239)."""
        reloads = list(self._in_place.items())
        for task, rec in reloads:
            rec.load.cancel_reasons[task] = STOPPING
            task.cancel()
        return [task for task, _ in reloads]

    def unload(self, rec: ModelRecord, reason: UnloadReason, *, seen_access: float | None = None) -> asyncio.Task[bool]:
        return self.unloads.unload(rec, reason, seen_access=seen_access)

    def adopt(self, rec: ModelRecord) -> asyncio.Task[None]:
        """A model Triton already holds loaded becomes READY here (a restarted control plane keeps its models)."""
        return self.states.spawn(rec, rec.state, "found loaded in Triton", self._adopt_op(rec))

    def leave_after_cancel(
        self, rec: ModelRecord, why: str, leave: Coroutine[Any, Any, list[int]]
    ) -> asyncio.Task[list[int]]:
        """A cancelled load's leftovers leave Triton (``cancel.py``): out of service meanwhile."""
        return self.states.spawn(rec, ModelState.UNLOADING, f"load cancelled: {why}", leave)

    # ------------------------------------------------------------------ what they run

    async def _cold_load_op(self, rec: ModelRecord, trigger: str, instances: int | None) -> None:
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
        if not await self.loader.admission.fits_free(rec, rec.instances, measured=True):
            # it measured above its estimate: a pre-warm leaves the room to others rather than evicting them
            self.states.set_state(rec, ModelState.UNLOADING, "pre-warm over the memory budget")
            await self.unloads.unload_op(
                rec, UnloadReason.MEMORY, seen_access=rec.idle_since, note="pre-warm over the memory budget"
            )

    async def _recover_op(self, rec: ModelRecord) -> None:
        """Out of service first, then a fresh load.

        The unload returns at once and from then on Triton answers 404, which the gateway sends to the
        activator, which waits for this op: no request meets the dead stub any more. Triton 2.51 may
        never finish unloading a model whose dead stub failed a request (measured: over 90 s), but a
        load right after the unload request builds new instances in ~0.15 s (measured).
        """
        instances = rec.instances or rec.model.deployment.instances
        cause = "dead_stub" if rec.procs.deaths else "failed_request"
        await self.unloads.ensembles_first(rec)  # Triton's unload below would take them down behind the lifecycle
        try:
            with contextlib.suppress(SnoozeError):
                await self.triton.unload(rec.id, wait=False)
            await self.loader.load(rec, instances)
        except SnoozeError as e:
            self.loader.load_failed(rec, e)
            rec.memory.triton_may_hold = (
                rec.instances > 0
            )  # Triton may still be unloading the old instances: still counted
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

    async def _reconfigure_op(self, rec: ModelRecord, previous: dict[str, Any] | None) -> None:
        try:
            await self.loader.load(rec, rec.instances or rec.model.deployment.instances)
        except SnoozeError as e:
            rec.load.config_override = previous
            self.loader.load_failed(rec, e)
            self.states.set_state(rec, ModelState.READY, f"the client's config failed to load: {e.message}")
            raise
        except BaseException:
            rec.load.config_override = previous
            raise

    async def _reload_op(self, rec: ModelRecord) -> None:
        groups = self.unloads.groups
        if groups.steps(rec) or groups.pins.get(rec.id):
            # An ensemble (now or before): it is not reloaded in place, which would load it without the steps it
            # names now (Triton would load those itself, behind the lifecycle) and keep pins on the old ones. It
            # holds no process: it leaves, and the next request wakes it with its steps.
            why = "republished; an ensemble loads again, with its steps, on the next request"
            self.states.set_state(rec, ModelState.UNLOADING, why)
            await self.unloads.unload_op(rec, UnloadReason.REPUBLISHED, note=why)
            return
        try:
            await self.loader.load(rec, rec.model.deployment.instances)
        except UnavailableError as e:
            # No room for the new version beside the old one now (the memory budgets: their models in use).
            # The old version must not go on answering for the new one, so it leaves; the new one loads on the
            # next request, through the wake queue, once there is room.
            self.loader.load_failed(rec, e)
            why = f"republished; the new version loads on the next request (no room beside the old one: {e.message})"
            self.states.set_state(rec, ModelState.UNLOADING, why)
            await self.unloads.unload_op(rec, UnloadReason.REPUBLISHED, note=why)
        except SnoozeError as e:
            self.loader.load_failed(rec, e)
            self.states.set_state(
                rec,
                ModelState.READY,
                f"the republished model failed to load; Triton keeps serving the previous version: {e.message}",
            )

    async def _adopt_op(self, rec: ModelRecord) -> None:
        rec.model = self.store.get(rec.id)
        try:
            config = await self.triton.model_config(rec.id)
        except SnoozeError:
            return
        instances = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
        await self.loader.loaded(rec, instances, count=False)
        self.warmth.loaded(rec, "adopt")
        held = ((config.get("parameters") or {}).get(PUBLISH_PARAMETER) or {}).get("string_value", "")
        if rec.model.publish and held != rec.model.publish:
            # What was measured runs an older publish (another deployment, perhaps dozing as that one could): no
            # growth is learned from it, nor carried to the published one's load (dozing machine seed 2182929700:
            # a wake of the old dozing stub was learned as growth, then counted ahead on the new version's load).
            rec.memory.load_private, rec.memory.footprint_deployment = UNKNOWN_LOAD_PRIVATE, None
            # Triton holds an older publish: a republish's reload never ended (a stop abandoned it, or the control
            # plane went away during it). The version published must answer, not that one.
            log.info("model '%s': found loaded with an older publish; reloading the one published", rec.id)
            await self._reload_op(rec)
