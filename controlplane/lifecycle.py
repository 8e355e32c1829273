"""The model lifecycle: wake on request, idle unload, memory budget (LRU), autoscaling, recovery.

Per model: ``unloaded -> loading -> ready -> unloading -> unloaded``, plus ``failed`` with the reason.
Every transition of one model runs as a single asyncio task (``_Model.op``): whoever needs the
model while a transition runs awaits that task instead of starting another one. That is the single
flight of wake-ups (N concurrent first requests share one Triton load), and it also orders wake-ups
after unloads and recoveries.

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
import json
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import psutil
from google.protobuf import json_format

from controlplane.errors import ConflictError, SnoozeError, TritonModelLoadError, UnavailableError
from controlplane.metrics import SnoozeMetrics
from controlplane.render import parse_config
from controlplane.settings import Settings
from controlplane.store import ModelStore, PublishedModel
from controlplane.triton.client import BUSY_STATES, RepositoryEntry, TritonAdminClient
from controlplane.triton.launcher import EmbeddedTriton

log = logging.getLogger("snoozeml.lifecycle")

MIB = 1024 * 1024
# How a load failure says "out of memory": the python_backend runtime's kind prefix, Python's
# exception name, and the wording of CUDA, onnxruntime and cuDNN.
OOM_MARKERS = ("[snooze:oom]", "memoryerror", "out of memory")
OOM_HINT = (
    "give the machine more memory, lower memory_budget_mb so fewer models stay loaded, or declare the "
    "model's memory_mb so the budget keeps room for it"
)
# Requests that failed against a dead stub reach recover() just after the first of them reloaded
# the model; a model (re)loaded this recently is not reloaded again.
RECOVERY_DEDUP_SECS = 2.0
# After load_timeout_secs, how long Triton gets to fail a load whose stubs were killed; a wake-up
# waits this much longer than load_timeout_secs, so that it reports the load's failure.
LOAD_ABANDON_SECS = 5.0
# A config parameter changed on recovery. Triton 2.51 cannot unload a model after a request failed
# on its dead stub (the unload hangs for a minute or more, measured), and an in-place instance
# change keeps the dead instance; a reload whose config differs replaces every instance in ~1 s.
GENERATION_PARAMETER = "snooze_generation"


class ModelState(str, Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"
    FAILED = "failed"


@dataclass(frozen=True)
class ModelStatus:
    id: str
    state: ModelState
    reason: str | None
    instances: int  # loaded instances (0 when not loaded)
    last_access: float | None  # epoch seconds: Triton's last_inference or an activator wake-up
    idle_timeout_secs: float
    memory_bytes: int | None  # measured footprint while loaded
    last_cold_start_secs: float | None
    load_count: int  # successful Triton loads (cold starts, reloads, rescales, recoveries)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "state": self.state.value,
            "reason": self.reason,
            "instances": self.instances,
            "last_access": self.last_access,
            "idle_timeout_secs": self.idle_timeout_secs,
            "memory_bytes": self.memory_bytes,
            "last_cold_start_secs": self.last_cold_start_secs,
            "load_count": self.load_count,
        }


def is_oom_error(text: str) -> bool:
    lowered = text.lower()
    return any(marker in lowered for marker in OOM_MARKERS)


def rendered_config(config_text: str, *, where: str) -> dict[str, Any]:
    """A published config.pbtxt as the JSON a load override takes."""
    return json_format.MessageToDict(parse_config(config_text, where=where), preserving_proto_field_name=True)


def config_with_instances(config: dict[str, Any], instances: int, *, replace: bool = False) -> dict[str, Any]:
    """``config`` (override JSON) with ``instances`` in its (first, and for snoozeml only) instance group.

    ``replace`` also changes a parameter, which makes Triton build every instance anew instead of
    updating the instance count in place.
    """
    config = json.loads(json.dumps(config))
    groups = config.setdefault("instance_group", [])
    if not groups:
        groups.append({"kind": "KIND_CPU"})
    groups[0]["count"] = instances
    if replace:
        config.setdefault("parameters", {})[GENERATION_PARAMETER] = {"string_value": str(time.time_ns())}
    return config


@dataclass
class LoadWindow:
    """How long a model's queue has stayed high (scale up) or low (scale down); monotonic seconds."""

    high_since: float | None = None
    low_since: float | None = None


def autoscale_step(
    window: LoadWindow,
    *,
    pending: float,
    instances: int,
    base: int,
    max_instances: int,
    threshold: float,
    window_secs: float,
    idle_timeout_secs: float,
    now: float,
) -> int:
    """The instance count the model should have now (``instances`` when nothing changes).

    Up: pending requests per instance above ``threshold`` for ``window_secs`` doubles the
    instances, up to ``max_instances``. Down: one instance less after ``idle_timeout / N`` of low
    load, where low means the queue would stay under half the threshold with one instance less (the
    gap between the two thresholds keeps the count from flapping).
    """
    if pending > threshold * instances:
        window.low_since = None
        if window.high_since is None:
            window.high_since = now
        if now - window.high_since >= window_secs and instances < max_instances:
            window.high_since = None
            return min(max_instances, instances * 2)
        return instances
    window.high_since = None
    if instances > base and pending <= threshold * (instances - 1) / 2:
        if window.low_since is None:
            window.low_since = now
        if now - window.low_since >= idle_timeout_secs / instances:
            window.low_since = None
            return instances - 1
        return instances
    window.low_since = None
    return instances


@dataclass
class _Model:
    id: str
    model: PublishedModel
    state: ModelState = ModelState.UNLOADED
    reason: str | None = None
    instances: int = 0
    touched: float = 0.0  # epoch seconds of the last activator wake-up / touch()
    triton_last: float = 0.0  # epoch seconds of Triton's last_inference
    ready_at: float = 0.0  # epoch seconds of the last completed load
    footprint: int | None = None  # last measured bytes; kept after unload to estimate the next load
    footprint_instances: int = 0
    reserved: int = 0  # bytes set aside while loading
    expected_stubs: int = 0
    last_cold_start: float | None = None
    load_count: int = 0
    users: int = 0  # wake-ups waiting for this model, and serving() blocks using it
    op: asyncio.Task[Any] | None = None
    generation: int = 0  # bumped on every state change; guards decisions made across an await
    scale: LoadWindow = field(default_factory=LoadWindow)

    @property
    def last_access(self) -> float | None:
        return max(self.touched, self.triton_last) or None

    @property
    def idle_since(self) -> float:
        return max(self.touched, self.triton_last, self.ready_at)

    @property
    def is_python(self) -> bool:
        return self.model.backend == "python"


class LifecycleManager:
    def __init__(
        self,
        settings: Settings,
        store: ModelStore,
        triton: TritonAdminClient,
        *,
        triton_process: EmbeddedTriton | None = None,
        metrics: SnoozeMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.triton = triton
        self.triton_process = triton_process
        self.metrics = metrics or SnoozeMetrics()
        self._models: dict[str, _Model] = {}
        self._load_slots = asyncio.Semaphore(settings.max_concurrent_loads)
        self._triton_up = asyncio.Event()
        self._triton_up.set()
        self._sweeper: asyncio.Task[None] | None = None
        self._resumed: asyncio.Future[None] | None = None  # set while paused; resolved by resume()
        self._sweeping = asyncio.Lock()  # held through one sweep, so that pause() can wait for it

    # ------------------------------------------------------------------------------------------
    # Start, stop, sweep

    async def start(self) -> None:
        """Adopt what Triton has loaded (a restarted control plane keeps its models) and start sweeping."""
        await self._resync(full=True)
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="snooze-lifecycle-sweeper")

    async def stop(self) -> None:
        """Stop sweeping and wait for running transitions; models stay loaded in Triton."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        ops = [r.op for r in self._models.values() if r.op is not None]
        if ops:
            await asyncio.gather(*ops, return_exceptions=True)

    async def pause(self) -> None:
        """Hold every change until ``resume()`` (a checkpoint is being taken): no sweep (so no idle unload,
        autoscaling, dead-stub recovery or resync), and wake-ups, ``recover()`` and the API's load, unload,
        publish and delete wait instead of acting. Returns once the sweep and the transitions already under
        way have finished."""
        if self._resumed is None:
            self._resumed = asyncio.get_running_loop().create_future()
        async with self._sweeping:
            pass
        while ops := [r.op for r in self._models.values() if r.op is not None]:
            await asyncio.gather(*ops, return_exceptions=True)

    def resume(self) -> None:
        """End ``pause()``: whatever waited goes on, the sweeper sweeps again."""
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_result(None)
        self._resumed = None

    @property
    def paused(self) -> bool:
        return self._resumed is not None

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_secs)
            while self._resumed is not None:  # paused: no sweep until resume()
                await asyncio.shield(self._resumed)
            try:
                async with self._sweeping:
                    await self.sweep()
            except SnoozeError as e:
                log.warning("lifecycle sweep: %s", e)
            except Exception:  # the sweeper must outlive any one bad sweep
                log.exception("lifecycle sweep failed")

    async def sweep(self) -> None:
        """One pass: Triton alive, state vs Triton's index, dead stubs, idle unloads, autoscaling."""
        if not await self._check_triton():
            return
        await self._resync(full=False)
        ready = [r for r in self._models.values() if r.state is ModelState.READY and r.op is None]
        await asyncio.gather(*(self._refresh_access(r) for r in ready))
        pending = await self._pending_counts()
        dead = await asyncio.to_thread(self._dead_stubs, ready)
        for rec in dead:
            if rec.op is not None or rec.state is not ModelState.READY:
                continue
            log.warning("model '%s': a python stub process died; reloading the model", rec.id)
            self._spawn(rec, ModelState.LOADING, "recovering: dead stub", self._recover_op(rec, "dead_stub"))
        now = time.time()
        for rec in ready:
            if rec.op is not None or rec.state is not ModelState.READY:
                continue
            dep = rec.model.deployment
            queued = pending.get(rec.id, 0.0)
            if now - rec.idle_since >= dep.idle_timeout_secs and rec.users == 0 and queued == 0:
                self._spawn(rec, ModelState.UNLOADING, "idle", self._unload_op(rec, "idle", seen_access=rec.idle_since))
            elif self.settings.autoscale and rec.id in pending and rec.instances > 0:
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
                if target != rec.instances:
                    direction = "up" if target > rec.instances else "down"
                    log.info("model '%s': scaling %s to %d instances (%g pending)", rec.id, direction, target, queued)
                    self._spawn(
                        rec,
                        ModelState.READY,
                        f"scaling to {target} instances",
                        self._rescale_op(rec, target, direction),
                    )

    # ------------------------------------------------------------------------------------------
    # What the activator and the API call

    async def ensure_ready(self, model_id: str, *, timeout: float | None = None) -> None:
        """Return once the model is READY, loading it (single flight) if needed.

        Raises NotFoundError if it is not published, UnavailableError (with retry_after) if the load
        fails or outlives ``timeout`` (default: settings.wake_timeout_secs, else the model's
        load_timeout_secs).
        """
        rec = self._models.get(model_id)
        if rec is not None and rec.state is ModelState.READY:
            rec.touched = time.time()
            return
        rec = self._record(model_id, refresh=True)
        wait = (
            timeout
            if timeout is not None
            else (self.settings.wake_timeout_secs or rec.model.load_timeout_secs + LOAD_ABANDON_SECS)
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        started = time.monotonic()
        self.metrics.wake_waits.labels(model=model_id).inc()
        rec.users += 1
        try:
            while rec.state is not ModelState.READY:
                # While paused, the wake-up waits for resume() (within its deadline) instead of loading.
                op = (
                    rec.op
                    or self._resumed
                    or self._spawn(rec, ModelState.LOADING, "wake-up", self._cold_load_op(rec, "request"))
                )
                try:
                    await asyncio.wait_for(asyncio.shield(op), max(deadline - loop.time(), 0))
                except TimeoutError:
                    self.metrics.wake_timeouts.labels(model=model_id).inc()
                    raise UnavailableError(
                        f"model '{model_id}' is not ready after {wait:g}s (it is {rec.state.value})",
                        hint="retry later; if its load takes longer, raise the model's load_timeout_secs "
                        "(or SNOOZE_WAKE_TIMEOUT_SECS)",
                        retry_after=self._retry_after(rec),
                    ) from None
                except SnoozeError as e:
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

    @contextlib.asynccontextmanager
    async def serving(self, model_id: str, *, timeout: float | None = None) -> AsyncIterator[None]:
        """``ensure_ready``, then keep the model from idle unload and eviction until the block ends
        (for the activator's forward: between the wake-up and Triton receiving the request)."""
        rec = self._record(model_id)
        rec.users += 1
        try:
            await self.ensure_ready(model_id, timeout=timeout)
            yield
        finally:
            rec.users -= 1
            rec.touched = time.time()

    def touch(self, model_id: str) -> None:
        rec = self._models.get(model_id)
        if rec is None and self.store.exists(model_id):
            rec = self._record(model_id)
        if rec is not None:
            rec.touched = time.time()

    async def recover(self, model_id: str, cause: str) -> None:
        """Unload and reload a model whose python stub died (Triton 2.51 does not restart stubs)."""
        rec = self._record(model_id)
        await self._settle(rec)
        if rec.state is ModelState.READY:
            if time.time() - rec.ready_at < RECOVERY_DEDUP_SECS and not self._dead_stubs([rec]):
                return
        elif rec.state is not ModelState.FAILED:
            return  # not loaded: the next wake-up loads it fresh
        op = self._spawn(rec, ModelState.LOADING, f"recovering: {cause}", self._recover_op(rec, cause))
        try:
            await asyncio.shield(op)
        except SnoozeError as e:
            raise UnavailableError(
                f"model '{model_id}' could not be recovered ({cause}): {rec.reason}",
                hint=e.hint,
                retry_after=self._retry_after(rec),
            ) from e

    async def stubs_alive(self, model_id: str) -> bool | None:
        """Whether a READY python model still has every stub process it had after its load; None
        when that cannot be seen (no embedded Triton, not READY, not a python model)."""
        rec = self._models.get(model_id)
        if self.triton_process is None or rec is None or rec.state is not ModelState.READY:
            return None
        if not rec.is_python or not rec.expected_stubs:
            return None
        return not await asyncio.to_thread(self._dead_stubs, [rec])

    async def load(self, model_id: str, *, instances: int | None = None) -> ModelStatus:
        """Load (API): cold load, or change the instance count of a loaded model in place."""
        rec = self._record(model_id, refresh=True)
        dep = rec.model.deployment
        limit = max(dep.max_instances, dep.instances)
        if instances is not None and not 1 <= instances <= limit:
            raise ConflictError(
                f"model '{model_id}': {instances} instances requested, allowed 1..{limit}",
                hint="raise the model's max_instances and publish it again",
            )
        await self._settle(rec)
        if rec.state is ModelState.READY:
            if instances is not None and instances != rec.instances:
                await asyncio.shield(
                    self._spawn(
                        rec,
                        ModelState.READY,
                        f"scaling to {instances} instances",
                        self._rescale_op(rec, instances, None),
                    )
                )
        else:
            await asyncio.shield(
                self._spawn(rec, ModelState.LOADING, "loading", self._cold_load_op(rec, "api", instances))
            )
        return self.status(model_id)

    async def unload(self, model_id: str, *, reason: str = "api") -> ModelStatus:
        rec = self._record(model_id)
        await self._settle(rec)
        if rec.state is ModelState.READY:
            await asyncio.shield(self._spawn(rec, ModelState.UNLOADING, reason, self._unload_op(rec, reason)))
        elif rec.state is ModelState.FAILED:
            self._set_state(rec, ModelState.UNLOADED)
        return self.status(model_id)

    async def published(self, model_id: str) -> None:
        """After a (re)publish: reload a loaded model so it runs the new files and config.

        A failed reload leaves Triton serving the previous version: the model stays READY and its
        status reason says what failed.
        """
        rec = self._models.get(model_id)
        if rec is None:
            return
        await self._settle(rec)
        rec.model = self.store.get(model_id)
        if rec.state is ModelState.FAILED:
            self._set_state(rec, ModelState.UNLOADED, "republished; loads on the next request")
        elif rec.state is ModelState.READY:
            await asyncio.shield(self._spawn(rec, ModelState.READY, "reloading after publish", self._reload_op(rec)))

    async def forget(self, model_id: str) -> None:
        """Before a delete: unload the model if loaded and drop its state and metrics."""
        rec = self._models.get(model_id)
        if rec is None:
            return
        await self._settle(rec)
        if rec.state is ModelState.READY:
            await asyncio.shield(self._spawn(rec, ModelState.UNLOADING, "deleted", self._unload_op(rec, "deleted")))
        self._models.pop(model_id, None)
        self.metrics.forget(model_id)

    def status(self, model_id: str) -> ModelStatus:
        rec = self._record(model_id)
        loaded = rec.state in (ModelState.READY, ModelState.UNLOADING)
        return ModelStatus(
            id=rec.id,
            state=rec.state,
            reason=rec.reason,
            instances=rec.instances,
            last_access=rec.last_access,
            idle_timeout_secs=rec.model.deployment.idle_timeout_secs,
            memory_bytes=rec.footprint if loaded else None,
            last_cold_start_secs=rec.last_cold_start,
            load_count=rec.load_count,
        )

    def statuses(self) -> list[ModelStatus]:
        ids = set(self.store.ids()) | set(self._models)
        return [self.status(i) for i in sorted(ids)]

    # ------------------------------------------------------------------------------------------
    # Transitions (each runs as the model's single op task)

    def _spawn(
        self, rec: _Model, state: ModelState, reason: str | None, coro: Coroutine[Any, Any, Any]
    ) -> asyncio.Task[Any]:
        if rec.op is not None:
            coro.close()
            raise RuntimeError(f"model '{rec.id}' already has a transition running")  # a bug here, not a user error
        self._set_state(rec, state, reason)
        task = asyncio.create_task(coro, name=f"snooze-{rec.id}-{state.value}")
        rec.op = task

        def done(t: asyncio.Task[Any]) -> None:
            if rec.op is t:
                rec.op = None
            if not t.cancelled() and t.exception() is not None:  # retrieved here; callers re-raise their own
                log.debug("model '%s': transition failed: %s", rec.id, t.exception())

        task.add_done_callback(done)
        return task

    async def _settle(self, rec: _Model) -> None:
        """Wait until no transition runs for the model (their failures are in the model's state) and the
        manager is not paused."""
        while (busy := rec.op or self._resumed) is not None:
            with contextlib.suppress(SnoozeError):
                await asyncio.shield(busy)

    async def _cold_load_op(self, rec: _Model, trigger: str, instances: int | None = None) -> None:
        try:
            await self._load(rec, instances or rec.model.deployment.instances, trigger=trigger)
        except SnoozeError as e:
            self._load_failed(rec, e)
            self._set_state(rec, ModelState.FAILED, str(e.message))
            raise

    async def _recover_op(self, rec: _Model, cause: str) -> None:
        instances = rec.instances or rec.model.deployment.instances
        try:
            # The dead stub's model is still READY in Triton, so a plain load would change nothing.
            await self._load(rec, instances, how="replace")
        except SnoozeError as e:
            self._load_failed(rec, e)
            self._set_state(rec, ModelState.FAILED, str(e.message))
            raise
        self.metrics.recoveries.labels(model=rec.id, cause=cause).inc()

    async def _rescale_op(self, rec: _Model, instances: int, direction: str | None) -> None:
        before = rec.instances
        try:
            await self._load(rec, instances, how="in_place")
        except SnoozeError as e:
            # Triton keeps the model as it was when a reload fails.
            self._set_state(rec, ModelState.READY, f"scaling to {instances} instances failed: {e.message}")
            rec.scale = LoadWindow()
            if direction is None:
                raise
            log.warning("model '%s': %s", rec.id, rec.reason)
            return
        if direction is not None:
            self.metrics.scale_events.labels(model=rec.id, direction=direction).inc()
        log.info("model '%s': %d -> %d instances", rec.id, before, instances)

    async def _reload_op(self, rec: _Model) -> None:
        try:
            await self._load(rec, rec.model.deployment.instances)
        except SnoozeError as e:
            self._load_failed(rec, e)
            self._set_state(
                rec,
                ModelState.READY,
                f"the republished model failed to load; Triton keeps serving the previous version: {e.message}",
            )

    async def _unload_op(self, rec: _Model, reason: str, *, seen_access: float | None = None) -> bool:
        """Unload; for idle unloads and evictions (``seen_access`` given) first make sure nothing uses it.

        Returns False when the model turned out to be in use and stays READY.
        """
        if seen_access is not None:
            # The model is already out of service (UNLOADING: wake-ups wait for this op). Anything
            # still queued in Triton, a wake-up waiting, or a request since the decision keeps it.
            await self._refresh_access(rec)
            pending = (await self._pending_counts()).get(rec.id, 0.0)
            if pending > 0 or rec.users > 0 or rec.idle_since > seen_access:
                self._set_state(rec, ModelState.READY)
                return False
        try:
            await self.triton.unload(rec.id, wait=True)
        except SnoozeError as e:
            self._set_state(rec, ModelState.FAILED, f"unload ({reason}) failed: {e}")
            raise
        self._forget_loaded(rec)
        self._set_state(rec, ModelState.UNLOADED, reason)
        if reason == "idle":
            self.metrics.idle_unloads.labels(model=rec.id).inc()
        elif reason in ("memory", "oom"):
            self.metrics.evictions.labels(model=rec.id, reason=reason).inc()
        log.info("model '%s': unloaded (%s)", rec.id, reason)
        return True

    # ------------------------------------------------------------------------------------------
    # Loading, memory

    async def _load(self, rec: _Model, instances: int, *, trigger: str | None = None, how: str = "files") -> None:
        """Load with ``instances``; ``trigger`` marks a cold start.

        ``how``: "files" loads what is published (a reload picks up new files); "in_place" changes
        only the instance count of the loaded model; "replace" rebuilds every instance.
        """
        rec.model = self.store.get(rec.id)  # Triton reads what is published now
        await self._wait_for_triton(rec)
        async with self._load_slots:
            need = self._estimate(rec, instances)
            await self._make_room(rec, need)
            rec.reserved = need
            started = time.monotonic()
            try:
                await self._triton_load(rec, instances, need, how)
            finally:
                rec.reserved = 0
            elapsed = time.monotonic() - started
        await self._loaded(rec, instances)
        if trigger is not None:
            rec.last_cold_start = elapsed
            self.metrics.cold_starts.labels(model=rec.id, trigger=trigger).inc()
            self.metrics.cold_start_seconds.labels(model=rec.id).observe(elapsed)
            log.info("model '%s': cold start (%s) in %.3fs", rec.id, trigger, elapsed)

    async def _load_config(self, rec: _Model, instances: int, how: str) -> dict[str, Any] | None:
        """The config override for a load, or None to load config.pbtxt as published."""
        if how in ("in_place", "replace"):
            # Start from Triton's own (normalised) config: an override built from config.pbtxt differs
            # from it in defaults, and Triton then reloads every instance instead of adding or removing
            # some. Also, a load without an override does not undo an earlier one when the files are
            # unchanged (measured), so going back to the published count needs an override too.
            with contextlib.suppress(SnoozeError):
                current = await self.triton.model_config(rec.id)
                return config_with_instances(current, instances, replace=how == "replace")
        if instances == rec.model.deployment.instances:
            return None
        return config_with_instances(rendered_config(rec.model.config_text, where=f"model '{rec.id}'"), instances)

    async def _triton_load(self, rec: _Model, instances: int, need: int, how: str) -> None:
        config = await self._load_config(rec, instances, how)
        timeout = rec.model.load_timeout_secs
        try:
            await self._load_within(rec, config, timeout)
            return
        except TritonModelLoadError as e:
            if not is_oom_error(e.reason):
                raise
            first = e
        evicted = await self._evict(rec, max(need, 1), "oom")
        if not evicted:
            raise TritonModelLoadError(
                rec.id,
                f"out of memory, and no idle model could be unloaded to make room ({first.reason})",
                hint=OOM_HINT,
            ) from first
        log.warning("model '%s': out of memory at load; evicted %s, retrying once", rec.id, evicted)
        try:
            await self._load_within(rec, config, timeout)
        except TritonModelLoadError as e:
            if not is_oom_error(e.reason):
                raise
            raise TritonModelLoadError(
                rec.id, f"out of memory even after unloading {', '.join(evicted)} ({e.reason})", hint=OOM_HINT
            ) from e

    async def _load_within(self, rec: _Model, config: dict[str, Any] | None, timeout: float) -> None:
        """Triton's load, abandoned after ``timeout`` seconds.

        Triton waits for a python model's ``initialize`` (the user's ``load``) without a limit, and
        keeps the model LOADING meanwhile. So on time-out the stubs this load started are killed:
        Triton then fails the load ("Stub process ... is not healthy") and the next request can try again.
        """
        before = set(await asyncio.to_thread(self._stub_pids, rec))
        try:
            load = self.triton.load(rec.id, config=config, timeout=timeout + LOAD_ABANDON_SECS)
            await asyncio.wait_for(load, timeout)
            return
        except TimeoutError:
            pass
        started = [p for p in await asyncio.to_thread(self._stub_pids, rec) if p not in before]
        for pid in started:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        log.warning("model '%s': load exceeded %gs; killed its stubs %s", rec.id, timeout, started)
        deadline = time.monotonic() + LOAD_ABANDON_SECS
        with contextlib.suppress(SnoozeError):  # let Triton finish failing it, so a retry starts clean
            while time.monotonic() < deadline and any(
                e.name == rec.id and e.state == "LOADING" for e in await self.triton.repository_index()
            ):
                await asyncio.sleep(0.1)
        raise TritonModelLoadError(
            rec.id,
            f"load exceeded load_timeout_secs={timeout:g}",
            hint="make the model's load() faster, or raise load_timeout_secs in its snooze_model.json",
        )

    async def _loaded(self, rec: _Model, instances: int, *, count: bool = True) -> None:
        pids, rss = await asyncio.to_thread(self._stubs_and_rss, rec)
        rec.instances = instances
        rec.expected_stubs = min(len(pids), instances)
        measured = rss if pids else self._declared_bytes(rec)
        if measured is not None:
            rec.footprint, rec.footprint_instances = measured, instances
        rec.ready_at = time.time()
        rec.load_count += count
        rec.scale = LoadWindow()
        self._set_state(rec, ModelState.READY)
        self.metrics.instances.labels(model=rec.id).set(instances)
        self.metrics.memory_bytes.labels(model=rec.id).set(measured or 0)

    def _forget_loaded(self, rec: _Model) -> None:
        rec.instances = 0
        rec.expected_stubs = 0
        self.metrics.instances.labels(model=rec.id).set(0)
        self.metrics.memory_bytes.labels(model=rec.id).set(0)

    def _load_failed(self, rec: _Model, error: SnoozeError) -> None:
        kind = "oom" if is_oom_error(str(error)) else "error"
        self.metrics.load_failures.labels(model=rec.id, kind=kind).inc()
        log.warning("model '%s': load failed: %s", rec.id, error)

    def _declared_bytes(self, rec: _Model) -> int | None:
        mb = rec.model.deployment.memory_mb
        return int(mb * MIB) if mb else None

    def _estimate(self, rec: _Model, instances: int) -> int:
        """Bytes the model will hold with ``instances``: its last measurement, else its declared
        memory_mb, else the average of the models measured so far, else 0 (per instance, scaled)."""
        if rec.footprint and rec.footprint_instances:
            per = rec.footprint / rec.footprint_instances
        elif rec.model.deployment.memory_mb:
            per = rec.model.deployment.memory_mb * MIB / rec.model.deployment.instances
        else:
            known = [
                r.footprint / r.footprint_instances
                for r in self._models.values()
                if r.footprint and r.footprint_instances
            ]
            per = sum(known) / len(known) if known else 0
        return int(per * instances)

    def _used(self, exclude: _Model) -> int:
        used = 0
        for r in self._models.values():
            if r is exclude:
                continue
            if r.state is ModelState.LOADING:
                used += r.reserved
            elif r.state in (ModelState.READY, ModelState.UNLOADING):
                used += r.footprint or 0
        return used

    async def _make_room(self, rec: _Model, need: int) -> None:
        if self.settings.memory_budget_mb is None:
            return
        budget = int(self.settings.memory_budget_mb * MIB)
        if need > budget:
            raise UnavailableError(
                f"model '{rec.id}' needs about {need / MIB:.0f} MiB, more than the whole memory budget "
                f"({self.settings.memory_budget_mb:g} MiB)",
                hint="raise SNOOZE_MEMORY_BUDGET_MB, or load the model with fewer instances",
            )
        while self._used(rec) + need > budget:
            if not await self._evict(rec, self._used(rec) + need - budget, "memory"):
                busy = sorted(
                    r.id
                    for r in self._models.values()
                    if r is not rec
                    and (r.footprint or r.reserved)
                    and r.state in (ModelState.READY, ModelState.LOADING, ModelState.UNLOADING)
                )
                raise UnavailableError(
                    f"memory budget full: model '{rec.id}' needs about {need / MIB:.0f} MiB and "
                    f"{self._used(rec) / MIB:.0f} of {self.settings.memory_budget_mb:g} MiB are held by models in use "
                    f"({', '.join(busy)})",
                    hint="retry when they are idle, or raise SNOOZE_MEMORY_BUDGET_MB",
                    retry_after=5,
                )

    async def _evict(self, rec: _Model, amount: int, reason: str) -> list[str]:
        """Unload least-recently-used idle models until ``amount`` bytes are freed; their ids."""
        pending = await self._pending_counts()
        candidates = sorted(
            (r for r in self._models.values() if r is not rec and r.state is ModelState.READY),
            key=lambda r: r.idle_since,
        )
        freed, evicted = 0, []
        for victim in candidates:
            if freed >= amount:
                break
            if victim.op is not None or victim.users > 0 or pending.get(victim.id, 0.0) > 0:
                continue
            size = victim.footprint or 0
            op = self._spawn(
                victim,
                ModelState.UNLOADING,
                f"evicted ({reason}) for '{rec.id}'",
                self._unload_op(victim, reason, seen_access=victim.idle_since),
            )
            try:
                unloaded = await asyncio.shield(op)
            except SnoozeError as e:
                log.warning("model '%s': eviction failed: %s", victim.id, e)
                continue
            if unloaded:
                freed += size
                evicted.append(victim.id)
        return evicted

    # ------------------------------------------------------------------------------------------
    # Observing Triton

    async def _refresh_access(self, rec: _Model) -> None:
        with contextlib.suppress(SnoozeError):
            stats = await self.triton.model_stats(rec.id)
            rec.triton_last = max(rec.triton_last, stats.last_inference_ms / 1000)

    async def _pending_counts(self) -> dict[str, float]:
        """Pending requests per model from Triton's metrics; empty when they cannot be read."""
        if self.triton.metrics_url is None:
            return {}
        try:
            return await self.triton.pending_request_counts()
        except SnoozeError as e:
            log.warning("cannot read Triton's pending request counts: %s", e)
            return {}

    def _stub_pids(self, rec: _Model) -> list[int]:
        if self.triton_process is None or not rec.is_python:
            return []
        return self.triton_process.stub_pids(rec.id)

    def _stubs_and_rss(self, rec: _Model) -> tuple[list[int], int]:
        if self.triton_process is None or not rec.is_python:
            return [], 0
        pids = self.triton_process.stub_pids(rec.id)
        rss = 0
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                rss += psutil.Process(pid).memory_info().rss
        return pids, rss

    def _dead_stubs(self, records: Iterable[_Model]) -> list[_Model]:
        """READY python models with fewer live stub processes than they had after their load."""
        if self.triton_process is None:
            return []
        return [
            r
            for r in records
            if r.is_python and r.expected_stubs and len(self.triton_process.stub_pids(r.id)) < r.expected_stubs
        ]

    async def _check_triton(self) -> bool:
        """False while the embedded tritonserver is down; restarts it when settings allow."""
        proc = self.triton_process
        if proc is None:
            return True
        if not proc.is_running():
            if self._triton_up.is_set():
                self._triton_up.clear()
                log.error("tritonserver (pid %s) died; every model is unloaded", proc.pid)
                for rec in self._models.values():
                    if rec.op is None:
                        self._forget_loaded(rec)
                        self._set_state(rec, ModelState.UNLOADED, "tritonserver died")
            if not self.settings.restart_triton:
                return False
            try:
                await asyncio.to_thread(proc.restart)
            except SnoozeError as e:
                log.error("restarting tritonserver failed (retrying at the next sweep): %s", e)
                return False
            self.metrics.triton_restarts.inc()
            log.warning("tritonserver restarted (pid %s)", proc.pid)
        if not self._triton_up.is_set():
            await self._resync(full=True)  # raises on failure: the next sweep tries again
            self._triton_up.set()
        return True

    async def _wait_for_triton(self, rec: _Model) -> None:
        if self._triton_up.is_set():
            return
        if not self.settings.restart_triton:
            raise UnavailableError(
                f"model '{rec.id}' cannot load: tritonserver is not running",
                hint="restart snoozectl serve, or set SNOOZE_RESTART_TRITON=true",
            )
        try:
            await asyncio.wait_for(self._triton_up.wait(), rec.model.load_timeout_secs)
        except TimeoutError:
            raise UnavailableError(
                f"model '{rec.id}' cannot load: tritonserver has not come back", retry_after=5
            ) from None

    async def _resync(self, *, full: bool) -> None:
        """Align states with Triton's repository index.

        full (start, after a Triton restart): every idle model takes Triton's word. Otherwise only
        models whose state Triton contradicts (unloaded or loaded behind snoozeml's back) change;
        a state changed by a transition while the index was fetched is left alone.
        """
        generations = {m: r.generation for m, r in self._models.items()}
        entries: dict[str, RepositoryEntry] = {e.name: e for e in await self.triton.repository_index()}
        new = self.store.ids() if full else [n for n, e in entries.items() if e.state in BUSY_STATES]
        for model_id in new:
            if model_id not in self._models and self.store.exists(model_id):
                self._record(model_id)
        for model_id, rec in list(self._models.items()):
            if rec.op is not None or generations.get(model_id, rec.generation) != rec.generation:
                continue
            if not self.store.exists(model_id):
                continue
            triton_ready = (e := entries.get(model_id)) is not None and e.state == "READY"
            if triton_ready and rec.state is not ModelState.READY:
                await self._adopt(rec)
            elif not triton_ready and rec.state is ModelState.READY:
                self._forget_loaded(rec)
                self._set_state(rec, ModelState.UNLOADED, "not loaded in Triton")
            elif full and not triton_ready and rec.state is ModelState.FAILED:
                self._set_state(rec, ModelState.UNLOADED, rec.reason)

    async def _adopt(self, rec: _Model) -> None:
        """A model Triton already has loaded becomes READY here, with its instances and footprint."""
        rec.model = self.store.get(rec.id)
        try:
            config = await self.triton.model_config(rec.id)
        except SnoozeError:
            return
        instances = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
        await self._loaded(rec, instances, count=False)

    # ------------------------------------------------------------------------------------------
    # Bookkeeping

    def _record(self, model_id: str, *, refresh: bool = False) -> _Model:
        rec = self._models.get(model_id)
        if rec is None:
            rec = _Model(model_id, self.store.get(model_id))
            self._models[model_id] = rec
            self.metrics.set_state(model_id, rec.state.value)
        elif refresh and rec.op is None and rec.state is not ModelState.READY:
            rec.model = self.store.get(model_id)
        return rec

    def _set_state(self, rec: _Model, state: ModelState, reason: str | None = None) -> None:
        rec.state, rec.reason = state, reason
        rec.generation += 1
        self.metrics.set_state(rec.id, state.value)

    def _retry_after(self, rec: _Model) -> float:
        return max(1.0, round(rec.last_cold_start or 1.0, 1))
