"""The preload library for tritonserver (controlplane/triton/defer_send.c): libevhtp's 17-byte hand-off on a
full non-blocking socketpair waits for room instead of failing; every other send() is left alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from controlplane.triton.defer_shim import LIB_PREFIX, build_defer_shim, compiler, with_preload

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler to build the preload library")

# A non-blocking AF_UNIX stream socketpair (as libevhtp's evthr_defer uses) filled with `count` sends of
# `size` bytes while its reader starts late: prints how many went through, and LD_PRELOAD as it is then.
SENDER = textwrap.dedent(
    """
    import os, socket, sys, threading, time

    size, count = int(sys.argv[1]), int(sys.argv[2])
    reader, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    writer.setblocking(False)

    def read():
        time.sleep(0.3)
        while reader.recv(65536):
            pass

    threading.Thread(target=read, daemon=True).start()
    sent = 0
    try:
        for _ in range(count):
            writer.send(b"x" * size)
            sent += 1
    except BlockingIOError:
        pass
    print(sent, os.environ.get("LD_PRELOAD", ""))
    """
)


def _send(tmp_path: Path, size: int, count: int, preload: Path | None) -> tuple[int, str]:
    script = tmp_path / "sender.py"
    script.write_text(SENDER)
    env = with_preload({"PATH": "/usr/bin:/bin", "LD_PRELOAD": "libc.so.6"}, preload)
    out = subprocess.run(
        [sys.executable, str(script), str(size), str(count)], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    sent, _, left = out.stdout.strip().partition(" ")
    return int(sent), left


def test_a_full_socketpair_loses_evthr_commands_without_the_library(tmp_path: Path):
    sent, _ = _send(tmp_path, 17, 2000, None)
    assert sent < 2000  # the kernel refuses once ~a socket buffer is queued: libevhtp's command is lost


def test_the_library_makes_the_17_byte_hand_off_wait_for_room(tmp_path: Path):
    lib = build_defer_shim(tmp_path / "work", use_cache=False)
    assert lib is not None and lib.name.startswith(LIB_PREFIX)
    sent, preload = _send(tmp_path, 17, 2000, lib)
    assert sent == 2000
    assert preload == "libc.so.6"  # it took itself out of LD_PRELOAD (Triton's children never load it)


def test_other_sends_keep_their_eagain(tmp_path: Path):
    lib = build_defer_shim(tmp_path / "work", use_cache=False)
    sent, _ = _send(tmp_path, 16, 4000, lib)
    assert sent < 4000


def test_the_library_is_built_once_per_source_version(tmp_path: Path):
    first = build_defer_shim(tmp_path / "work", use_cache=False)
    assert first is not None
    stamp = first.stat().st_mtime_ns
    assert build_defer_shim(tmp_path / "work", use_cache=False) == first and first.stat().st_mtime_ns == stamp


def test_without_a_compiler_triton_runs_without_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("controlplane.triton.defer_shim.compiler", lambda: None)
    assert build_defer_shim(tmp_path / "work", use_cache=False) is None
    assert with_preload({"A": "1"}, None) == {"A": "1"}


def test_one_build_serves_every_work_dir_from_the_cache(tmp_path: Path):
    first = build_defer_shim(tmp_path / "a", tmp_path / "cache")
    assert first is not None and first.parent == tmp_path / "cache"
    assert build_defer_shim(tmp_path / "b", tmp_path / "cache") == first
    assert not (tmp_path / "a" / "preload").exists()


def test_a_read_only_cache_falls_back_to_the_work_dir(tmp_path: Path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a cache path under a file cannot be created
    lib = build_defer_shim(tmp_path / "work", blocked / "cache")
    assert lib is not None and lib.parent == tmp_path / "work" / "preload"
