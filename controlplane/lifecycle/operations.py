"""The lifecycle's operations for the API and the store's follower (load, unload, publish, forget, status), and the
transitions they run: each runs as the model's single op task (``ModelStates.spawn``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any, cast

from controlplane.errors import ConflictError, NotFoundError, SnoozeError, UnavailableError
from controlplane.lifecycle.autoscale import LoadWindow
from controlplane.lifecycle.cancel import REPUBLISHED, cancel_load
from controlplane.lifecycle.loading import NoRoomToPrewarm, WakeQueueTimeout, rendered_config
from controlplane.lifecycle.manager_parts import ManagerParts
from controlplane.lifecycle.overrides import KEEP_OVERRIDE, apply_override
from controlplane.lifecycle.state import ModelRecord, ModelState, ModelStatus
from controlplane.lifecycle.warmups import harvest, status_line
from controlplane.lifecycle.workers import none_alive, parent_status, parents

if TYPE_CHECKING:
    pass



log = logging.getLogger("snoozeml.lifecycle")





class Operations(ManagerParts):
    """The admin side of ``LifecycleManager`` and its transitions."""

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
                    reloading = self._reconfigure_op(rec, previous)
                    await _in_place(self.states.spawn(rec, ModelState.READY, "new config", reloading))
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
                await _in_place(self.states.spawn(rec, ModelState.READY, f"scaling to {instances} instances", scaling))
        else:
            await self._loading(
                rec, self.states.spawn(rec, ModelState.LOADING, "loading", self._cold_load_op(rec, "api", instances))
            )
        return self.status(model_id)

    @staticmethod
    def _cancelled_why(rec: ModelRecord, load: asyncio.Task[Any]) -> str | None:
        cancelled = rec.load_cancelled
        return cancelled.why if cancelled is not None and cancelled.task is load else None

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

        A reload that fails leaves Triton serving the previous version: the model stays READY and its
        status reason says what failed. One with no room beside the previous version (the memory budgets
        full of models in use) unloads it instead: the new version loads on the next request.
        """
        rec = self.states.get(model_id)
        if rec is None:
            return
        # the new version loads on the next request, or for the requests that waited on the cancelled load
        cancelled = await self.cancel_load(rec, REPUBLISHED)
        await self.states.settle(rec)
        rec.model = self.store.get(model_id)
        rec.config_override = None  # a republish ends a client's override: the new config is what loads
        rec.warmup = None  # and its learned warm-up (the folder was replaced): the new config's source
        if rec.state is ModelState.FAILED:
            self.states.set_state(rec, ModelState.UNLOADED, "republished; loads on the next request")
        elif cancelled and rec.state is ModelState.UNLOADED:
            self.states.set_state(rec, ModelState.UNLOADED, "republished during its load; loads on the next request")
        elif rec.state is ModelState.READY:  # loaded before, or since the cancel (a waiting request's wake-up)
            await _in_place(self.states.spawn(rec, ModelState.READY, "reloading after publish", self._reload_op(rec)))

    async def forget(self, model_id: str) -> None:
        """Before a delete: unload the model if loaded and drop its state and metrics."""
        rec = self.states.get(model_id)
        if rec is None:
            return
        await self.cancel_load(rec, "deleted")
        await self.states.settle(rec)
        if rec.state is ModelState.READY:
            unloading = self.states.spawn(rec, ModelState.UNLOADING, "deleted", self._unload_op(rec, "deleted"))
            try:
                await asyncio.shield(unloading)
            except SnoozeError as e:  # the delete goes on: what Triton may still hold stays counted (below)
                log.warning("model '%s': deleted, but its unload failed: %s", model_id, e)
        if not rec.triton_may_hold:  # else kept while Triton still holds its memory; a later sweep lets it go
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
            rec.triton_may_hold = rec.instances > 0  # Triton may still be unloading the old instances: still counted
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
        """Reload a loaded model with its instances and the config override now set (or none); one that fails or
        is abandoned leaves the model, and its record, with the ``previous`` override, before the op ends."""
        try:
            await self.loader.load(rec, rec.instances or rec.model.deployment.instances)
        except SnoozeError as e:
            rec.config_override = previous
            self.loader.load_failed(rec, e)
            self.states.set_state(rec, ModelState.READY, f"the client's config failed to load: {e.message}")
            raise
        except BaseException:
            rec.config_override = previous
            raise

    async def _reload_op(self, rec: ModelRecord) -> None:
        try:
            await self.loader.load(rec, rec.model.deployment.instances)
        except UnavailableError as e:
            # No room for the new version beside the old one now (the memory budgets: their models in use).
            # The old version must not go on answering for the new one, so it leaves; the new one loads on the
            # next request, through the wake queue, once there is room.
            self.loader.load_failed(rec, e)
            why = f"republished; the new version loads on the next request (no room beside the old one: {e.message})"
            self.states.set_state(rec, ModelState.UNLOADING, why)
            await self._unload_op(rec, why)
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
            if pending > 0 or rec.in_use > 0 or rec.idle_since > seen_access:
                self.states.set_state(rec, ModelState.READY)
                return False
        try:
            await self.unloader.unload(rec)  # returns once its memory is free (unloading.py)
        except SnoozeError as e:
            # Triton may still hold it: the budget counts it until Triton's index lets go, unless none of a python
            # model's processes lives (a dead stub's unload may never end in Triton 2.51, and holds nothing)
            gone = rec.is_python and await asyncio.to_thread(none_alive, self.processes, rec.id)
            rec.triton_may_hold = not gone
            self.states.set_state(rec, ModelState.FAILED, f"unload ({reason}) failed: {e}")
            raise
        await self.loader.note_crashes(rec, list(rec.stubs))
        self.loader.forget_loaded(rec)
        self.states.set_state(rec, ModelState.UNLOADED, reason)
        if reason == "idle":
            self.metrics.idle_unloads.labels(model=rec.id).inc()
        elif reason in ("memory", "oom", "gpu_memory", "gpu_oom"):
            self.metrics.evictions.labels(model=rec.id, reason=reason).inc()
        log.info("model '%s': unloaded (%s)", rec.id, reason)
        return True

    async def _evict_one(self, victim: ModelRecord, reason: str, for_model: str) -> bool:
        # A request since the decision keeps the victim. The decision is now: the plan may have read its last
        # access before the sweep saw its latest request, and a request before the decision is history.
        decided = max(victim.idle_since, self.clock.time())
        op = self.states.spawn(
            victim,
            ModelState.UNLOADING,
            f"evicted ({reason}) for '{for_model}'",
            self._unload_op(victim, reason, seen_access=decided),
        )
        return bool(await asyncio.shield(op))

    def _retry_after(self, rec: ModelRecord) -> float:
        return max(1.0, round(rec.last_cold_start or 1.0, 1))


async def _in_place(reload: asyncio.Task[Any]) -> None:
    """Await a loaded model's reload; one a stop abandoned (``Supervisor.stop``) leaves the model as it was, which
    is this caller's answer too (a republish's new version is in the store: the next start loads it)."""
    try:
        await asyncio.shield(reload)
    except asyncio.CancelledError:
        if not reload.cancelled():
            raise  # this caller itself was cancelled
