"""Cancelling a load in flight: an unload, a delete, a republish or a stop does not wait for it.

Triton 2.51 has no call to cancel a load, and its load call blocks until the model is loaded or failed
(a python model's ``initialize`` without a limit). So a cancel ends the load's model processes (stubs
and their preforked workers, where the control plane can see them: Triton then fails the load at
once), cancels the load's task (its memory reservations and load slot are released on the way out),
asks Triton to unload what may be left, and marks the model UNLOADED. Requests waiting on that load
get a 503 with Retry-After (``Manager.ensure_ready``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from controlplane.errors import SnoozeError
from controlplane.lifecycle.state import ModelRecord, ModelState, ModelStates
from controlplane.lifecycle.workers import end_model_processes
from controlplane.triton.processes import TritonProcesses

log = logging.getLogger("snoozeml.lifecycle")

# How long the cancelled load's task gets to unwind (release its reservations) once cancelled.
CANCEL_WAIT_SECS = 2.0
# How long Triton gets to unload what the cancelled load left (it fails the load once its stubs are gone).
CANCEL_UNLOAD_SECS = 2.0


def load_in_flight(rec: ModelRecord) -> bool:
    return rec.state is ModelState.LOADING and rec.op is not None and not rec.op.done()


async def end_processes(processes: TritonProcesses, journal_dir: Path | None, model_id: str) -> list[int]:
    if not processes.can_observe:
        return []
    stubs = await asyncio.to_thread(processes.stubs, model_id)
    return await asyncio.to_thread(end_model_processes, processes, journal_dir, stubs) if stubs else []


async def cancel_load(
    states: ModelStates, processes: TritonProcesses, journal_dir: Path | None, triton: Any, rec: ModelRecord, why: str
) -> bool:
    """End ``rec``'s load in flight (False: none was); the model is UNLOADED afterwards, holding nothing."""
    if not load_in_flight(rec):
        return False
    op = rec.op
    assert op is not None
    started = time.monotonic()
    rec.load_cancelled = why
    killed = await end_processes(processes, journal_dir, rec.id)
    op.cancel()
    await asyncio.wait({op}, timeout=CANCEL_WAIT_SECS)
    if rec.op is op:  # it did not unwind in time: no longer the model's transition
        rec.op = None
    if rec.op is not None or rec.dropped:  # another caller started a new transition meanwhile: it is its own
        return True
    rec.stubs, rec.workers, rec.reserved, rec.gpu_reserved = (), (), 0, {}
    rec.instances = 0
    states.set_state(rec, ModelState.UNLOADED, f"load cancelled: {why}")
    with contextlib.suppress(SnoozeError, TimeoutError):  # Triton fails the load now that its stubs are gone
        await asyncio.wait_for(triton.unload(rec.id, wait=False), CANCEL_UNLOAD_SECS)
    if rec.op is None:
        killed += await end_processes(processes, journal_dir, rec.id)  # any stub Triton started meanwhile
    log.warning(
        "model '%s': load cancelled (%s) in %.2fs; ended its model processes %s", rec.id, why,
        time.monotonic() - started, killed,
    )
    return True
