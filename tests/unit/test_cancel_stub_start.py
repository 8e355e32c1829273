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
from pathlib import Path

from controlplane.lifecycle import cancel
from controlplane.triton.journal import PHASE_SUFFIX
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


def started(journal: Path, stub: StubProcess) -> None:
    (journal / f"{stub.pid}-{stub.start_ticks}{PHASE_SUFFIX}").write_text('{"phase": "import"}')


def test_only_stubs_past_initialize_are_ended_until_the_start_bound(tmp_path: Path):
    running, starting = StubProcess(11, 110, "m", "m_0_0"), StubProcess(12, 120, "m", "m_0_1")
    started(tmp_path, running)
    processes = Processes([running, starting])
    ended, waiting = asyncio.run(cancel.end_processes(processes, tmp_path, "m", waited=0.5))  # type: ignore[arg-type]
    assert ended == [11] and waiting == 1 and processes.killed == [11]
    started(tmp_path, starting)  # it reached initialize: now it goes
    ended, waiting = asyncio.run(cancel.end_processes(processes, tmp_path, "m", waited=1.0))  # type: ignore[arg-type]
    assert ended == [12] and waiting == 0


def test_a_stub_that_never_reaches_initialize_is_ended_at_the_bound(tmp_path: Path):
    stuck = StubProcess(21, 210, "m", "m_0_0")
    processes = Processes([stuck])
    early = asyncio.run(cancel.end_processes(processes, tmp_path, "m", waited=1.0))  # type: ignore[arg-type]
    late = asyncio.run(
        cancel.end_processes(processes, tmp_path, "m", waited=cancel.STUB_START_SECS)  # type: ignore[arg-type]
    )
    assert early == ([], 1) and late == ([21], 0)


def test_without_a_journal_folder_every_stub_is_ended(tmp_path: Path):
    processes = Processes([StubProcess(31, 310, "m", "m_0_0")])
    assert asyncio.run(cancel.end_processes(processes, None, "m", waited=0.0)) == ([31], 0)  # type: ignore[arg-type]
