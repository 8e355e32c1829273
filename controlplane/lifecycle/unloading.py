"""Unloading a model so that its memory is free in milliseconds: end its processes once Triton has let go.

Why an unload takes over a second (python_backend r24.10, ``python_be.cc`` / ``stub_launcher.cc``): when
Triton destroys a python model's instance it first probes the stub's health: it clears a flag in shared
memory, sleeps one second (``sleep(1)``) and reads it back; the stub's heartbeat thread sets it every
300 ms. A healthy stub is then sent the finalize command (the model's ``finalize()``, which runs the
user's ``unload()``) and waited for; an unhealthy one is SIGKILLed and reaped. Triton marks the model
unavailable about 3 ms after the unload call, but its stub, and so its memory, leaves 1.1-1.3 s later.

What ending it early does (measured on tritonserver 2.51, a hand-written model holding 40 MiB):

- A stub killed before the heartbeat that follows Triton's health reset: Triton finds it unhealthy after
  its 1 s sleep, reaps it and finishes the unload (index: UNAVAILABLE), logging nothing. A reload of the
  same model right after the kill, while Triton still sleeps, loads and answers correctly.
- A stub killed after such a heartbeat: Triton sends it the finalize command and waits for an answer
  that never comes. Its unload thread blocks for good (the model stays UNLOADING in the index, the
  zombie is never reaped, three threads leak); a reload still works. Killing 20 ms after the unload
  call hit this 1 time in 8, 150 ms after it 3 times in 8.
- So the stub is stopped (SIGSTOP) *before* the unload call: a frozen stub sets no heartbeat, so
  whenever Triton's probe runs, the stub is found unhealthy (16 of 16 clean at 0 and 150 ms).

Order, for each unload (``unload``):

1. Stop the model's stubs; each must be at rest: every thread waiting in a system call that waits
   (``TritonProcesses.at_rest``: a thread stopped in the stub's own code may hold a robust mutex it shares
   with tritonserver, whose next lock of it then throws in the instance's destructor and aborts
   tritonserver, seen once in about 370 evictions), and its journal trailer (``journal.read_activity``)
   shows no batch running and none that ended less than ``SETTLE_SECS`` ago (its stub may still be handing
   the results to Triton). Else they go on (SIGCONT) and the check is tried again a little later; threads
   that cannot be read, no journal, or a model that declares ``unload()`` mean Triton's own unload.
2. Unload in Triton (it answers 404 to new requests from now on; the gateway sends those to the
   activator, which waits for this transition).
3. Requests still queued in Triton for the model (its pending count): the stubs go on and Triton's own
   unload runs them, as before.
4. Otherwise SIGKILL the stubs (and their preforked workers): nothing of the model runs, and nothing can
   start, so no request fails for it. One corner remains: a batch Triton handed to a stub after step 1
   found it idle (a request that reached Triton directly in those milliseconds) never ran; Triton fails
   it with its dead-stub answer about a second later, which the gateway retries to the activator; the
   journal does not hold it, so the activator sends it after a wake (it runs once).

A killed stub is not a crash: the process watch looks only at READY models, and the model is UNLOADING
until its processes are gone and then UNLOADED with no processes on record. Its journal is removed.

A model that declares ``unload()`` keeps Triton's full unload so that its clean-up runs: its processes
get ``unload_finalize_secs`` past Triton's 1 s probe to exit, then they are ended. That end is clean: the
stub answers the finalize command before it runs ``finalize()``, so Triton is only waiting for the process
(``waitpid``, no limit: a hanging ``unload()`` blocks Triton's unload for good otherwise); killed 1.5 s into a
3 s ``finalize()``, it was reaped at once, the index said UNAVAILABLE and a reload answered (3 of 3,
``python -m bench.stub_unload kill1500 3 3.0``). Where Triton's processes or journals cannot be seen (a
remote Triton), every unload is Triton's own, waited for through the index.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

from controlplane.clock import SYSTEM_CLOCK, Clock
from controlplane.errors import SnoozeError, TritonError
from controlplane.lifecycle.state import ModelRecord
from controlplane.lifecycle.workers import end_model_processes
from controlplane.metrics import SnoozeMetrics
from controlplane.settings import Settings
from controlplane.triton.client import TritonAdminClient, wait_unloaded
from controlplane.triton.journal import read_activity, remove_journal
from controlplane.triton.processes import StubProcess, TritonProcesses

log = logging.getLogger("snoozeml.lifecycle")

# A batch that ended this recently may still be on its way to Triton (the stub copies the results out
# after the model's code returns): its stub is not ended yet.
SETTLE_SECS = 0.02
# How often the idle check is tried before Triton's own unload is used.
TRIES = 5
# How many times (1 ms apart) the threads of a stopped stub are looked at in one check, to see them stopped.
STOP_POLLS = 5
# Triton probes a stub's health for this long before it finalizes or kills it.
HEALTH_PROBE_SECS = 1.0
# How long killed processes get to be gone (a SIGKILLed process leaves within milliseconds).
KILL_WAIT_SECS = 2.0


class Unloader:
    def __init__(
        self,
        settings: Settings,
        triton: TritonAdminClient,
        processes: TritonProcesses,
        metrics: SnoozeMetrics,
        *,
        pending: Callable[[], Awaitable[dict[str, float]]],
        journal_dir: Path | None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.triton = triton
        self.processes = processes
        self.metrics = metrics
        self._pending = pending
        self.journal_dir = journal_dir
        # why unloads with processes in view took Triton's own way: running (a thread never at rest), busy
        # (a batch), unknown (threads or journal unreadable), declares_unload
        self.waited: Counter[str] = Counter()

    async def unload(self, rec: ModelRecord) -> str:
        """Unload the model in Triton and return once its memory is free: "ended" (its processes were ended
        once Triton let go) or "waited" (Triton's own unload). Raises what ``TritonAdminClient.unload`` raises."""
        started = self.clock.monotonic()
        how = await self._unload(rec)
        self.metrics.unload_seconds.labels(how=how).observe(self.clock.monotonic() - started)
        return how

    async def _unload(self, rec: ModelRecord) -> str:
        journal_dir = self.journal_dir
        if not self.settings.fast_unload:
            await self.triton.unload(rec.id, wait=True)
            return "waited"
        if not rec.is_python or journal_dir is None:
            return await self._wait(rec, [])
        stubs = await asyncio.to_thread(self.processes.stubs, rec.id)
        if not stubs and self.processes.visible:
            # Every process of the model has died (a crash): nothing holds its memory, and Triton 2.51 may take
            # minutes to finish unloading a model whose stub died, so its index is not waited for.
            await self.triton.unload(rec.id, wait=False)
            return "ended"
        if not stubs:
            return await self._wait(rec, [])
        verdict = "busy"
        for _ in range(TRIES):
            verdict = await asyncio.to_thread(self._freeze_if_idle, stubs, journal_dir)
            if verdict == "idle":
                return await self._end(rec, stubs, journal_dir)
            if verdict not in ("running", "busy"):  # no journal, or an unload() to run
                break
            await asyncio.sleep(SETTLE_SECS)
        self.waited[verdict] += 1
        if verdict == "unknown" and self.waited[verdict] == 1:
            log.warning(
                "model '%s': its processes' threads or request journal cannot be read here (ptrace access to "
                "/proc/<pid>/task/*/syscall, e.g. kernel.yama.ptrace_scope=1 for processes that are not this "
                "one's descendants), so unloads wait for Triton's own (about 1.2 s each)",
                rec.id,
            )
        return await self._wait(rec, stubs)

    def _freeze_if_idle(self, stubs: list[StubProcess], journal_dir: Path) -> str:
        """Stop the stubs and check them: "idle" (left stopped), else "running" (a thread not at rest), "busy"
        (a batch), "unknown" or "declares_unload" (let go on)."""
        self.processes.signal(stubs, signal.SIGSTOP)
        verdict = "idle"
        now = self.clock.monotonic()  # the clock the stubs' journals stamp batch ends on (CLOCK_MONOTONIC)
        for stub in stubs:
            at_rest = self.processes.at_rest(stub)
            for _ in range(STOP_POLLS):  # SIGSTOP reaches every thread in a moment
                if at_rest is not False:
                    break
                # the kernel's delivery of SIGSTOP, waited for through the clock: a virtual one's processes are
                # fakes, and its worker threads run inline on the event loop, where a real sleep only blocks it
                self.clock.sleep(0.001)
                at_rest = self.processes.at_rest(stub)
            if at_rest is None:
                verdict = "unknown"
                break
            if not at_rest:  # a thread stopped in its own code may hold a lock shared with Triton
                verdict = "running"
                continue
            activity = read_activity(journal_dir, stub)
            if activity is None:
                verdict = "unknown"
                break
            if activity.declares_unload:
                verdict = "declares_unload"
                break
            if activity.busy or now - activity.last_end_ns / 1e9 < SETTLE_SECS:
                verdict = "busy"
        if verdict != "idle":
            self.processes.signal(stubs, signal.SIGCONT)
        return verdict

    async def _end(self, rec: ModelRecord, stubs: list[StubProcess], journal_dir: Path) -> str:
        """The stubs are stopped and idle: out of service in Triton, then ended."""
        try:
            await self.triton.unload(rec.id, wait=False)
            queued = (await self._pending()).get(rec.id, 0.0)
        except SnoozeError:
            await asyncio.to_thread(self.processes.signal, stubs, signal.SIGCONT)
            raise
        if queued > 0:  # Triton runs what it had queued before it lets go: on live stubs
            await asyncio.to_thread(self.processes.signal, stubs, signal.SIGCONT)
            return await self._wait(rec, stubs, unloading=True)
        killed = await self._kill(rec, stubs)
        for stub in stubs:
            remove_journal(journal_dir, stub)
        log.debug("model '%s': ended its processes %s once Triton had taken it out of service", rec.id, killed)
        return "ended"

    async def _wait(self, rec: ModelRecord, stubs: list[StubProcess], *, unloading: bool = False) -> str:
        """Triton's own unload (the model's finalize and unload() run), waited for through the index. Where
        the processes are seen, they get the 1 s probe plus ``unload_finalize_secs``, then they are ended."""
        if not stubs or not self.processes.visible:
            await self.triton.unload(rec.id, wait=True)
            return "waited"
        bound = HEALTH_PROBE_SECS + self.settings.unload_finalize_secs
        try:
            if unloading:
                await wait_unloaded(self.triton, rec.id, bound)
            else:
                await self.triton.unload(rec.id, wait=True, timeout=bound)
            return "waited"
        except TritonError:
            if not any(await asyncio.to_thread(lambda: [self.processes.alive(s) for s in stubs])):
                raise  # its processes are gone yet Triton still holds it: the caller marks it triton_may_hold
        killed = await self._kill(rec, stubs)
        log.warning(
            "model '%s': its processes %s had not exited %gs after the unload (its unload() or finalize overran); "
            "ended them",
            rec.id,
            killed,
            bound,
        )
        return "waited"

    async def _kill(self, rec: ModelRecord, stubs: list[StubProcess]) -> list[int]:
        """End the model's stubs and their workers; return (their pids) once they hold no memory."""
        killed = await asyncio.to_thread(end_model_processes, self.processes, self.journal_dir, stubs)
        await self._gone(rec, stubs)
        return killed

    async def _gone(self, rec: ModelRecord, stubs: list[StubProcess]) -> None:
        """Return once the killed processes hold no memory (gone, or zombies)."""
        deadline = self.clock.monotonic() + KILL_WAIT_SECS
        while any(await asyncio.to_thread(lambda: [self.processes.alive(s) for s in stubs])):
            if self.clock.monotonic() >= deadline:
                log.warning("model '%s': processes still alive %gs after SIGKILL", rec.id, KILL_WAIT_SECS)
                return
            await asyncio.sleep(0.002)
