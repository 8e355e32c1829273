"""Cancelling a load in flight: an unload, a delete, a republish or a stop does not wait for it.

Triton 2.51 has no call to cancel a load, and its load call blocks until the model is loaded or failed
(a python model's ``initialize`` without a limit). So a cancel ends the load's model processes (stubs and
their preforked workers, as the load timeout does): Triton then fails the load at once, the load's task
ends with that failure (its memory reservations and load slot released on the way out), and the model is
marked UNLOADED. Only stubs that reached the model's initialize are ended (their phase note): Triton waits for
a new stub's first message with no time limit, so one killed while it starts would leave the load, and every
later load and unload of that Triton, waiting for ever; a starting stub is waited for (``STUB_START_SECS``).
A load still queued (waiting for a slot or for memory: nothing in Triton yet), or one
whose processes cannot be seen (a remote Triton), has its task cancelled instead, and Triton is asked to
unload what it may have. Requests that waited on that load get a 503 with Retry-After, or a 404 for a
delete (``cancelled_error``); after a republish they wait for the new version instead (the model is
still published), and so does any wake-up that comes while the cancel is under way: none starts a load before
the cancelled one has left Triton.
A load may also end well while the cancel waits for a starting stub: the model is then READY in Triton, where
the gateway's warm path would serve it (the old version, after a republish), so it is unloaded in a transition
of its own (UNLOADING, waited for) before the model is marked UNLOADED; its waiters are answered as for a
cancelled load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.clock import Clock
from controlplane.errors import NotFoundError, SnoozeError, UnavailableError
from controlplane.lifecycle.admission import Admission
from controlplane.lifecycle.recovery import note_ended, running_requests
from controlplane.lifecycle.state import CancelledLoad, ModelRecord, ModelState, ModelStates
from controlplane.lifecycle.workers import end_model_processes, none_alive
from controlplane.tasks import read_task
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.journal import initialize_started
from controlplane.triton.processes import StubProcess, TritonProcesses

if TYPE_CHECKING:
    from controlplane.lifecycle.transitions import Transitions

log = logging.getLogger("snoozeml.lifecycle")

# Why a republish cancels a load: its waiters are not answered with the cancel but wait for the new version.
REPUBLISHED = "republished"
# Why a stop cancels a load or a loaded model's reload: its waiters are answered 503 (retry once it is back).
STOPPING = "stopping"
# How long the load gets to fail once its processes are killed (Triton notices a dead stub in milliseconds).
CANCEL_WAIT_SECS = 2.0
# How often its processes are looked for meanwhile (Triton may be starting a stub as the cancel comes).
CANCEL_POLL_SECS = 0.1
# How long Triton gets to drop a load whose task was cancelled (its index no longer LOADING).
CANCEL_UNLOAD_SECS = 2.0
# How long a cancel waits for a stub Triton is starting to reach the model's initialize before it ends it
# anyway (a stub starts in well under a second here; killed before that, Triton's load never ends).
STUB_START_SECS = 10.0


def load_in_flight(rec: ModelRecord) -> bool:
    return rec.state is ModelState.LOADING and rec.op is not None and not rec.op.done()


async def end_processes(
    processes: TritonProcesses,
    journal_dir: Path | None,
    rec: ModelRecord,
    clock: Clock,
    *,
    waited: float = STUB_START_SECS,
) -> tuple[list[int], int]:
    """End the model's stubs that have reached its initialize (and any, once ``waited`` reaches
    STUB_START_SECS); (the pids ended, how many stubs were left because they are still starting). The requests
    an ended stub was running are noted as run (``note_ended``): one of an earlier load may be finishing one."""
    if not processes.can_observe:
        return [], 0
    stubs = await asyncio.to_thread(processes.stubs, rec.id)
    if journal_dir is not None and waited < STUB_START_SECS:
        starting = [s for s in stubs if not initialize_started(journal_dir, s)]
        stubs = [s for s in stubs if s not in starting]
    else:
        starting = []
    if not stubs:
        return [], len(starting)

    def end() -> tuple[list[int], dict[StubProcess, set[str]]]:
        killed = end_model_processes(processes, journal_dir, stubs)
        if journal_dir is None:
            return killed, {}
        # read after the kill: a killed stub journals nothing more, and its journal stays until it is removed
        running = {s: running_requests(journal_dir, s) for s in stubs}
        return killed, {s: ids for s, ids in running.items() if ids is not None}  # no journal: nothing is known

    killed, journaled = await asyncio.to_thread(end)
    note_ended(rec, journaled, clock)
    return killed, len(starting)


class LoadCancels:
    """Cancels loads in flight (an unload, a delete, a republish, a stop)."""

    def __init__(
        self,
        states: ModelStates,
        processes: TritonProcesses,
        triton: TritonAdminClient,
        transitions: Transitions,
        admission: Admission,
        *,
        journal_dir: Path | None,
        clock: Clock,
    ) -> None:
        self.states = states
        self.processes = processes
        self.triton = triton
        self.transitions = transitions
        self.admission = admission
        self.journal_dir = journal_dir
        self.clock = clock

    async def cancel_all(self, why: str) -> list[str]:
        """Cancel every load in flight (a stop); the models whose load was cancelled."""
        records = list(self.states.values())
        done = await asyncio.gather(*(self.cancel(rec, why) for rec in records))
        return [rec.id for rec, cancelled in zip(records, done, strict=True) if cancelled]

    async def cancel(self, rec: ModelRecord, why: str) -> bool:
        """End ``rec``'s load in flight (False: none was); the model is UNLOADED afterwards, holding nothing,
        unless another caller started a new transition on it meanwhile. Until it returns,
        ``rec.load.cancelled.over`` is pending: a wake-up waits for it rather than start a load that what is left of
        the cancelled one would meet in Triton."""
        if not load_in_flight(rec):
            return False
        op = rec.op
        assert op is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        under_way = rec.load.cancelled
        if under_way is not None and under_way.task is op and not under_way.over.done():
            await asyncio.shield(under_way.over)  # another caller is cancelling it already (a stop during an unload)
            return True
        cancelling = rec.load.cancelled = CancelledLoad(op, why, loop.create_future())
        rec.load.cancel_reasons[op] = why
        try:
            killed = await self._cancel(rec, op, why, queued=self.admission.queued(rec))
        finally:
            cancelling.over.set_result(None)
        log.warning(
            "model '%s': load cancelled (%s) in %.2fs; ended its model processes %s",
            rec.id,
            why,
            loop.time() - started,
            killed,
        )
        return True

    async def _cancel(self, rec: ModelRecord, op: asyncio.Task[Any], why: str, *, queued: bool) -> list[int]:
        """``queued``: the load has not started (it waits for a slot or for memory: nothing in Triton yet)."""
        processes, journal_dir, triton = self.processes, self.journal_dir, self.triton
        loop = asyncio.get_running_loop()
        started = loop.time()
        killed: list[int] = []
        if queued or not processes.can_observe:
            op.cancel()
        deadline = started + CANCEL_WAIT_SECS
        while not op.done():
            ended, starting = await end_processes(processes, journal_dir, rec, self.clock, waited=loop.time() - started)
            killed += ended
            if loop.time() >= (started + STUB_START_SECS if starting else deadline):
                break
            await asyncio.wait({op}, timeout=CANCEL_POLL_SECS)
        cancelled = not op.done() or op.cancelled()
        # The load ended as it was cancelled, and well (its stub was still starting, so it was waited for, not
        # ended): the model is READY in Triton, where the gateway's warm path would serve it (after a republish,
        # the old version), so it is unloaded as a cancelled load's leftovers are.
        loaded = op.done() and not op.cancelled() and op.exception() is None
        if not op.done():  # it did not fail in time: no longer the model's transition
            op.cancel()
            await asyncio.wait({op}, timeout=CANCEL_WAIT_SECS)
        if rec.op is op:
            rec.op = None
        leftovers = (cancelled and not queued) or loaded  # Triton may still be loading what it left, or hold it
        if leftovers and rec.op is None and not rec.dropped:
            # A transition of its own: out of service (UNLOADING) while it leaves Triton, so no request takes it
            # for READY and no load starts meanwhile (Triton would meet the leftovers); it ends UNLOADED. A request
            # that waited on the load gets its answer (request_path); a later one waits for this, then loads anew.
            leave = self._leave_and_mark(rec, why, started=started, wait=loaded)
            return killed + await asyncio.shield(self.transitions.leave_after_cancel(rec, why, leave))
        if cancelled and not queued:  # another transition owns the record now: only Triton's side is left
            killed += await _leave_triton(processes, journal_dir, triton, rec, self.clock, started=started, wait=False)
        left_nothing = await _left_nothing(processes, rec)
        if rec.op is None and not rec.dropped:  # else another caller started a new transition: it is its own
            _mark_unloaded(self.states, rec, why, left_nothing=left_nothing)
        return killed

    async def _leave_and_mark(self, rec: ModelRecord, why: str, *, started: float, wait: bool) -> list[int]:
        """The cancel's own transition: leave Triton, then mark the record UNLOADED before the transition ends."""
        killed = await _leave_triton(
            self.processes, self.journal_dir, self.triton, rec, self.clock, started=started, wait=wait
        )
        _mark_unloaded(self.states, rec, why, left_nothing=await _left_nothing(self.processes, rec))
        return killed


def cancelled_why(rec: ModelRecord, load: asyncio.Future[Any]) -> str | None:
    """Why ``load`` was cancelled (cancel.py ended it), or None: it was not, or something else cancelled it."""
    return rec.load.cancel_reasons.get(load)


def cancelled_error(rec: ModelRecord, load: asyncio.Future[Any]) -> SnoozeError:
    """What a request (or an API load) that waited on a cancelled load is answered."""
    why = cancelled_why(rec, load)
    if why == "deleted":  # as for any model that is not published
        return NotFoundError(f"model '{rec.id}' was deleted during its load", hint="publish it again to serve it")
    return UnavailableError(
        f"model '{rec.id}' is not loaded: its load was cancelled ({why})",
        hint="retry: the next request loads the model again if it is still published",
        retry_after=rec.retry_after,
    )


async def _left_nothing(processes: TritonProcesses, rec: ModelRecord) -> bool:
    """Counted for an earlier unload Triton may not have finished (a crash's recovery unloads the dead instances
    without waiting, then loads), yet a python model none of whose processes live holds nothing (as triton_sync
    judges one it finds unloading): its budget goes now rather than at the next sweep."""
    return rec.memory.triton_may_hold and rec.is_python and await asyncio.to_thread(none_alive, processes, rec.id)


def _mark_unloaded(states: ModelStates, rec: ModelRecord, why: str, *, left_nothing: bool) -> None:
    """The record holds nothing: UNLOADED, with reason ``load cancelled: <why>``."""
    rec.procs.stubs, rec.procs.workers, rec.memory.reserved, rec.memory.gpu_reserved, rec.instances = (), (), 0, {}, 0
    if left_nothing:
        rec.memory.triton_may_hold = False
    states.set_state(rec, ModelState.UNLOADED, f"load cancelled: {why}")


async def _leave_triton(
    processes: TritonProcesses,
    journal_dir: Path | None,
    triton: TritonAdminClient,
    rec: ModelRecord,
    clock: Clock,
    *,
    started: float,
    wait: bool,
) -> list[int]:
    """Drop the model from Triton (bounded) and end what is left of its processes; the pids ended."""
    with contextlib.suppress(SnoozeError, TimeoutError):
        await asyncio.wait_for(read_task(_drop(triton, rec.id, wait=wait)), CANCEL_UNLOAD_SECS)
    waited = asyncio.get_running_loop().time() - started
    return (await end_processes(processes, journal_dir, rec, clock, waited=waited))[0]


async def _drop(triton: TritonAdminClient, model_id: str, *, wait: bool = False) -> None:
    """Wait until Triton no longer loads the model, then unload whatever it kept (with ``wait``: until it is
    gone from Triton's index as READY, so no request meets it after the cancel)."""
    while any(e.name == model_id and e.state == "LOADING" for e in await triton.repository_index()):
        await asyncio.sleep(CANCEL_POLL_SECS)
    await triton.unload(model_id, wait=wait)
