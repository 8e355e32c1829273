"""Recovery and run-once: a model whose process died is loaded anew, and a request never runs twice.

The process watch (``watch``, a periodic pass the supervisor schedules) looks at the processes of every loaded
python model; a death starts the model's recovery. The activator asks, before it sends a request on
(``admit``) and after Triton answered "stub not healthy" (``after_dead_answer``), what the request's fate was
(``recovery.fate_of``: it ran in a dead process, it never reached one, or that cannot be told).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path

from controlplane.clock import Clock
from controlplane.errors import SnoozeError, UnavailableError
from controlplane.lifecycle.cancel import REPUBLISHED, cancelled_error, cancelled_why
from controlplane.lifecycle.groups import Groups
from controlplane.lifecycle.recovery import ModelProcessDiedError, RequestFate, fate_of, note_deaths, recent_deaths
from controlplane.lifecycle.residency import Residency
from controlplane.lifecycle.state import ModelRecord, ModelState, ModelStates
from controlplane.lifecycle.transitions import Transitions
from controlplane.triton.processes import StubDeath, StubProcess, TritonProcesses

# Where Triton's processes cannot be seen, a dead stub shows only as failing requests: they reach
# recover() just after the first of them reloaded the model, and a model (re)loaded this recently
# is not reloaded again.
RECOVERY_DEDUP_SECS = 2.0

Crashes = tuple[list[StubDeath], tuple[StubProcess, ...] | None]


class RunOnce:
    def __init__(
        self,
        states: ModelStates,
        processes: TritonProcesses,
        transitions: Transitions,
        residency: Residency,
        groups: Groups,
        *,
        wake: Callable[[str], Awaitable[None]],
        journal_dir: Path | None,
        clock: Clock,
    ) -> None:
        """``wake``: the request path's wake of a model (a request whose recovery a republish cancelled waits for
        the new version through it)."""
        self._wake = wake
        self.states = states
        self.processes = processes
        self.transitions = transitions
        self.residency = residency
        self.groups = groups
        self.journal_dir = journal_dir
        self.clock = clock

    # ------------------------------------------------------------------ the activator's questions

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
            and self.clock.time() - rec.load.ready_at >= RECOVERY_DEDUP_SECS
        ):
            self.transitions.recover(rec, "recovering: a request failed")
            raise ModelProcessDiedError(model_id, None)

    async def after_dead_answer(self, model_id: str, request_id: str) -> None:
        """Triton answered the activator's send with "stub not healthy". Returns once the model is
        recovered when the request never reached a live model process (send it again); raises
        ``ModelProcessDiedError`` (recovery goes on) when it did, or when that cannot be told."""
        rec = self.states.record(model_id)
        if steps := self.groups.steps(rec):
            # An ensemble holds no process: a step's died under the request, which ran inside Triton, where what
            # it ran cannot be told. The steps whose processes died are recovered; the request is not sent again.
            for step in steps:
                with contextlib.suppress(SnoozeError):
                    await self._recover_if_dead(self.states.record(step))
            raise ModelProcessDiedError(model_id, None)
        fate, death = await self._fate(rec, request_id)
        if fate is RequestFate.NOT_RUN:
            await self.recover(model_id, "dead_stub")
            return
        if rec.op is None and rec.state is ModelState.READY and not rec.procs.stubs:
            self.transitions.recover(rec, "recovering: a request failed")
        raise ModelProcessDiedError(model_id, death)

    async def _recover_if_dead(self, rec: ModelRecord) -> None:
        """Start the recovery of a loaded model any of whose processes died (not waited for)."""
        if rec.op is None and rec.state is ModelState.READY and rec.procs.stubs:
            deaths = await self.observe(rec)
            if deaths:
                self.start_recovery(rec, deaths)

    async def _fate(self, rec: ModelRecord, request_id: str) -> tuple[RequestFate, StubDeath | None]:
        # The watch may not have passed since the death: look at the model's processes first.
        if rec.procs.stubs and rec.state is ModelState.READY:
            deaths = await self.observe(rec)
            if deaths:
                self.start_recovery(rec, deaths)
        elif (
            rec.procs.stubs
        ):  # in a transition (an unload, a reload): the watch skips it, yet a process may have crashed
            await self.residency.note_crashes(rec, list(rec.procs.stubs))
        return fate_of(rec, request_id, self.clock.monotonic())

    async def recover(self, model_id: str, cause: str) -> None:
        """Reload a model whose python stub died (Triton 2.51 does not restart stubs).

        Where the processes can be seen, a model whose processes are all alive is left alone (someone
        recovered it already); where they cannot, a model (re)loaded in the last seconds is.
        """
        rec = self.states.record(model_id)
        if steps := self.groups.steps(rec):  # an ensemble holds no process: its steps' died
            for step in steps:
                await self.recover(step, cause)
            return
        await self.states.settle(rec)
        op: asyncio.Task[None] | None
        if rec.state is ModelState.READY:
            if rec.procs.stubs:
                deaths = await self.observe(rec)
                if not deaths:
                    return
                op = self.start_recovery(rec, deaths)
            elif self.clock.time() - rec.load.ready_at < RECOVERY_DEDUP_SECS:
                return
            else:
                op = self.transitions.recover(rec, f"recovering: {cause}")
        elif rec.state is ModelState.FAILED:
            op = self.transitions.recover(rec, f"recovering: {cause}")
        else:
            return  # not loaded: the next wake-up loads it fresh
        if op is None:
            return
        try:
            await asyncio.shield(op)
        except asyncio.CancelledError:
            why = cancelled_why(rec, op)
            if not op.cancelled():
                raise  # this caller itself was cancelled
            if why == REPUBLISHED:  # still published: the request goes to the new version, once it is loaded
                await self._wake(model_id)
                return
            if why is None:
                raise UnavailableError(
                    f"model '{model_id}' could not be recovered ({cause}): its recovery was abandoned",
                    hint="retry: the next request loads the model again",
                    retry_after=rec.retry_after,
                ) from None
            raise cancelled_error(rec, op) from None
        except SnoozeError as e:
            raise UnavailableError(
                f"model '{model_id}' could not be recovered ({cause}): {rec.reason}",
                hint=e.hint,
                retry_after=rec.retry_after,
            ) from e

    # ------------------------------------------------------------------ the process watch

    async def watch(self) -> None:
        """One pass over the processes of every loaded python model: a crashed one starts its recovery."""
        watched = [r for r in self.states.loaded() if r.op is None and r.procs.stubs]
        if not watched:
            return
        seen = [(r, r.generation) for r in watched]
        found = await asyncio.to_thread(lambda: [self.crashes(r) for r, _ in seen])
        for (rec, generation), crashes in zip(seen, found, strict=True):
            deaths = self.noted(rec, generation, crashes)
            if deaths and rec.op is None and rec.state is ModelState.READY:
                self.start_recovery(rec, deaths)

    def crashes(self, rec: ModelRecord) -> Crashes:
        """Dead processes of a loaded model, and its live ones when they replace ``rec.procs.stubs``. A stub Triton
        reaped itself was ended on purpose (an instance fewer), unless the model now has fewer processes than
        instances. Runs in a worker thread: it only reads (``noted`` writes, on the event loop)."""
        deaths = self.processes.deaths(rec.procs.stubs)
        crashed = [d for d in deaths if not d.reaped]
        if len(crashed) < len(deaths):
            live = self.processes.stubs(rec.id)
            if len(live) >= rec.instances:
                return crashed, tuple(live)
        return deaths, None

    @staticmethod
    def noted(rec: ModelRecord, generation: int, crashes: Crashes) -> list[StubDeath]:
        """On the event loop: note the live processes ``crashes`` found, unless the model changed meanwhile."""
        deaths, live = crashes
        if live is not None and rec.generation == generation and rec.op is None:
            rec.procs.stubs = live
        return deaths

    async def observe(self, rec: ModelRecord) -> list[StubDeath]:
        generation = rec.generation
        return self.noted(rec, generation, await asyncio.to_thread(self.crashes, rec))

    def start_recovery(self, rec: ModelRecord, deaths: list[StubDeath]) -> asyncio.Task[None] | None:
        """Note the deaths (and the requests they took) and reload the model, unless a transition runs (or the
        lifecycle is paused: it recovers on the next pass after resume)."""
        note_deaths(rec, deaths, self.journal_dir, self.clock)
        if rec.op is not None or rec.state is not ModelState.READY or self.states.pause_ends is not None:
            return rec.op
        what = ", ".join(f"{d.stub.instance or d.stub.pid} {d.describe()}" for d in deaths)
        return self.transitions.recover(rec, f"recovering: process died ({what})")
