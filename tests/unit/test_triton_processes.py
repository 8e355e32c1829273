"""Seeing Triton's processes: /proc parsing, a stub's death and how it ended, the server by its port.

Real processes stand in for Triton's: this test process plays tritonserver, and Python children started
with the stub's argv[0] and a model file's path play its python-backend stubs.
"""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.lifecycle.recovery import crashes_among
from controlplane.triton.journal import journal_path
from controlplane.triton.processes import (
    STUB_NAME,
    TritonProcesses,
    listening_ports,
    read_stat,
)
from harness.probes import until
from python_backend.exits import describe_wait_status


def fake_stub(repo: Path, model: str, instance: str, code: str = "import time; time.sleep(60)") -> subprocess.Popen:
    model_file = repo / model / "1" / "model.py"
    model_file.parent.mkdir(parents=True, exist_ok=True)
    model_file.write_text(code)
    argv = [f"/backends/python/{STUB_NAME}", str(model_file), "shm", "1", "1", str(os.getpid()), "/b", "ipc"]
    return subprocess.Popen([*argv, instance, "DEFAULT"], executable=sys.executable)


def wait_state(pid: int, state: str, timeout: float = 10) -> None:
    until(lambda: getattr(read_stat(pid), "state", None) == state, f"pid {pid} to reach state {state}", timeout, 0.02)


def wait_sleeping(pid: int, timeout: float = 30) -> None:
    """Until the process's main thread waits in time.sleep (clock_nanosleep or nanosleep, x86_64 numbers)."""
    calls: list[str] = []

    def sleeping() -> bool:
        try:
            calls.append(Path(f"/proc/{pid}/syscall").read_text().split()[0])
        except (OSError, IndexError):
            calls.append("")
        return calls[-1] in ("230", "35") or (platform.machine() != "x86_64" and calls[-1].isdigit())

    until(sleeping, lambda: f"pid {pid} to go to sleep (syscall {calls[-1]!r})", timeout, 0.02)


@pytest.fixture
def observer() -> TritonProcesses:
    return TritonProcesses(server_pid=os.getpid)


def test_stubs_by_model_and_how_each_died(observer: TritonProcesses, tmp_path: Path):
    a = fake_stub(tmp_path, "alpha", "alpha_0_0")
    b = fake_stub(tmp_path, "beta", "beta_0_0", code="import os, time; time.sleep(0.3); os._exit(3)")
    try:
        until(lambda: len(observer.stubs()) >= 2, "both fake stubs to be seen", timeout=10, interval=0.02)
        [alpha] = observer.stubs("alpha")
        [beta] = observer.stubs("beta")
        assert (alpha.pid, alpha.instance, beta.model) == (a.pid, "alpha_0_0", "beta")
        assert observer.death(alpha) is None and observer.alive(alpha)
        assert observer.rss([alpha]) > 0
        wait_state(b.pid, "Z")  # not reaped: as Triton leaves a crashed stub
        death = observer.death(beta)
        assert death is not None and not death.reaped and death.describe() == "exit code 3"
        assert observer.stubs("beta") == []  # a zombie is no live stub
        os.kill(a.pid, signal.SIGKILL)
        wait_state(a.pid, "Z")
        assert observer.death(alpha).describe() == "killed by signal 9 (SIGKILL)"
        a.wait()  # reaped, as Triton reaps the stubs it ends itself
        gone = observer.death(alpha)
        assert gone is not None and gone.reaped and gone.describe() == "exit status unknown"
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_a_stub_this_observer_killed_is_ended_not_crashed_and_only_a_crash_left_its_journal(
    observer: TritonProcesses, tmp_path: Path
):
    """``kill`` marks its deaths ``ended``; ``crashes_among`` (what a transition reads before it lets the processes
    go) counts a death it did not cause whose journal is still there (the runtime removes it at a clean end), zombie
    or reaped; without a journal folder, a zombie (Triton reaps only what it ends)."""
    journals = tmp_path / "journals"
    journals.mkdir()
    ended = fake_stub(tmp_path, "m", "m_0_0")
    crashed = fake_stub(tmp_path, "m", "m_0_1", code="import os, time; time.sleep(0.3); os._exit(139)")
    clean = fake_stub(tmp_path, "m", "m_0_2", code="import os, time; time.sleep(0.3); os._exit(0)")
    try:
        until(lambda: len(observer.stubs("m")) >= 3, "the three fake stubs to be seen", timeout=10, interval=0.02)
        stubs = {s.instance: s for s in observer.stubs("m")}
        for stub in stubs.values():
            journal_path(journals, stub.pid, stub.start_ticks).write_bytes(b"\0" * 8)
        journal_path(journals, stubs["m_0_2"].pid, stubs["m_0_2"].start_ticks).unlink()  # its clean end
        assert observer.kill([stubs["m_0_0"]]) == [ended.pid]
        for p in (ended, crashed, clean):
            wait_state(p.pid, "Z")
        deaths = {d.stub.instance: d for d in observer.deaths(stubs.values())}
        assert deaths["m_0_0"].ended and not deaths["m_0_1"].ended and not deaths["m_0_2"].ended
        assert [d.stub.instance for d in crashes_among(observer, journals, stubs.values())] == ["m_0_1"]
        # no journal folder: a zombie Triton has not reaped is taken for a crash, an ended one is not
        assert [d.stub.instance for d in crashes_among(observer, None, stubs.values())] == ["m_0_1", "m_0_2"]
        for p in (ended, crashed, clean):
            p.wait()  # reaped, as Triton reaps what it ends and, at an unload, what crashed
        found = crashes_among(observer, journals, stubs.values())
        assert [d.stub.instance for d in found] == ["m_0_1"] and found[0].reaped
    finally:
        for p in (ended, crashed, clean):
            p.kill()
            p.wait()


def test_a_reused_pid_is_not_the_same_stub(observer: TritonProcesses, tmp_path: Path):
    p = fake_stub(tmp_path, "m", "m_0_0")
    try:
        until(lambda: observer.stubs("m"), "the fake stub to be seen", timeout=10, interval=0.02)
        [stub] = observer.stubs("m")
        other = type(stub)(stub.pid, stub.start_ticks + 1, stub.model, stub.instance)
        assert observer.death(stub) is None
        assert observer.death(other) is not None  # same pid, another start time: that process is gone
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize(
    ("status", "words"),
    [(0, "exit code 0"), (256, "exit code 1"), (11, "killed by signal 11 (SIGSEGV)"), (None, "exit status unknown")],
)
def test_describe_wait_status(status, words):
    assert describe_wait_status(status) == words


def test_listening_ports_and_finding_a_server_by_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port in listening_ports(os.getpid())
        # Only a process named tritonserver counts: this one listens on the port but is not it.
        assert TritonProcesses(http_url=f"http://127.0.0.1:{port}").server() is None
    assert listening_ports(2**22 + 7) == set()  # no such process


def test_an_unseen_triton_sees_nothing():
    unseen = TritonProcesses.unseen()
    assert not unseen.visible and not unseen.can_observe
    assert unseen.stubs() == [] and unseen.tree_rss() == 0 and unseen.environment("PATH") is None


def test_a_stopped_stub_is_at_rest_only_when_every_thread_waits(observer: TritonProcesses, tmp_path: Path):
    """What the fast unload checks before it ends a stub: no thread stopped inside its own code (where it may
    hold a lock in the memory it shares with tritonserver; one did, and tritonserver aborted)."""
    idle = fake_stub(tmp_path, "idle", "idle_0_0")
    spin = "import threading, time\nthreading.Thread(target=lambda: [0 for _ in iter(int, 1)]).start()\ntime.sleep(60)"
    busy = fake_stub(tmp_path, "busy", "busy_0_0", code=spin)
    try:
        until(lambda: len(observer.stubs()) >= 2, "both fake stubs to be seen", timeout=10, interval=0.02)
        # both interpreters started (however long that takes on a loaded machine): one sleeps, the other's main
        # thread sleeps while a thread of its own spins
        wait_sleeping(idle.pid)
        wait_sleeping(busy.pid)
        [quiet], [spinning] = observer.stubs("idle"), observer.stubs("busy")
        observer.signal([quiet, spinning], signal.SIGSTOP)
        wait_state(idle.pid, "T")
        wait_state(busy.pid, "T")
        assert observer.at_rest(quiet) is True
        assert observer.at_rest(spinning) is False
    finally:
        for p in (idle, busy):
            p.kill()
            p.wait()
