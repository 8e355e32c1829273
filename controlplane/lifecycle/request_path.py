"""The lifecycle's request path: wake a model for a request (``ensure_ready``, single flight, through the wake queue)
and hold it while the request runs (``serving``). Whether a request may run at all is ``run_once``'s."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from controlplane.clock import Clock
from controlplane.errors import SnoozeError, UnavailableError
from controlplane.lifecycle.admission import Admission, WakeQueueTimeout
from controlplane.lifecycle.cancel import REPUBLISHED, cancelled_error, cancelled_why
from controlplane.lifecycle.groups import Groups, StepsChanged
from controlplane.lifecycle.loading import LOAD_ABANDON_SECS
from controlplane.lifecycle.state import ModelRecord, ModelState, ModelStates
from controlplane.lifecycle.transitions import Transitions
from controlplane.lifecycle.triton_sync import TritonUp
from controlplane.lifecycle.warmth import Warmth
from controlplane.metrics import SnoozeMetrics
from controlplane.settings import Settings

log = logging.getLogger("snoozeml.lifecycle")


class RequestPath:
    def __init__(
        self,
        settings: Settings,
        states: ModelStates,
        warmth: Warmth,
        up: TritonUp,
        admission: Admission,
        transitions: Transitions,
        metrics: SnoozeMetrics,
        groups: Groups,
        *,
        asked_by: Callable[[ModelRecord, tuple[int, int] | None], None],
        clock: Clock,
    ) -> None:
        self.asked_by = asked_by  # ``Dozing.asked_by``: a stub's ask for room recorded on its model
        self.settings = settings
        self.groups = groups
        self.states = states
        self.warmth = warmth
        self.up = up
        self.admission = admission
        self.transitions = transitions
        self.metrics = metrics
        self.clock = clock

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
            rec.access.touched = self.clock.time()
            return
        rec = self.states.record(model_id, refresh=True)
        self.warmth.request(rec)
        self.up.refuse_while_down(rec)
        # An ensemble: its steps first, each through its own single flight, held from their wake on (a step woken
        # first is not idle-unloaded while the others load) until the ensemble's own pin holds them.
        await self.groups.steps_first(
            rec, lambda step: self.wake_step(step, timeout=timeout), lambda steps: self._wake(rec, timeout, steps)
        )

    async def wake_step(self, step: str, *, timeout: float | None = None) -> None:
        """An ensemble's step, woken for it (``Groups.steps_first``): ``ensure_ready``, and a step that dozes has
        the wake that the ensemble's request will bring admitted now (``Admission.wake_room``). That
        request wakes every dozing step inside Triton at once, where no one admits them (dozing machine seed
        1139189736: two steps woke together, 510 MiB against a budget of 300)."""
        await self.ensure_ready(step, timeout=timeout)
        rec = self.states.get(step)
        if rec is not None and rec.doze.dozing and not rec.doze.wake_admitted:
            rec.doze.wake_admitted = True
            await self.admission.wake_room(rec)

    async def admit_doze_wake(self, model_id: str, stub: tuple[int, int] | None, *, timeout: float) -> dict[str, Any]:
        """A dozing stub about to fork its worker for a request on the warm path asks room for the wake
        (``python_backend/doze.py``, through the wake route): from now until the wake is heard (or its bound passes,
        ``Dozing.hear``) the model counts what it held awake, and idle models are evicted for it first, one wake at a
        time, waiting for memory held by models in use at most ``timeout`` seconds (and the wake queue's bound,
        ``wake_queue_timeout_secs``). Without it, requests straight to several dozing models within one sweep
        interval woke them all beside a full budget (dozing machine seed 2526912484: three wakes, 630 MiB against 300
        plus one model of 300). Never refused: the answer says what was done (``admitted``: room was made or was
        there), and the wake goes ahead either way."""
        rec = self.states.get(model_id)
        if rec is None or rec.state is not ModelState.READY or rec.op is not None:
            self.metrics.doze_wake_rooms.labels(model=model_id, outcome="unasked").inc()
            return {"admitted": False, "why": None}  # in a transition (or unknown here): counted as it is
        timeout = min(timeout, self.settings.wake_queue_timeout_secs)  # as long as a wake from unloaded would wait
        # a record that does not know the stub dozes (an adoption not yet asked, a state change reset it) learns it:
        # room is made for what the model holds awake, which the tree is about to hold (dozing machine seed
        # 3108582327: a failed rescale's record, 360 MiB of 300 once a burst woke it; seed 4214762718: adopted)
        self.asked_by(rec, stub)
        rec.access.woke = self.clock.time()  # a request runs: idle from now at the earliest
        rec.in_use += 1  # not evicted while its room is made
        try:
            async with asyncio.timeout(timeout):
                why = await self.admission.wake_room(rec, until=self.clock.monotonic() + timeout)
        except TimeoutError:
            why = f"no room was made within {timeout:g} s"
            log.info("model '%s': its wake from doze goes ahead: %s", model_id, why)
        finally:
            rec.in_use -= 1
        self.metrics.doze_wake_rooms.labels(model=model_id, outcome="room" if why is None else "over_budget").inc()
        return {"admitted": why is None, "why": why}

    async def _wake(self, rec: ModelRecord, timeout: float | None, steps: tuple[str, ...]) -> None:
        """``ensure_ready``'s wait for the model's own load (a wake-up in the wake queue), whose steps (an
        ensemble's) are loaded: ``StepsChanged`` when a republish gives it others before its load starts."""
        model_id = rec.id
        wait = (
            timeout
            if timeout is not None
            else (self.settings.wake_timeout_secs or rec.model.load_timeout_secs + LOAD_ABANDON_SECS)
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        # the wake queue: its load must start by then, else this request is answered 503 at once
        queue_bound = min(loop.time() + self.settings.wake_queue_timeout_secs, deadline)
        # the wake queue's deadlines are the clock's monotonic seconds: the bound moves over from the loop's
        rec.load.wake_deadline = max(rec.load.wake_deadline or 0.0, self.clock.monotonic() + queue_bound - loop.time())
        queue_checked = False
        started = self.clock.monotonic()
        self.metrics.wake_waits.labels(model=model_id).inc()
        rec.in_use += 1
        try:
            while not rec.ready:
                if self.groups.steps(rec) != steps:
                    raise StepsChanged
                op = self._waits_on(rec, steps)
                try:
                    until = deadline if queue_checked else queue_bound
                    await asyncio.wait_for(asyncio.shield(op), max(until - loop.time(), 0))
                except TimeoutError:
                    queue_checked = self._wait_bound_passed(rec, wait, queue_checked)
                except asyncio.CancelledError:
                    if not op.cancelled() or cancelled_why(rec, op) is None:
                        raise  # this request itself was cancelled
                    self._answer_cancelled(rec, op)
                except WakeQueueTimeout as e:  # the load gave up the queue: the last of its wake-ups' bounds passed
                    self.metrics.wake_queue_timeouts.labels(model=model_id, waiting_for=e.kind).inc()
                    raise UnavailableError(e.message, hint=e.hint, retry_after=e.retry_after) from e
                except SnoozeError as e:
                    if cancelled_why(rec, op) is not None:  # it failed because it was cancelled
                        self._answer_cancelled(rec, op, e)
                    elif rec.state is ModelState.FAILED:
                        raise UnavailableError(
                            f"model '{model_id}' is unavailable: {rec.reason}",
                            hint=e.hint or "fix the model and publish it again; the next request retries the load",
                            retry_after=rec.retry_after,
                        ) from e
                else:
                    if not rec.ready:
                        # it loaded, but its cancel came first and takes it out of Triton (cancel.py): as a
                        # cancelled load, not a new load behind it
                        self._answer_cancelled(rec, op)
                if op.done() and not rec.ready:
                    # It ended without readying the model (a republish cancelled it: the wake-up waits on for the new
                    # version) and stays rec.op until its done callback runs. A wait on a done task does not yield,
                    # nor does one of 0 s once the bound has passed: without this the loop spun and held the event
                    # loop (SNOOZE_MACHINE_SEED=3474267667). So yield, and past the bound answer as a timeout.
                    if loop.time() >= deadline:
                        self._wait_bound_passed(rec, wait, True)
                    await asyncio.sleep(0)
        finally:
            rec.in_use -= 1
            self.metrics.wake_wait_seconds.labels(model=model_id).observe(self.clock.monotonic() - started)
        rec.access.touched = self.clock.time()

    def _waits_on(self, rec: ModelRecord, steps: tuple[str, ...]) -> asyncio.Future[Any]:
        """What a wake-up waits for: the model's transition, resume() while paused (within its deadline), a cancel
        leaving Triton, else a load of its own, which an ensemble starts only over its steps still loaded."""
        op = rec.op or self.states.pause_ends or self._cancel_under_way(rec)
        if op is not None:
            return op
        self.groups.still_woken(rec, steps)
        return self.transitions.cold_load(rec, trigger="request", reason="wake-up")

    def _wait_bound_passed(self, rec: ModelRecord, wait: float, queue_checked: bool) -> bool:
        """A wake-up's wait bound passed: the wake queue's (its load must have started by then; True: wait on up to
        the deadline), else its whole wait (``UnavailableError``)."""
        if not queue_checked:
            if self.admission.queued(rec):
                gave_up = self.admission.gave_up(rec, self.admission.queue[rec.id][1])
                self.metrics.wake_queue_timeouts.labels(model=rec.id, waiting_for=gave_up.kind).inc()
                raise gave_up from None
            return True  # it started in time (or is not a load yet)
        self.metrics.wake_timeouts.labels(model=rec.id).inc()
        raise UnavailableError(
            f"model '{rec.id}' is not ready after {wait:g}s (it is {rec.state.value})",
            hint="retry later; if its load takes longer, raise the model's load_timeout_secs "
            "(or SNOOZE_WAKE_TIMEOUT_SECS)",
            retry_after=rec.retry_after,
        ) from None

    def _answer_cancelled(
        self, rec: ModelRecord, load: asyncio.Future[Any], cause: BaseException | None = None
    ) -> None:
        """A wake-up's load was cancelled (cancel.py): raise what it is told, unless a republish cancelled it (the
        model is still published: the wake-up waits on for the new version, within its own bound)."""
        why = cancelled_why(rec, load)
        if why is not None and why != REPUBLISHED:
            raise cancelled_error(rec, load) from cause

    @staticmethod
    def _cancel_under_way(rec: ModelRecord) -> asyncio.Future[None] | None:
        """While a cancel of the model's load leaves Triton (cancel.py), what a wake-up waits for before it loads."""
        cancelled = rec.load.cancelled
        return cancelled.over if cancelled is not None and not cancelled.over.done() else None

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
        rec.in_use += 1
        try:
            await self.ensure_ready(model_id, timeout=timeout)
            yield
        finally:
            rec.in_use -= 1
            rec.access.touched = self.clock.time()
            self.warmth.served(rec, rec.access.touched)
