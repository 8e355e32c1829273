"""When a model process dies: which requests it took with it, and what the client is told.

Triton 2.51 does not restart a dead python-backend stub: the model stays READY and every request
sent to that instance fails with "Stub process '<instance>' is not healthy." after about a second
(measured). The lifecycle watches the stubs of every loaded model (``processes.TritonProcesses``),
and when one dies it takes the model out of service (Triton answers 404 from then on, which the
gateway sends to the activator, which waits) and loads it again.

A request that failed on the dead stub reaches the activator by the gateway's retry. The journal
(``journal.py``) says whether it was in the batch the process was running when it died: then it ran
(or was running) and is never sent again: its client gets a ``ModelProcessDiedError``. Otherwise it
never reached a live model process and is sent again after recovery, so the client sees only a
slower answer. Where that cannot be told (Triton's processes or journals cannot be seen), the request
is not sent again either: at most once, always.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path

from controlplane.clock import Clock
from controlplane.errors import SnoozeError
from controlplane.lifecycle.state import ModelRecord, SeenDeath
from controlplane.lifecycle.workers import kill_workers, worker_of
from controlplane.triton.journal import has_journal, read_activity, read_journal, remove_journal
from controlplane.triton.processes import StubDeath, StubProcess, TritonProcesses

log = logging.getLogger("snoozeml.lifecycle")

# Request ids of dead processes kept per model, for retried requests that arrive late.
CRASHED_REQUESTS_KEPT = 4096
DEATHS_KEPT = 32
# A failed request reaches the activator about a second after the death (Triton's own wait); one
# that comes much later is not attributed to a death at all.
RECENT_DEATH_SECS = 120.0


class RequestFate(StrEnum):
    RAN = "ran"  # it was in the batch of a model process that died: never run it again
    NOT_RUN = "not_run"  # it never reached a live model process: safe to send after recovery
    UNKNOWN = "unknown"  # cannot be told (processes or journals not visible): do not send again


class ModelProcessDiedError(SnoozeError):
    """A request ran in a model process that died under it; it is not retried."""

    status_code = 500
    code = "model_process_died"

    def __init__(self, model_id: str, death: StubDeath | None) -> None:
        if death is not None and death.worker is not None:
            what = (
                f"model '{model_id}': its preforked worker process (pid {death.worker.pid}, instance "
                f"{death.stub.instance or '?'}) died while running this request ({death.worker.describe()})"
            )
        elif death is not None:
            what = (
                f"model '{model_id}': its process (instance {death.stub.instance or '?'}, pid {death.stub.pid}) "
                f"died while running this request ({death.describe()})"
            )
        else:
            what = f"model '{model_id}': its process died while this request was in flight (it may have run)"
        super().__init__(
            f"{what}; the request was not retried, because it may have had effects or may crash the model "
            "again; the model is being restarted",
            hint="look at the model's log for the crash; send the request again only if running it twice is safe",
        )
        self.model_id = model_id
        self.death = death


def note_deaths(rec: ModelRecord, deaths: list[StubDeath], journal_dir: Path | None, clock: Clock) -> list[StubDeath]:
    """Record newly seen deaths of the model's processes and the requests each was running; the new ones."""
    known = {seen.death.stub for seen in rec.procs.deaths}
    new = [d for d in deaths if d.stub not in known]
    for i, death in enumerate(new):
        worker = worker_of(journal_dir, death.stub)
        if worker is not None:
            kill_workers([worker])  # its parent does too; a parent that is gone cannot
            new[i] = death = dataclasses.replace(death, worker=worker)
        ids = read_journal(journal_dir, death.stub) if journal_dir is not None else None
        if ids is not None and worker is not None and worker.ran is False:
            # its worker died before taking the batch: whatever the stub journaled meanwhile never ran
            ids = set()
        rec.procs.deaths.append(SeenDeath(death, clock.monotonic(), journaled=ids is not None))
        seen_at = time.strftime("%H:%M:%S", time.localtime(clock.time()))
        rec.procs.last_crash = f"{death.stub.instance or death.stub.pid}: {death.describe()} at {seen_at}"
        for request_id in ids or ():
            rec.procs.crashed_requests[request_id] = death
        if journal_dir is not None:
            remove_journal(journal_dir, death.stub)
        log.warning(
            "model '%s': process %s (pid %d) died (%s)%s",
            rec.id,
            death.stub.instance,
            death.stub.pid,
            death.describe(),
            f" while running {len(ids)} request(s)" if ids else "",
        )
    del rec.procs.deaths[:-DEATHS_KEPT]
    while len(rec.procs.crashed_requests) > CRASHED_REQUESTS_KEPT:
        rec.procs.crashed_requests.pop(next(iter(rec.procs.crashed_requests)))
    return new


def running_requests(journal_dir: Path, stub: StubProcess) -> set[str] | None:
    """The requests the stub's journal says it was running (busy): empty when it was between batches; None when it
    kept no journal (it had not started, or it was removed)."""
    activity = read_activity(journal_dir, stub)
    if activity is None:
        return None
    return (read_journal(journal_dir, stub) or set()) if activity.busy else set()


def note_ended(rec: ModelRecord, journaled: dict[StubProcess, set[str]], clock: Clock) -> None:
    """Stubs this control plane ended (a cancel ends every process of the model, one of an earlier load still
    finishing a request included), each with the requests its journal says it was running: those ran, and are never
    sent again; a request that met an ended stub and is not among them never ran (the journal was read). Plain
    machine seed 1852401186: a recovery's load, cancelled by a republish, ended the crashed load's surviving stub
    during a request; its "not healthy" answer looked like a request that never ran, and it ran again."""
    for stub, ids in journaled.items():
        death = StubDeath(stub, None, ended=True)
        rec.procs.deaths.append(SeenDeath(death, clock.monotonic(), journaled=True))
        for request_id in ids:
            rec.procs.crashed_requests[request_id] = death
    del rec.procs.deaths[:-DEATHS_KEPT]
    while len(rec.procs.crashed_requests) > CRASHED_REQUESTS_KEPT:
        rec.procs.crashed_requests.pop(next(iter(rec.procs.crashed_requests)))


def crashes_among(
    processes: TritonProcesses, journal_dir: Path | None, stubs: Iterable[StubProcess]
) -> list[StubDeath]:
    """The deaths among ``stubs`` that were crashes, not ends: for the processes a record lets go of (an unload, a
    reload, a cancel), so that a crash under a transition is noted before they are forgotten and a request it took
    is never sent again. Blocking.

    A death this control plane caused (``StubDeath.ended``) is no crash. With a journal folder, a stub keeps its
    journal from its start until a clean end (the runtime removes it then): a dead stub whose journal is still there
    crashed, one whose journal is gone ended (an instance fewer, a reload's old instance: Triton may not have reaped
    it yet). Without one, a zombie is the crash (Triton reaps only what it ends)."""
    crashed = []
    for death in processes.deaths(stubs):
        if death.ended:
            continue
        if has_journal(journal_dir, death.stub) if journal_dir is not None else not death.reaped:
            crashed.append(death)
    return crashed


def fate_of(rec: ModelRecord, request_id: str, now: float) -> tuple[RequestFate, StubDeath | None]:
    """What happened to request ``request_id``, which failed on a dead process of the model (or was
    retried to the activator for another reason).

    RAN when a dead process's journal holds it. NOT_RUN when the model's processes died recently (before
    ``now``, monotonic seconds) and every one of those deaths left a journal that does not hold it. UNKNOWN
    otherwise.
    """
    if request_id and request_id in rec.procs.crashed_requests:
        return RequestFate.RAN, rec.procs.crashed_requests[request_id]
    recent = recent_deaths(rec, now)
    if request_id and recent and all(seen.journaled for seen in recent):
        return RequestFate.NOT_RUN, None
    return RequestFate.UNKNOWN, None


def recent_deaths(rec: ModelRecord, now: float) -> list[SeenDeath]:
    """The deaths seen within ``RECENT_DEATH_SECS`` before ``now`` (monotonic seconds, the deaths' clock)."""
    return [seen for seen in rec.procs.deaths if now - seen.at < RECENT_DEATH_SECS]
