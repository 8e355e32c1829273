"""The lifecycle's operations for the API and the store's follower: load, unload, republish, forget, status."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from controlplane.errors import ConflictError, SnoozeError
from controlplane.lifecycle.cancel import REPUBLISHED, LoadCancels, cancelled_error, cancelled_why, load_in_flight
from controlplane.lifecycle.configs import rendered_config
from controlplane.lifecycle.groups import Groups
from controlplane.lifecycle.loading import Loader
from controlplane.lifecycle.overrides import KEEP_OVERRIDE, apply_override
from controlplane.lifecycle.state import ModelRecord, ModelState, ModelStates, ModelStatus, UnloadReason
from controlplane.lifecycle.transitions import Transitions
from controlplane.lifecycle.warmth import Warmth
from controlplane.lifecycle.warmups import harvest, status_line
from controlplane.lifecycle.workers import parent_status, parents
from controlplane.spec import PackageKind
from controlplane.store import ModelStore
from controlplane.triton.processes import TritonProcesses

log = logging.getLogger("snoozeml.lifecycle")


class AdminOperations:
    def __init__(
        self,
        store: ModelStore,
        states: ModelStates,
        transitions: Transitions,
        cancels: LoadCancels,
        loader: Loader,
        warmth: Warmth,
        processes: TritonProcesses,
        groups: Groups,
        *,
        wake: Callable[[str], Awaitable[None]],
        journal_dir: Path | None,
        doze_after: Callable[[ModelRecord], float | None] = lambda rec: None,
    ) -> None:
        """``wake``: the request path's wake of an ensemble's step (``RequestPath.wake_step``); ``doze_after``:
        the model's doze time, None where it cannot doze (``Dozing.doze_after``)."""
        self.groups = groups
        self._wake = wake
        self._doze_after = doze_after
        self.store = store
        self.states = states
        self.transitions = transitions
        self.cancels = cancels
        self.loader = loader
        self.warmth = warmth
        self.processes = processes
        self.journal_dir = journal_dir
        self._configured: dict[str, tuple[tuple[str, int], str | None]] = {}  # _warmup's reads, per model

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
        # an ensemble: its steps first, held until its own load pins them
        return await self.groups.steps_first(
            rec, self._wake, lambda steps: self._load_itself(rec, instances, override, steps)
        )

    async def _load_itself(
        self, rec: ModelRecord, instances: int | None, override: object, steps: tuple[str, ...]
    ) -> ModelStatus:
        """``load``'s own part, once an ensemble's steps are loaded (a wake of the model may have begun its load
        meanwhile: settled first; a step that left meanwhile is woken again first, ``Groups.still_woken``)."""
        model_id = rec.id
        await self.states.settle(rec)
        if rec.state is not ModelState.READY:
            self.groups.still_woken(rec, steps)
        if override is not KEEP_OVERRIDE:
            given = cast("dict[str, Any] | None", override)
            apply_override(rendered_config(rec.model.config_text, where=f"model '{model_id}'"), given, model_id)
            previous, rec.load.config_override = rec.load.config_override, given or None
            try:
                if rec.state is ModelState.READY and (rec.load.config_override is not None or rec.load.override_loaded):
                    await _in_place(self.transitions.reconfigure(rec, previous))
                    return self.status(model_id)
                if rec.state is not ModelState.READY:
                    loading = self.transitions.cold_load(rec, trigger="api", reason="loading", instances=instances)
                    await self._loading(rec, loading)
                return self.status(model_id)
            except BaseException:
                rec.load.config_override = previous  # Triton keeps the model (and its config) as it was
                raise
        if rec.state is ModelState.READY:
            if instances is not None and instances != rec.instances:
                await _in_place(self.transitions.rescale(rec, instances, None))
        else:
            await self._loading(
                rec, self.transitions.cold_load(rec, trigger="api", reason="loading", instances=instances)
            )
        return self.status(model_id)

    async def _loading(self, rec: ModelRecord, load: asyncio.Task[Any]) -> None:
        """Await an API load: a cancelled one (an unload, a delete, a republish or a stop came) is a 503."""
        try:
            await asyncio.shield(load)
        except (asyncio.CancelledError, SnoozeError) as e:
            itself = isinstance(e, asyncio.CancelledError) and not load.cancelled()  # this caller was cancelled
            if itself or cancelled_why(rec, load) is None:
                raise
            raise cancelled_error(rec, load) from None

    async def unload(self, model_id: str, *, reason: UnloadReason | str = UnloadReason.API) -> ModelStatus:
        """Unload (API, a repository unload; ``reason``: one of ``UnloadReason``'s values)."""
        reason = UnloadReason(reason)
        rec = self.states.record(model_id)
        if await self.cancels.cancel(rec, "unloaded") and load_in_flight(rec):  # an unload never waits for a load
            # a load another caller started while the last one was cancelled (an API load, a request's wake-up)
            # came after this unload and stands: not waited for either, it may hang as well (dozing machine seed
            # 1157432408: an API load with an override, hung, held the unload until its load timeout)
            return self.status(model_id)
        await self.states.settle(rec)
        if rec.state is ModelState.READY:
            await asyncio.shield(self.transitions.unload(rec, reason))
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
        cancelled = await self.cancels.cancel(rec, REPUBLISHED)
        await self.states.settle(rec)
        rec.model = self.store.get(model_id)
        rec.load.config_override = None  # a republish ends a client's override: the new config is what loads
        rec.load.warmup = None  # and its learned warm-up (the folder was replaced): the new config's source
        if rec.state is ModelState.FAILED:
            self.states.set_state(rec, ModelState.UNLOADED, "republished; loads on the next request")
        elif cancelled and rec.state is ModelState.UNLOADED:
            self.states.set_state(rec, ModelState.UNLOADED, "republished during its load; loads on the next request")
        elif rec.state is ModelState.READY:  # loaded before, or since the cancel (a waiting request's wake-up)
            await _in_place(self.transitions.reload(rec))

    async def forget(self, model_id: str) -> None:
        """Before a delete: unload the model if loaded and drop its state and metrics."""
        rec = self.states.get(model_id)
        if rec is None:
            return
        await self.cancels.cancel(rec, "deleted")
        await self.states.settle(rec)
        if rec.state is ModelState.READY:
            try:
                await asyncio.shield(self.transitions.unload(rec, UnloadReason.DELETED))
            except SnoozeError as e:  # the delete goes on: what Triton may still hold stays counted (below)
                log.warning("model '%s': deleted, but its unload failed: %s", model_id, e)
        if not rec.memory.triton_may_hold:  # else kept while Triton still holds its memory; a later sweep lets it go
            self.states.drop(model_id)

    def config_override(self, model_id: str) -> dict[str, Any] | None:
        """The client's config override the model loads with (a repository load's), or None."""
        rec = self.states.get(model_id)
        return rec.load.config_override if rec is not None else None

    def status(self, model_id: str, *, users: dict[str, list[str]] | None = None) -> ModelStatus:
        """``users``: the ensembles using each model (``Groups.users``), when many statuses are read at once."""
        rec = self.states.record(model_id)
        if not rec.loaded and rec.op is None and rec.access.keep_alive is None:
            return self._at_rest(rec, users)
        return self._read(rec, users)

    def _read(self, rec: ModelRecord, users: dict[str, list[str]] | None) -> ModelStatus:
        loaded = rec.loaded
        measured = loaded and rec.memory.footprint_source is not None
        harvest(rec, self.journal_dir)  # a few small files: the warm-up line is current right after a load
        return ModelStatus(
            id=rec.id,
            state=rec.state,
            reason=rec.reason,
            instances=rec.instances,
            last_access=rec.last_access,
            idle_timeout_secs=rec.model.deployment.idle_timeout_secs,
            memory_bytes=rec.memory.footprint if measured else None,
            memory_source=rec.memory.footprint_source if measured else None,
            last_cold_start_secs=rec.load.last_cold_start,
            load_count=rec.load.load_count,
            processes=len(rec.procs.stubs) if loaded and rec.procs.stubs else None,
            last_crash=rec.procs.last_crash,
            gpu_memory_bytes=self.loader.gpu.status_bytes(rec),
            keep_alive=self._keep_alive(rec),
            worker=rec.model.deployment.worker if rec.is_python and rec.model.kind is PackageKind.CUSTOM else None,
            warmup=self._warmup(rec),
            ensembles=(users.get(rec.id) if users is not None else self.groups.users().get(rec.id)) or None,
            steps=list(self.groups.steps(rec)) or None,
            level=rec.level,
        )

    def _at_rest(self, rec: ModelRecord, users: dict[str, list[str]] | None) -> ModelStatus:
        """The status of a model at rest (most of thousands), kept on its record: rebuilt only when what it is read
        from changed (its publish, state, reason, loads, crash or warm-up line): unloaded, it holds no memory, no
        process, no GPU, and its keep-alive and steps follow from its publish."""
        key = (
            rec.state,
            rec.reason,
            rec.instances,
            rec.last_access,
            rec.load.last_cold_start,
            rec.load.load_count,
            rec.procs.last_crash,
            rec.load.warmup,
        )
        kept = rec.at_rest
        if kept is None or kept[0] is not rec.model or kept[1] != key:
            status = self._read(rec, {})  # its ensembles apart: they change with other records
            kept = rec.at_rest = (rec.model, key, status)
        ensembles = (users.get(rec.id) if users is not None else self.groups.users().get(rec.id)) or None
        return kept[2] if ensembles is None else replace(kept[2], ensembles=ensembles)

    def _keep_alive(self, rec: ModelRecord) -> dict[str, Any]:
        windows = self.warmth.windows(rec)
        doze = self._doze_after(rec)
        return windows if doze is None else {**windows, "doze_after_secs": round(doze, 3)}

    def statuses(self, model_ids: list[str] | None = None) -> list[ModelStatus]:
        """The statuses of ``model_ids`` (default: every published or recorded model), the groups read once."""
        ids = sorted(set(self.store.ids()) | set(self.states.records)) if model_ids is None else model_ids
        statuses = [self.status(i, users={}) for i in ids]  # every record now exists: read the groups once
        users = self.groups.users()
        return [replace(s, ensembles=users.get(s.id) or None) if s.id in users else s for s in statuses]

    def _warmup(self, rec: ModelRecord) -> str | None:
        """``warmups.status_line``, the published config's part read once per publish and load (a listing of
        thousands of models reads no config)."""
        if rec.load.warmup:
            return rec.load.warmup
        key = (rec.model.publish, rec.load.load_count)
        known = self._configured.get(rec.id)
        if known is None or known[0] != key:
            known = self._configured[rec.id] = (key, status_line(rec))
        return known[1]

    def runtime(self) -> dict[str, Any]:
        """What serves models besides their own processes: the preloaded parents of preforked models, each
        with its own memory (the pages its workers share with it, counted once; blocking: psutil reads)."""
        found = parents(self.journal_dir, self.processes.proc_root)
        lines = [parent_status(p) for p in found]
        budget = self.loader.budget
        budget.overhead = sum(line["memory_bytes"] or 0 for line in lines)
        return {
            "preloaded_parents": lines,
            "overhead_bytes": budget.overhead,
            "triton_server_bytes": budget.server,
            **budget.totals(),
            "eviction_policy": budget.policy.describe(),
            "wake_queue": self.loader.admission.wake_queue(),
        }


async def _in_place(reload: asyncio.Task[None]) -> None:
    """Await a loaded model's reload; one a stop abandoned (``Transitions.abandon_reloads``) leaves the model as it
    was, which is this caller's answer too (a republish's new version is in the store: the next start loads it)."""
    try:
        await asyncio.shield(reload)
    except asyncio.CancelledError:
        if not reload.cancelled():
            raise  # this caller itself was cancelled
