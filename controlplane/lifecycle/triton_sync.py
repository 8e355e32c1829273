"""Triton's health and repository index, as the lifecycle follows them.

The embedded tritonserver is restarted when it dies; one seen in a shared PID namespace that went away
(its container restarted) means the same. Either way every model is taken as unloaded and the index is
read again when Triton is back. Each sweep also aligns states with the index (models loaded or unloaded
behind snoozeml's back) and reads Triton's own last-access times and queue lengths.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from controlplane.clock import SYSTEM_CLOCK, Clock
from controlplane.errors import SnoozeError, UnavailableError
from controlplane.lifecycle.groups import ensemble_steps
from controlplane.lifecycle.memory.host import declared_bytes
from controlplane.lifecycle.state import ModelRecord, ModelState, ModelStates
from controlplane.lifecycle.workers import none_alive
from controlplane.metrics import SnoozeMetrics
from controlplane.settings import Settings
from controlplane.store import ModelStore, PublishedModel
from controlplane.triton.client import BUSY_STATES, ModelStats, RepositoryEntry, TritonAdminClient
from controlplane.triton.processes import TritonProcesses

if TYPE_CHECKING:
    from controlplane.lifecycle.memory.host import MemoryBudget
    from controlplane.lifecycle.residency import Residency
    from controlplane.lifecycle.transitions import Transitions
    from controlplane.triton.launcher import EmbeddedTriton

log = logging.getLogger("snoozeml.lifecycle")

# Retry-After of a wake-up refused while tritonserver is down: about what a restart and a small model's load take.
DOWN_RETRY_AFTER_SECS = 2.0
# After a full resync: records made per turn of the event loop, and the pause between turns (the start goes on).
RECORD_CHUNK, RECORD_PAUSE_SECS = 100, 0.01
CATALOG_MAX_AGE_SECS = 30.0  # how old the store's catalog may be for a sweep's resync (the follower scans it)
# A sweep reads Triton's repository index at most 1 / INDEX_SPACING of the time: Triton reads its repository folder
# for each (10,000 models: 44 ms of its CPU a read, 36 ms with ready=true; measured on the embedded 2.51), and the
# control plane parses an entry per model. A few models: every sweep; 10,000: every 2-3 s. Never rarer than this.
INDEX_SPACING = 50
INDEX_MAX_SECS = 30.0


class TritonUp:
    """Whether tritonserver is up, as the lifecycle last saw it; what a wake-up or a load does while it is not."""

    def __init__(self, settings: Settings, *, restarts: bool) -> None:
        """``restarts``: this control plane restarts tritonserver (its embedded child) when it dies."""
        self.settings = settings
        self.restarts = restarts
        self._up = asyncio.Event()
        self._up.set()
        self.down_why = ""  # what took tritonserver away, while it is down

    def is_set(self) -> bool:
        return self._up.is_set()

    def went_down(self, what: str) -> bool:
        """Note that tritonserver went away; False when that was known already."""
        if not self._up.is_set():
            return False
        self._up.clear()
        self.down_why = what
        return True

    def came_back(self) -> None:
        self._up.set()

    def _refuse_if_not_restarting(self, rec: ModelRecord, what: str) -> None:
        """The embedded tritonserver is down for good (restarts are off)."""
        if self.restarts and not self.settings.restart_triton:
            raise UnavailableError(
                f"model '{rec.id}' cannot {what}: tritonserver is not running",
                hint="restart snoozectl serve, or set SNOOZE_RESTART_TRITON=true",
            )

    def refuse_while_down(self, rec: ModelRecord) -> None:
        """A wake-up while tritonserver is down is answered at once (503 with Retry-After) rather than held: it
        would wait for the restart, the resync and its model's load, past the deadline of most clients (which
        Triton's HTTP clients do not send). Loads asked for through the API still wait (``wait_until_up``)."""
        if self._up.is_set():
            return
        self._refuse_if_not_restarting(rec, "wake")
        raise UnavailableError(
            f"model '{rec.id}' cannot wake now: tritonserver is restarting ({self.down_why})",
            hint="retry after the Retry-After seconds; every model loads again on its next request",
            retry_after=DOWN_RETRY_AFTER_SECS,
        )

    async def wait_until_up(self, rec: ModelRecord) -> None:
        if self._up.is_set():
            return
        self._refuse_if_not_restarting(rec, "load")
        try:
            await asyncio.wait_for(self._up.wait(), rec.model.load_timeout_secs)
        except TimeoutError:
            raise UnavailableError(
                f"model '{rec.id}' cannot load: tritonserver has not come back", retry_after=5
            ) from None


class TritonReadings:
    """What Triton says of its models' use: last access, requests served, requests pending."""

    def __init__(self, triton: TritonAdminClient) -> None:
        self.triton = triton

    async def refresh_access(self, rec: ModelRecord) -> int:
        """Triton's last access and the requests it served since the last read, which it returns (the eviction
        policy's frequency: it counts every request, the ones straight from the gateway too)."""
        try:
            versions = await self.triton.version_stats(rec.id)
        except SnoozeError:
            return 0
        return self._heard(rec, versions)

    async def refresh_all(self, recs: list[ModelRecord]) -> list[int]:
        """``refresh_access`` of each of ``recs`` from one reading of every loaded model's statistics (a sweep, an
        eviction plan: one call to Triton, not one a model)."""
        if not recs:
            return []
        try:
            stats = await self.triton.all_stats()
        except SnoozeError:
            return [0] * len(recs)
        return [self._heard(rec, stats[rec.id]) if rec.id in stats else 0 for rec in recs]

    @staticmethod
    def _heard(rec: ModelRecord, versions: list[ModelStats]) -> int:
        """Note what Triton's statistics of the model's versions say (the last access of any, the requests all
        served); returns the requests served since the last reading."""
        stamp = max(s.last_inference_ms for s in versions) / 1000
        # The load's own warm-up (config model_warmup) is stamped as an inference: only later ones are use.
        if stamp > rec.load.ready_at:
            rec.access.triton_last = max(rec.access.triton_last, stamp)
        served = sum(s.success_count for s in versions)
        # Triton's count starts again with each load (the record's is zeroed when the model leaves memory)
        new = served - rec.access.served_seen if served >= rec.access.served_seen else served
        rec.access.served_seen = served
        return max(new, 0)

    async def pending_counts(self) -> dict[str, float]:
        """Pending requests per model from Triton's metrics; empty when they cannot be read."""
        if self.triton.metrics_url is None:
            return {}
        try:
            return await self.triton.pending_request_counts()
        except SnoozeError as e:
            log.warning("cannot read Triton's pending request counts: %s", e)
            return {}


class TritonSync:
    """Triton's health (the embedded one restarted when it dies) and its repository index, followed."""

    def __init__(
        self,
        settings: Settings,
        store: ModelStore,
        states: ModelStates,
        triton: TritonAdminClient,
        processes: TritonProcesses,
        metrics: SnoozeMetrics,
        *,
        up: TritonUp,
        budget: MemoryBudget,
        residency: Residency,
        transitions: Transitions,
        triton_process: EmbeddedTriton | None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.index_secs = 0.0  # how long the last read of Triton's repository index took
        self.index_read_at: float | None = None  # when it ended (the clock's monotonic seconds)
        self.store = store
        self.states = states
        self.triton = triton
        self.processes = processes
        self.metrics = metrics
        self.up = up
        self.budget = budget
        self.residency = residency
        self.transitions = transitions
        self.triton_process = triton_process  # the embedded child, which may be restarted
        self._checking = asyncio.Lock()
        self.server_seen: int | None = None  # pid of the tritonserver last seen (visible topologies)
        self.backfill: asyncio.Task[None] | None = None  # a full resync's records of the models Triton does not hold

    def index_due(self) -> bool:
        """Whether a sweep reads Triton's index now: its last read ended ``INDEX_SPACING`` times its length ago (at
        most ``INDEX_MAX_SECS``). Between reads, a model Triton unloaded or loaded behind the control plane waits for
        the next (a crash is the process watch's, every ``watch_interval_secs``)."""
        if self.index_read_at is None:
            return True
        spacing = min(INDEX_SPACING * self.index_secs, INDEX_MAX_SECS)
        return self.clock.monotonic() - self.index_read_at >= spacing

    async def start(self) -> None:
        await self.resync(full=True)
        server = await asyncio.to_thread(self.processes.server)
        self.server_seen = server.pid if server is not None else None

    def server_exited(self) -> bool:
        """The embedded tritonserver exited and ``check()`` has not seen it yet. A local check that calls no
        Triton API: the process watch asks it, because a sweep can be waiting on a call to the dead server
        (its leftover processes hold the connection open) when it dies."""
        proc = self.triton_process
        return proc is not None and self.up.is_set() and not proc.is_running()

    async def check(self) -> bool:
        """False while tritonserver is down; restarts the embedded one when settings allow. A Triton
        seen in a shared PID namespace that went away (its container restarted) means the same:
        every model is unloaded, and the index is read again when it is back. The sweep and the process
        watch both call it: one at a time."""
        async with self._checking:
            return await self._check()

    async def _check(self) -> bool:
        proc = self.triton_process
        if proc is not None:
            if not proc.is_running():
                self.down(f"tritonserver (pid {proc.pid}) died")
                # First of all: its stubs (and what they forked) keep its connections open, and every call
                # over one (Envoy's requests, this control plane's loads) waits until they are gone.
                await asyncio.to_thread(proc.end_leftovers)
                if not self.settings.restart_triton:
                    return False
                try:
                    await asyncio.to_thread(proc.restart)
                except SnoozeError as e:
                    log.error("restarting tritonserver failed (retrying at the next sweep): %s", e)
                    return False
                self.metrics.triton_restarts.inc()
                log.warning("tritonserver restarted (pid %s)", proc.pid)
        elif self.server_seen is not None:
            server = await asyncio.to_thread(self.processes.server)
            if server is None or server.pid != self.server_seen:
                self.down(f"tritonserver (pid {self.server_seen}) went away")
                if server is None:
                    return False
                self.server_seen = server.pid
                log.warning("tritonserver is back (pid %s)", server.pid)
        if not self.up.is_set():
            await self.resync(full=True)  # raises on failure: the next sweep tries again
            self.up.came_back()
        return True

    def down(self, what: str) -> None:
        if not self.up.went_down(what):
            return
        log.error("%s; every model is unloaded", what)
        for rec in self.states.values():
            if rec.op is None:
                self.residency.forget_loaded(rec)
                self.states.set_state(rec, ModelState.UNLOADED, "tritonserver died")

    async def resync(self, *, full: bool) -> dict[str, RepositoryEntry]:
        """Align states with Triton's repository index.

        full (start, after a Triton restart): every idle model takes Triton's word. Otherwise only
        models whose state Triton contradicts (unloaded or loaded behind snoozeml's back) change;
        a state changed by a transition while the index was fetched is left alone. Adopting a model
        is a transition of its own (wake-ups wait for it). Returns the index it read.
        """
        generations = {m: r.generation for m, r in self.states.records.items()}
        # the store's catalog (the follower keeps it current): no stat per model on the event loop
        published = await asyncio.to_thread(
            self.store.catalog_ids, max_age=0.0 if full else self.store.trusted_age(CATALOG_MAX_AGE_SECS)
        )
        started = self.clock.monotonic()
        entries: dict[str, RepositoryEntry] = {e.name: e for e in await self.triton.repository_index()}
        self.index_read_at = self.clock.monotonic()
        self.index_secs = self.index_read_at - started
        if full:
            await self._unload_orphans(entries)
        await self._record_new(entries, full=full)
        for model_id, rec in list(self.states.records.items()):
            if rec.op is not None or generations.get(model_id, rec.generation) != rec.generation:
                continue
            entry = entries.get(model_id)
            if rec.memory.triton_may_hold and (
                entry is None
                or entry.state not in BUSY_STATES
                or (rec.is_python and await asyncio.to_thread(none_alive, self.processes, model_id))
            ):
                self.residency.forget_loaded(rec)  # Triton finished the unload that had failed here, or holds nothing
            elif entry is not None and entry.state == "UNLOADING" and not rec.holds_memory:
                # an unload this control plane did not see through (before a restart): what its processes hold
                stubs = await asyncio.to_thread(self.processes.stubs, model_id)
                held = await asyncio.to_thread(self.processes.memory, stubs)
                # a python model whose processes are all gone holds nothing (they were ended: unloading.py)
                if held or not (rec.is_python and self.processes.visible):
                    rec.memory.triton_may_hold, rec.memory.footprint = (
                        True,
                        held or rec.memory.footprint or declared_bytes(rec),
                    )
            if model_id not in published and not self.store.exists(model_id):  # the catalog may lag another's write
                continue
            triton_ready = entry is not None and entry.state == "READY"
            if triton_ready and rec.state is not ModelState.READY:
                await asyncio.shield(self.transitions.adopt(rec))
            elif not triton_ready and rec.state is ModelState.READY:
                self.residency.forget_loaded(rec)
                self.states.set_state(rec, ModelState.UNLOADED, "not loaded in Triton")
            elif full and not triton_ready and rec.state is ModelState.FAILED:
                self.states.set_state(rec, ModelState.UNLOADED, rec.reason)
        await self._note_unrecorded(entries)
        return entries

    async def _record_new(self, entries: dict[str, RepositoryEntry], *, full: bool) -> None:
        """Records for models without one: at a full resync every published model (from the store's catalog: one
        read of each), else those Triton holds."""
        if full:  # the rest after this pass, a chunk at a time (10,000 records take seconds): live first
            models = await asyncio.to_thread(self.store.list)
            if self.backfill is not None:
                self.backfill.cancel()
            self.backfill = asyncio.create_task(self._record_all(models), name="snooze-records")
        for model_id in [n for n, e in entries.items() if e.state in BUSY_STATES]:
            if self.states.get(model_id) is None and self.store.exists(model_id):
                self.states.record(model_id)

    async def _record_all(self, models: list[PublishedModel]) -> None:
        """A record for every published model, ``RECORD_CHUNK`` at a time between the event loop's other work (a
        request or a status makes its model's record at once: ``ModelStates.record``)."""
        for start in range(0, len(models), RECORD_CHUNK):
            for model in models[start : start + RECORD_CHUNK]:
                if self.states.get(model.id) is None and not model.path.name.startswith("."):
                    with contextlib.suppress(SnoozeError):
                        self.states.record(model.id, model=model)
            await asyncio.sleep(RECORD_PAUSE_SECS)

    async def _note_unrecorded(self, entries: dict[str, RepositoryEntry]) -> None:
        """What Triton holds for models without a record (deleted by another node while loaded here, or before
        this control plane started): the memory budget counts it until the sweep has unloaded them. And what it
        still unloads for a record that counts nothing and that a transition kept this pass from marking (an unload
        that hung before a restart, under a load of the model published again: dozing machine seed 1330313060, the
        load refused for memory, the record FAILED and the old instances counted nowhere until the next read)."""
        held = {}
        for name, entry in entries.items():
            rec = self.states.records.get(name)
            unloading = entry.state == "UNLOADING" and rec is not None and rec.op is not None
            if entry.state in BUSY_STATES and (rec is None or (unloading and not rec.holds_memory)):
                stubs = await asyncio.to_thread(self.processes.stubs, name)
                held[name] = await asyncio.to_thread(self.processes.memory, stubs)
        self.budget.unrecorded = held

    async def _unload_orphans(self, entries: dict[str, RepositoryEntry]) -> None:
        """Unload what Triton holds of models deleted while no control plane followed the store (another node
        deleted it while this one restarted): nothing here would count their memory or ever unload them."""
        held = [n for n, e in entries.items() if e.state in ("READY", "LOADING") and self.states.get(n) is None]
        if not held:
            return
        orphans = await asyncio.to_thread(self.store.gone, held)
        await self._unload_ensembles_over(orphans, entries)
        for model_id in orphans:
            log.warning("model '%s': loaded in Triton but deleted from the store; unloading it", model_id)
            with contextlib.suppress(SnoozeError):
                await self.triton.unload(model_id, wait=False)

    async def _unload_ensembles_over(self, steps: list[str], entries: dict[str, RepositoryEntry]) -> None:
        """Unload, first and on their own, the loaded ensembles that use one of ``steps``. Triton takes an ensemble
        down with a step it unloads, and brings it back when the step is loaded again unless the ensemble itself was
        unloaded (measured, Triton 2.51): behind the lifecycle, which had recorded it unloaded."""
        if not steps:
            return
        gone = set(steps)
        for name, entry in entries.items():
            if name in gone or entry.state not in ("READY", "LOADING"):
                continue
            try:
                model = await asyncio.to_thread(self.store.get, name)
            except SnoozeError:
                continue
            if gone.intersection(ensemble_steps(model)):
                log.warning("model '%s': an ensemble over a step deleted from the store; unloading it first", name)
                with contextlib.suppress(SnoozeError):
                    await self.triton.unload(name)
