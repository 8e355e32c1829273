"""Model states and the single flight of their transitions.

Per model: ``unloaded -> loading -> ready -> unloading -> unloaded``, plus ``failed`` with the reason.
Every transition of one model runs as a single asyncio task (``ModelRecord.op``): whoever needs the
model while a transition runs awaits that task instead of starting another one. That is the single
flight of wake-ups (N concurrent first requests share one Triton load), and it also orders wake-ups
after unloads and recoveries.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from controlplane.errors import NotFoundError, SnoozeError, UnavailableError
from controlplane.keepalive import FixedKeepAlive
from controlplane.lifecycle.autoscale import LoadWindow
from controlplane.lifecycle.workers import WorkerProcess
from controlplane.metrics import SnoozeMetrics
from controlplane.spec import PackageKind
from controlplane.store import ModelStore, PublishedModel
from controlplane.triton.processes import StubDeath, StubProcess

log = logging.getLogger("snoozeml.lifecycle")


class ModelState(StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"
    FAILED = "failed"


class UnloadReason(StrEnum):
    """Why a model left memory: its status reason and the label of the metric that counts it."""

    IDLE = "idle"  # its keep-alive ran out (snooze_idle_unloads_total)
    MEMORY = "memory"  # evicted for another load, or to bring the host budget back (snooze_evictions_total)
    OOM = "oom"  # evicted after a load ran out of host memory
    GPU_MEMORY = "gpu_memory"  # evicted for another load's GPU memory
    GPU_OOM = "gpu_oom"  # evicted after a load ran out of GPU memory
    API = "api"  # unloaded through the control API or Triton's repository API
    DELETED = "deleted"  # its package was deleted
    REPUBLISHED = "republished"  # a new version had no room beside it: it leaves, the new one loads on request
    STEP_LEFT = "step_left"  # an ensemble whose step was unloaded (Triton takes the ensemble down with it)

    @property
    def eviction(self) -> bool:
        return self in (UnloadReason.MEMORY, UnloadReason.OOM, UnloadReason.GPU_MEMORY, UnloadReason.GPU_OOM)


def _doc(description: str, **default: Any) -> Any:
    """A ModelStatus field with the description its API schema shows (``api/schemas.py`` builds it)."""
    return field(metadata={"description": description}, **default)


@dataclass(frozen=True)
class ModelStatus:
    """A model's lifecycle state as the control API, ``snoozectl status`` and the fleet show it. The one
    definition of its fields: the API's ``ModelStatusBody`` is generated from these."""

    id: str = _doc("The model's id")
    state: ModelState = _doc("unloaded | loading | ready | unloading | failed")
    reason: str | None = _doc("Why it is in this state (a failure's message, what unloaded it)")
    instances: int = _doc("Loaded instances (0 when not loaded)")
    last_access: float | None = _doc(
        "Epoch seconds of the last request (Triton's last_inference or a wake-up), None if never"
    )
    idle_timeout_secs: float = _doc("Unloaded after this long without a request (the fixed keep-alive)")
    memory_bytes: int | None = _doc(
        "Measured while loaded: its stubs' Pss plus its preforked workers' Pss; None: not loaded, or not measurable"
    )
    memory_source: str | None = _doc(
        "measured (its processes' proportional memory) | declared (its memory_mb) | None: unknown"
    )
    last_cold_start_secs: float | None = _doc("How long its last load took, None if never loaded")
    load_count: int = _doc("Successful Triton loads (cold starts, reloads, rescales, recoveries)")
    processes: int | None = _doc("Live model processes while loaded (python backend); None where not seen")
    last_crash: str | None = _doc("How the model's last process died, and when; None: never seen dying")
    gpu_memory_bytes: dict[str, int] | None = _doc(
        "Measured GPU memory per GPU index while loaded; None where GPU memory is not measured", default=None
    )
    keep_alive: dict[str, Any] | None = _doc(
        "The keep-alive policy now: policy (fixed | adaptive), pattern (a learned window is in use), reason, "
        "samples (idle times on record), min_samples (adaptive), keep_alive_secs (stay loaded this long after a "
        "request), prewarm_after_secs (adaptive: unload after a request and load again this long after it; null: "
        "no pre-warm), prewarm_loads / prewarm_used / prewarm_wasted, prewarmed_unused; doze_after_secs (a model "
        "that can doze: how long it stays awake after a request, learned where the policy is adaptive)",
        default=None,
    )
    worker: str | None = _doc(
        "Custom models: where the model's code runs, in-stub | preforked (a forked worker); None otherwise",
        default=None,
    )
    warmup: str | None = _doc(
        "The load's warm-up: its inputs' source (signature | learned | samples), or 'skipped (...)' when generated "
        'inputs failed (the model loaded; ship samples or set "warmup": false); None: no warm-up',
        default=None,
    )
    ensembles: list[str] | None = _doc(
        "The ensembles whose steps use this model (it wakes with them and stays loaded while they are); None: none",
        default=None,
    )
    steps: list[str] | None = _doc(
        "An ensemble's steps, woken before it and held while it is loaded; None: not an ensemble",
        default=None,
    )
    level: str = _doc(
        "awake (loaded, its code in memory) | dozing (loaded, its preforked workers ended: its next request forks "
        "one) | unloaded (no process)",
        default="unloaded",
    )

    def to_dict(self) -> dict[str, Any]:
        # its instance dict holds exactly its fields (a plain dataclass): copied, not read field by field, since a
        # listing converts thousands
        return {**self.__dict__, "state": self.state.value}


@dataclass(frozen=True)
class SeenDeath:
    death: StubDeath
    at: float  # monotonic seconds when it was noticed
    journaled: bool  # its journal was read: the requests it was running are known


@dataclass(frozen=True)
class CancelledLoad:
    """A load ``cancel.py`` ended: its task, why (unloaded, deleted, republished, stopping), and a future done once
    the cancel is over (Triton's side left, the record UNLOADED)."""

    task: asyncio.Task[Any]
    why: str
    over: asyncio.Future[None]


@dataclass
class MemoryHeld:
    """What the model holds, as measured and estimated: written by the loader's measurements and the budgets."""

    footprint: int | None = None  # last measured bytes; kept after unload to estimate the next load
    footprint_instances: int = 0
    footprint_source: str | None = None  # "measured" or "declared"
    footprint_deployment: Any = None  # the DeploymentSpec it was measured under
    load_footprint: int = 0  # bytes measured when its last load ended
    shared: int = 0  # of its footprint, its share of pages shared with other processes (Pss less private bytes)
    load_private: int = 0  # its private bytes when its last load ended
    growth: int = 0  # how many bytes more its processes held later (sweeps), counted ahead when loaded again as it was
    reserved: int = 0  # bytes set aside while loading
    gpu_footprint: dict[int, int] | None = None  # last measured bytes per GPU index
    gpu_instances: int = 0
    gpu_reserved: dict[int, int] = field(default_factory=dict)  # per GPU, while loading
    # an unload failed (Triton may still be unloading it): its memory stays counted until Triton's index lets go
    triton_may_hold: bool = False


@dataclass
class ProcessRecord:
    """The model's processes as its last load left them, and their deaths: written by the loader, the residency
    and run-once."""

    stubs: tuple[StubProcess, ...] = ()  # the model processes its last load started (when visible)
    workers: tuple[WorkerProcess, ...] = ()  # their preforked workers (worker = "preforked")
    deaths: list[SeenDeath] = field(default_factory=list)  # recent deaths of its processes, oldest first
    crashed_requests: dict[str, StubDeath] = field(default_factory=dict)  # request id -> the death it was in
    last_crash: str | None = None


@dataclass
class AccessRecord:
    """When the model was used and what its keep-alive policy heard: written by the request path, Triton's
    readings and the keep-alive part (``warmth``)."""

    touched: float = 0.0  # epoch seconds of the last activator wake-up or forward
    triton_last: float = 0.0  # epoch seconds of Triton's last_inference
    # epoch seconds a sweep heard a wake from doze: a request reached a stub on the warm path, maybe still running and
    # not yet in Triton's statistics (a decision to doze or unload made on those alone would come right after it)
    woke: float = 0.0
    keep_alive: FixedKeepAlive | None = None  # its keep-alive policy, built on first use (``warmth``)
    served_seen: int = 0  # Triton's count of requests served by the current load, as last read
    access_reported: float = 0.0  # the last triton_last the sweeper handed to the policy
    prewarms_counted: tuple[int, int] = (0, 0)  # the policy's used / wasted pre-warms already in the metrics


@dataclass
class LoadRecord:
    """The model's loads: written by the loader, the transitions, the wake queue and the admin operations."""

    ready_at: float = 0.0  # epoch seconds of the last completed load
    last_cold_start: float | None = None
    load_count: int = 0
    wake_deadline: float | None = None  # clock.monotonic(): the latest wait bound of its wake-ups (the wake queue)
    # a client's config override (repository load; ``overrides``): every load uses it until a load without one,
    # a republish or a delete; in memory only
    config_override: dict[str, Any] | None = None
    override_loaded: bool = False  # Triton holds the model loaded with a client's override
    warmup: str | None = None  # its last load's warm-up: source, or why it was skipped (lifecycle/warmups.py)
    warmup_said: str | None = None  # the skipped warm-up already logged (said once)
    # input shapes its traffic showed, kept into its folder before its next load from unloaded (never while Triton
    # holds it: a file written into a loaded model's folder makes Triton load it anew when a load next names it)
    learned: tuple[str, dict[str, dict[str, Any]]] | None = None  # (its publish token, the shapes)
    # the load task cancel.py ended last, why, and when the cancel is over: the requests that waited on it are told
    cancelled: CancelledLoad | None = None
    # why each load task cancel.py ended was ended, while the task lives: a request woken after a later load was
    # cancelled too still learns why its own was (``cancel.cancelled_why``)
    cancel_reasons: weakref.WeakKeyDictionary[asyncio.Future[Any], str] = field(
        default_factory=weakref.WeakKeyDictionary
    )


@dataclass
class DozeRecord:
    """Which of the model's stubs doze (their preforked workers ended) and what it held awake: written by the doze
    part (``lifecycle/dozing.py``), reset whenever the model's state changes."""

    stubs: frozenset[tuple[int, int]] = frozenset()  # (pid, start ticks) of its stubs that doze now
    since: float = 0.0  # epoch seconds of its last doze
    awake_footprint: int | None = None  # its footprint before it dozed: what a wake brings back
    checked: int = -1  # the record's generation when its stubs were last asked whether they doze (an adoption)
    # a wake that a request about to be sent brings (an ensemble's step, ``Admission.wake_room``) was admitted: it
    # counts what it held awake while something holds it
    wake_admitted: bool = False
    # wakes its stubs asked room for before they forked (``RequestPath.admit_doze_wake``): stub (pid, start ticks),
    # or None for a stub the record does not know, -> clock.monotonic() of the ask; dropped once the wake is heard,
    # or its bound passed (``Dozing.hear``)
    asked: dict[tuple[int, int] | None, float] = field(default_factory=dict)

    @property
    def dozing(self) -> bool:
        return bool(self.stubs)

    @property
    def waking(self) -> bool:
        """A dozing stub of it asked room for its wake, unheard yet: it counts what it held awake."""
        return self.dozing and any(key is None or key in self.stubs for key in self.asked)


@dataclass
class ModelRecord:
    """One model's state and its transition, with a sub-record per part that writes it."""

    id: str
    model: PublishedModel
    state: ModelState = ModelState.UNLOADED
    reason: str | None = None
    instances: int = 0
    in_use: int = 0  # wake-ups waiting for this model, and serving() blocks using it
    op: asyncio.Task[Any] | None = None
    generation: int = 0  # bumped on every state change; guards decisions made across an await
    scale: LoadWindow = field(default_factory=LoadWindow)
    dropped: bool = False  # forgotten (its model deleted): no transition starts on it any more
    memory: MemoryHeld = field(default_factory=MemoryHeld)
    procs: ProcessRecord = field(default_factory=ProcessRecord)
    access: AccessRecord = field(default_factory=AccessRecord)
    load: LoadRecord = field(default_factory=LoadRecord)
    doze: DozeRecord = field(default_factory=DozeRecord)
    # its status while at rest (unloaded, no transition, no keep-alive policy yet) and what it was read from: a
    # listing of thousands of sleeping models builds none of theirs again (``AdminOperations.status``)
    at_rest: tuple[PublishedModel, tuple[Any, ...], ModelStatus] | None = field(default=None, repr=False)

    @property
    def level(self) -> str:
        """How awake it is: awake (its model's code is in memory), dozing (its stubs live, its workers ended:
        ``lifecycle/dozing.py``) or unloaded (no process; loading and failed count as unloaded)."""
        if not self.loaded:
            return "unloaded"
        return "dozing" if self.doze.dozing else "awake"

    @property
    def held(self) -> bool:
        """Not to be evicted now: something holds it (``in_use``: a wake-up waits on it, a request or a stream runs
        through the control plane, a sequence lives), or a stub's wake from doze that asked room is in flight."""
        return self.in_use > 0 or self.doze.waking

    @property
    def last_access(self) -> float | None:
        return max(self.access.touched, self.access.triton_last, self.access.woke) or None

    @property
    def idle_since(self) -> float:
        return max(self.access.touched, self.access.triton_last, self.access.woke, self.load.ready_at)

    @property
    def prewarmed_unused(self) -> bool:
        """Loaded by a pre-warm and no request since: the first to go under memory pressure."""
        return self.access.keep_alive is not None and self.access.keep_alive.prewarmed_unused

    @property
    def retry_after(self) -> float:
        """Seconds a client told to retry waits: about one of its loads."""
        return max(1.0, round(self.load.last_cold_start or 1.0, 1))

    @property
    def is_python(self) -> bool:
        return self.model.backend == "python"

    @property
    def ready(self) -> bool:
        """READY now (a property: the state changes across every await of whoever reads it)."""
        return self.state is ModelState.READY

    @property
    def loaded(self) -> bool:
        return self.state in (ModelState.READY, ModelState.UNLOADING)

    @property
    def holds_memory(self) -> bool:
        """Loaded, or left in Triton by an unload that failed: the memory budget counts it."""
        return self.loaded or self.memory.triton_may_hold


class ModelStates:
    """The records of every model this control plane has seen, and their transitions (one at a time)."""

    def __init__(self, store: ModelStore, metrics: SnoozeMetrics) -> None:
        self.store = store
        self.metrics = metrics
        self.records: dict[str, ModelRecord] = {}
        self.ensembles: set[str] = set()  # ids whose record was made for an ensemble (``Groups.users``)
        # the state of each recorded model that is not UNLOADED (a few among thousands): a listing filtered by state
        # reads this, no record per model (``LifecycleManager.states_of``)
        self.active: dict[str, ModelState] = {}
        self.made = 0  # records made since the sweep last froze the heap (``controlplane/heap.py``)
        # while paused (a checkpoint is being taken): done on resume
        self.pause_ends: asyncio.Future[None] | None = None
        self.stopping = False  # set by the stop: no load starts from then on (a stop never waits for a load)
        self.on_drop: list[Callable[[str], None]] = []  # what else forgets a deleted model (its eviction history)
        # Told every state change, synchronously, before anything awaits: the gateway's ready flags.
        self.listeners: list[Callable[[str, ModelState | None], None]] = []

    def get(self, model_id: str) -> ModelRecord | None:
        return self.records.get(model_id)

    def record(self, model_id: str, *, refresh: bool = False, model: PublishedModel | None = None) -> ModelRecord:
        """The model's record (created for a published model; NotFoundError otherwise). ``refresh``
        re-reads what is published for a model that is not loaded and not in transition; ``model``: what is
        published, just read (a new record need not read it again)."""
        rec = self.records.get(model_id)
        if rec is None:
            rec = ModelRecord(model_id, model if model is not None else self.store.known(model_id))
            self.records[model_id] = rec
            self.made += 1
            if rec.model.kind is PackageKind.TRITON_ENSEMBLE:
                self.ensembles.add(model_id)
            self.metrics.set_state(model_id, rec.state.value)
        elif refresh and rec.op is None and rec.state is not ModelState.READY:
            rec.model = self.store.get(model_id)
        return rec

    def drop(self, model_id: str) -> None:
        for forget in self.on_drop:
            forget(model_id)
        rec = self.records.pop(model_id, None)
        self.ensembles.discard(model_id)
        self.active.pop(model_id, None)
        if rec is not None:
            rec.dropped = True  # whoever still holds it (a waiting wake-up) cannot load it again
        self.metrics.forget(model_id)
        self._tell(model_id, None)

    def loaded(self) -> list[ModelRecord]:
        """The READY records, from the states kept of the models not unloaded (``active``): the sweep and the process
        watch pass over these, not over every record (thousands of sleeping models cost them nothing)."""
        records, ready = self.records, ModelState.READY
        return [rec for m, state in self.active.items() if state is ready and (rec := records.get(m)) is not None]

    def values(self) -> list[ModelRecord]:
        return list(self.records.values())

    def set_state(self, rec: ModelRecord, state: ModelState, reason: str | None = None) -> None:
        rec.state, rec.reason = state, reason
        rec.generation += 1
        if self.records.get(rec.id) is rec:  # not a dropped record's late change
            if state is ModelState.UNLOADED:
                self.active.pop(rec.id, None)
            else:
                self.active[rec.id] = state
        self.metrics.set_state(rec.id, state.value)
        self._tell(rec.id, state)

    def _tell(self, model_id: str, state: ModelState | None) -> None:
        for listener in self.listeners:
            try:
                listener(model_id, state)
            except Exception:  # a listener's failure must not stop a transition
                log.exception("model '%s': a state listener failed", model_id)

    def spawn(
        self,
        rec: ModelRecord,
        state: ModelState,
        reason: str | None,
        coro: Coroutine[Any, Any, Any],
        *,
        loads: bool = False,
    ) -> asyncio.Task[Any]:
        """Enter ``state`` and run ``coro`` as the model's one transition. No load starts once the stop began
        (``UnavailableError``): the stop cancelled the loads in flight and waits for no new one. ``loads``: the
        transition loads while the model stays in ``state`` (a loaded model's reload in place)."""
        if (state is ModelState.LOADING or loads) and self.stopping:
            coro.close()
            raise UnavailableError(
                f"model '{rec.id}' is not loaded: snoozeml is stopping"
                if state is ModelState.LOADING
                else f"model '{rec.id}' was not reloaded: snoozeml is stopping (its next start loads the new one)",
                hint="retry once it is running again",
                retry_after=5,
            )
        if rec.op is not None:
            coro.close()
            raise RuntimeError(f"model '{rec.id}' already has a transition running")  # a bug here, not a user error
        if rec.dropped:
            coro.close()
            raise NotFoundError(f"model '{rec.id}' was deleted", hint="publish it again to serve it")
        self.set_state(rec, state, reason)
        task = asyncio.create_task(coro, name=f"snooze-{rec.id}-{state.value}")
        rec.op = task

        def done(t: asyncio.Task[Any]) -> None:
            if rec.op is t:
                rec.op = None
            if not t.cancelled() and t.exception() is not None:  # retrieved here; callers re-raise their own
                log.debug("model '%s': transition failed: %s", rec.id, t.exception())

        task.add_done_callback(done)
        return task

    async def settle(self, rec: ModelRecord) -> None:
        """Wait until no transition runs for the model (their failures are in the model's state) and
        the lifecycle is not paused."""
        while (busy := rec.op or self.pause_ends) is not None:
            if busy.done():  # ended, but the callback that clears rec.op has not run: awaiting it would not yield
                await asyncio.sleep(0)
                continue
            try:
                await asyncio.shield(busy)
            except SnoozeError:
                pass
            except asyncio.CancelledError:  # a cancelled load (cancel.py) has settled too; else this task is cancelled
                if not busy.cancelled():
                    raise

    async def wait_all(self, timeout: float | None = None) -> list[str]:
        """Wait for every running transition, at most ``timeout`` seconds; those still running then are
        cancelled. Returns the models whose transitions were cancelled."""
        ops = {r.op: r.id for r in self.records.values() if r.op is not None}
        if not ops:
            return []
        _, pending = await asyncio.wait(ops, timeout=timeout)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        return sorted(ops[t] for t in pending)
