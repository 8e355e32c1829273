"""The lifecycle's request path: wake a model for a request (``ensure_ready``, single flight), hold it while the
request runs (``serving``), and run a request at most once (``admit``, ``after_dead_answer``, ``recover``:
what a dead model process means for the requests it had)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from controlplane.errors import SnoozeError, UnavailableError
from controlplane.lifecycle.cancel import REPUBLISHED
from controlplane.lifecycle.loading import LOAD_ABANDON_SECS, WakeQueueTimeout
from controlplane.lifecycle.manager_parts import RECOVERY_DEDUP_SECS, ManagerParts
from controlplane.lifecycle.recovery import ModelProcessDiedError, RequestFate, fate_of, recent_deaths
from controlplane.lifecycle.state import ModelRecord, ModelState
from controlplane.triton.processes import StubDeath

log = logging.getLogger("snoozeml.lifecycle")


class RequestPath(ManagerParts):
    """The request side of ``LifecycleManager``."""

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
            rec.touched = self.clock.time()
            return
        rec = self.states.record(model_id, refresh=True)
        self.warmth.request(rec)
        self.sync.refuse_while_down(rec)
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
        rec.wake_deadline = max(rec.wake_deadline or 0.0, self.clock.monotonic() + queue_bound - loop.time())
        queue_checked = False
        started = self.clock.monotonic()
        self.metrics.wake_waits.labels(model=model_id).inc()
        rec.in_use += 1
        try:
            while rec.state is not ModelState.READY:
                # While paused, a wake-up waits for resume() (within its deadline) instead of loading.
                op = (
                    rec.op
                    or self.states.pause_ends
                    or self._cancel_under_way(rec)
                    or self.states.spawn(rec, ModelState.LOADING, "wake-up", self._cold_load_op(rec, "request"))
                )
                try:
                    until = deadline if queue_checked else queue_bound
                    await asyncio.wait_for(asyncio.shield(op), max(until - loop.time(), 0))
                except TimeoutError:
                    queue_checked = self._wait_bound_passed(rec, wait, queue_checked)
                except asyncio.CancelledError:
                    if not op.cancelled() or self._cancelled_why(rec, op) is None:
                        raise  # this request itself was cancelled
                    self._answer_cancelled(rec, op)
                except WakeQueueTimeout as e:  # the load gave up the queue: the last of its wake-ups' bounds passed
                    self.metrics.wake_queue_timeouts.labels(model=model_id, waiting_for=e.kind).inc()
                    raise UnavailableError(e.message, hint=e.hint, retry_after=e.retry_after) from e
                except SnoozeError as e:
                    if self._cancelled_why(rec, op) is not None:  # it failed because it was cancelled
                        self._answer_cancelled(rec, op, e)
                    elif rec.state is ModelState.FAILED:
                        raise UnavailableError(
                            f"model '{model_id}' is unavailable: {rec.reason}",
                            hint=e.hint or "fix the model and publish it again; the next request retries the load",
                            retry_after=self._retry_after(rec),
                        ) from e
                else:
                    if rec.state is not ModelState.READY:
                        # it loaded, but its cancel came first and takes it out of Triton (cancel.py): as a
                        # cancelled load, not a new load behind it
                        self._answer_cancelled(rec, op)
        finally:
            rec.in_use -= 1
            self.metrics.wake_wait_seconds.labels(model=model_id).observe(self.clock.monotonic() - started)
        rec.touched = self.clock.time()

    def _wait_bound_passed(self, rec: ModelRecord, wait: float, queue_checked: bool) -> bool:
        """A wake-up's wait bound passed: the wake queue's (its load must have started by then; True: wait on up to
        the deadline), else its whole wait (``UnavailableError``)."""
        if not queue_checked:
            if self.loader.queued(rec):
                gave_up = self.loader.gave_up(rec, self.loader.queue[rec.id][1])
                self.metrics.wake_queue_timeouts.labels(model=rec.id, waiting_for=gave_up.kind).inc()
                raise gave_up from None
            return True  # it started in time (or is not a load yet)
        self.metrics.wake_timeouts.labels(model=rec.id).inc()
        raise UnavailableError(
            f"model '{rec.id}' is not ready after {wait:g}s (it is {rec.state.value})",
            hint="retry later; if its load takes longer, raise the model's load_timeout_secs "
            "(or SNOOZE_WAKE_TIMEOUT_SECS)",
            retry_after=self._retry_after(rec),
        ) from None

    def _answer_cancelled(self, rec: ModelRecord, load: asyncio.Task[Any], cause: BaseException | None = None) -> None:
        """A wake-up's load was cancelled (cancel.py): raise what it is told, unless a republish cancelled it (the
        model is still published: the wake-up waits on for the new version, within its own bound)."""
        why = self._cancelled_why(rec, load)
        if why is not None and why != REPUBLISHED:
            raise self._cancelled_error(rec, load) from cause

    @staticmethod
    def _cancel_under_way(rec: ModelRecord) -> asyncio.Future[None] | None:
        """While a cancel of the model's load leaves Triton (cancel.py), what a wake-up waits for before it loads."""
        cancelled = rec.load_cancelled
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
            rec.touched = self.clock.time()
            self.warmth.served(rec, rec.touched)

    async def admit(self, model_id: str, request_id: str) -> None:
        """Before the activator sends a request on: refuse one that already reached a model process
        that died (``ModelProcessDiedError``), so that no request runs twice.

        Where Triton's processes cannot be seen, a request for a model Triton has loaded can only have
        come here because Triton failed it, and it may have run: it is refused too.
        """
        rec = self.states.record(model_id)
        fate, death = await self._fate(rec, request_id)
        if fate is RequestFate.RAN or (fate is RequestFate.UNKNOWN and recent_deaths(rec, self.clock.monotonic())):
            raise ModelProcessDiedError(model_id, death)  # unknown: a process died without a journal
        if (
            not self.processes.can_observe
            and rec.state is ModelState.READY
            and rec.op is None
            and self.clock.time() - rec.ready_at >= RECOVERY_DEDUP_SECS
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
        elif rec.stubs:  # in a transition (an unload, a reload): the watch skips it, yet a process may have crashed
            await self.loader.note_crashes(rec, list(rec.stubs))
        return fate_of(rec, request_id, self.clock.monotonic())

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
            elif self.clock.time() - rec.ready_at < RECOVERY_DEDUP_SECS:
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
