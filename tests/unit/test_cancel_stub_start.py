"""A cancel never kills a stub that has not reached the model's initialize.

Triton 2.51 waits for a new stub's first message with no time limit (``StubLauncher::Launch``): a stub
SIGKILLed there leaves the load LOADING for ever and every later load and unload of that Triton queued behind
it (seen in the churn bench; gdb showed the load thread in an untimed ``MessageQueue::Pop``). The runtime's
phase note (``<pid>-<start ticks>.phase``) says a stub has reached initialize, from where Triton checks its
health every second. The stubs here are records, not processes: what is checked is which ones the cancel
hands to the kill, and when.
"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

from controlplane.clock import SYSTEM_CLOCK
from controlplane.lifecycle import cancel
from controlplane.lifecycle.recovery import RequestFate, fate_of
from controlplane.lifecycle.state import ProcessRecord
from controlplane.triton.journal import PHASE_SUFFIX, SIZE, TRAILER_LAYOUT, journal_path
from controlplane.triton.processes import StubProcess


class Processes:
    """The part of TritonProcesses a cancel uses; ``kill`` records instead of signalling."""

    can_observe = True
    proc_root = Path("/nonexistent")

    def __init__(self, stubs: list[StubProcess]) -> None:
        self.live = stubs
        self.killed: list[int] = []

    def stubs(self, model_id: str) -> list[StubProcess]:
        return [s for s in self.live if s.model == model_id]

    def kill(self, stubs: list[StubProcess]) -> list[int]:
        self.killed += [s.pid for s in stubs]
        self.live = [s for s in self.live if s not in stubs]
        return [s.pid for s in stubs]


class Rec:
    """The part of a ModelRecord a cancel's end of processes writes: the deaths and the requests they took."""

    id = "m"

    def __init__(self) -> None:
        self.procs = ProcessRecord()


def end(processes: Processes, journal: Path | None, waited: float, rec: Rec | None = None) -> tuple[list[int], int]:
    return asyncio.run(cancel.end_processes(processes, journal, rec or Rec(), SYSTEM_CLOCK, waited=waited))  # type: ignore[arg-type]


def journaled(journal: Path, stub: StubProcess, ids: list[str], *, busy: bool) -> None:
    """The stub's journal as the runtime writes it: its last batch's ids, and whether that batch is running."""
    raw = bytearray(SIZE)
    data = "\n".join(ids).encode()
    raw[: 4 + len(data)] = struct.pack("<I", len(data)) + data
    raw[SIZE - TRAILER_LAYOUT.size :] = TRAILER_LAYOUT.pack(0, int(busy), 0)
    journal_path(journal, stub.pid, stub.start_ticks).write_bytes(bytes(raw))


def started(journal: Path, stub: StubProcess) -> None:
    (journal / f"{stub.pid}-{stub.start_ticks}{PHASE_SUFFIX}").write_text('{"phase": "import"}')


def test_only_stubs_past_initialize_are_ended_until_the_start_bound(tmp_path: Path):
    running, starting = StubProcess(11, 110, "m", "m_0_0"), StubProcess(12, 120, "m", "m_0_1")
    started(tmp_path, running)
    processes = Processes([running, starting])
    ended, waiting = end(processes, tmp_path, 0.5)
    assert ended == [11] and waiting == 1 and processes.killed == [11]
    started(tmp_path, starting)  # it reached initialize: now it goes
    ended, waiting = end(processes, tmp_path, 1.0)
    assert ended == [12] and waiting == 0


def test_a_stub_that_never_reaches_initialize_is_ended_at_the_bound(tmp_path: Path):
    stuck = StubProcess(21, 210, "m", "m_0_0")
    processes = Processes([stuck])
    early = end(processes, tmp_path, 1.0)
    late = end(processes, tmp_path, cancel.STUB_START_SECS)
    assert early == ([], 1) and late == ([21], 0)


def test_without_a_journal_folder_every_stub_is_ended(tmp_path: Path):
    processes = Processes([StubProcess(31, 310, "m", "m_0_0")])
    assert end(processes, None, 0.0) == ([31], 0)


def test_the_requests_an_ended_stub_was_running_ran_and_the_others_never_did(tmp_path: Path):
    """Plain machine seed 1852401186: a cancel ended a stub of an earlier load during a request, whose "not healthy"
    answer then looked like one that never ran, and it ran again. What an ended stub's journal says it was running
    ran; a request it was not running never reached it (its journal was read)."""
    busy, idle = StubProcess(41, 410, "m", "m_0_0"), StubProcess(42, 420, "m", "m_0_1")
    for stub in (busy, idle):
        started(tmp_path, stub)
    journaled(tmp_path, busy, ["req-7", "req-8"], busy=True)
    journaled(tmp_path, idle, ["req-3"], busy=False)  # its last batch was answered
    rec = Rec()
    assert end(Processes([busy, idle]), tmp_path, 1.0, rec) == ([41, 42], 0)
    now = SYSTEM_CLOCK.monotonic()
    assert [fate_of(rec, r, now)[0] for r in ("req-7", "req-8")] == [RequestFate.RAN] * 2  # type: ignore[arg-type]
    assert fate_of(rec, "req-9", now)[0] is RequestFate.NOT_RUN  # type: ignore[arg-type]
    assert fate_of(rec, "req-3", now)[0] is RequestFate.NOT_RUN  # type: ignore[arg-type]
