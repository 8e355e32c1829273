"""Waiting for processes to be gone (controlplane/child_processes.py)."""

from __future__ import annotations

import errno
import subprocess
import time

import psutil
import pytest

from controlplane.child_processes import wait_gone


def test_a_wait_that_psutil_cannot_make_polls_until_the_process_is_gone(monkeypatch):
    # Linux 6.x: pidfd_open of a process reaped meanwhile can fail with ENOENT, which psutil 7 raises from wait_procs
    def refuse(*_a, **_k):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")

    monkeypatch.setattr(psutil, "wait_procs", refuse)
    ends = subprocess.Popen(["sleep", "0.3"])
    stays = subprocess.Popen(["sleep", "30"])
    try:
        procs = [psutil.Process(ends.pid), psutil.Process(stays.pid)]
        started = time.monotonic()
        gone, alive = wait_gone(procs, 3)  # the ended one is a zombie until reaped: gone all the same
        assert [p.pid for p in gone] == [ends.pid] and [p.pid for p in alive] == [stays.pid]
        assert 2.5 <= time.monotonic() - started < 10  # bounded by its timeout, though one process stays
    finally:
        stays.kill()
        for p in (ends, stays):
            p.wait()


def test_processes_already_gone_are_gone_at_once():
    proc = subprocess.Popen(["true"])
    handle = psutil.Process(proc.pid)
    proc.wait()
    gone, alive = wait_gone([handle], 5)
    assert gone == [handle] and alive == []


@pytest.mark.parametrize("timeout", [0.0, 0.2])
def test_no_processes_no_wait(timeout):
    assert wait_gone([], timeout) == ([], [])
