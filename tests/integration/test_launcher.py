"""The embedded launcher against a real tritonserver."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest

from controlplane.errors import TritonLaunchError
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.embedded_dist import detect_backends
from controlplane.triton.launcher import EmbeddedTriton
from harness.probes import grpc_infer, http_infer

pytestmark = pytest.mark.integration


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], timeout: float = 5) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not _gone(p)]


def test_session_triton_is_live(embedded_triton):
    assert embedded_triton.is_running()
    assert httpx.get(f"{embedded_triton.http_url}/v2/health/live").status_code == 200
    assert "# HELP nv_" in httpx.get(f"{embedded_triton.metrics_url}/metrics").text
    assert detect_backends(embedded_triton.work_dir / "backends") == {"python"}
    assert embedded_triton.process_tree_rss() > 10 * 2**20
    cmdline = psutil.Process(embedded_triton.pid).cmdline()
    assert "--model-control-mode=explicit" in cmdline and "--disable-auto-complete-config" in cmdline


async def test_load_infer_unload_stub_lifecycle(embedded_triton, model_repo, write_tiny_model, triton_admin):
    name = write_tiny_model(model_repo, "launcher_tiny", instances=2)
    await triton_admin.load(name)
    stubs = embedded_triton.stub_pids(name)
    assert len(stubs) == 2
    # argv: stub, <repo>/<model>/1/model.py, shm region, 2 shm sizes, parent pid, backend dir, ipc, instance
    cmdlines = [psutil.Process(pid).cmdline() for pid in stubs]
    assert all(c[0].endswith("triton_python_backend_stub") for c in cmdlines)
    assert all(c[1] == str(model_repo / name / "1" / "model.py") for c in cmdlines)
    assert all(c[5] == str(embedded_triton.pid) for c in cmdlines)
    assert {c[8] for c in cmdlines} == {f"{name}_0_0", f"{name}_0_1"}

    x = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    np.testing.assert_array_equal(http_infer(embedded_triton.http_url.removeprefix("http://"), name, x), x * 2)
    np.testing.assert_array_equal(grpc_infer(embedded_triton.grpc_url, name, x), x * 2)

    await triton_admin.unload(name)
    assert not await triton_admin.model_ready(name)
    assert [p for p in stubs if not _gone(p)] == []  # Triton reaped the stubs before UNAVAILABLE
    assert embedded_triton.stub_pids(name) == []


async def test_stop_leaves_no_orphans_even_after_server_sigkill(tmp_path, write_tiny_model):
    repo = tmp_path / "repo"
    repo.mkdir()
    name = write_tiny_model(repo, "orphan_check", instances=2)
    with EmbeddedTriton(repo, tmp_path / "work") as triton:
        async with TritonAdminClient(triton.http_url) as admin:
            await admin.load(name)
        stubs = triton.stub_pids(name)
        assert len(stubs) == 2
        server = triton.pid
        os.kill(server, signal.SIGKILL)  # a crash: stubs lose their parent
        regions = list(Path("/dev/shm").glob(f"{triton.shm_region_prefix}*"))
        assert len(regions) == 2  # one per stub, left behind by the crash
        triton.stop(timeout=5)
        assert not triton.is_running()
        assert _wait_gone([server, *stubs], timeout=1) == []
        assert not any(r.exists() for r in regions)


async def test_graceful_stop_and_restart(tmp_path, write_tiny_model):
    repo = tmp_path / "repo"
    repo.mkdir()
    name = write_tiny_model(repo, "restart_check")
    triton = EmbeddedTriton(repo, tmp_path / "work", exit_timeout_secs=5)
    triton.start()
    try:
        async with TritonAdminClient(triton.http_url) as admin:
            await admin.load(name)
            first_pid, stubs, url = triton.pid, triton.stub_pids(name), triton.http_url
        # (a client's open keep-alive connection would hold Triton's stop for its whole exit timeout)
        triton.restart()
        assert triton.pid != first_pid and triton.http_url == url
        async with TritonAdminClient(triton.http_url) as admin:
            assert _wait_gone([first_pid, *stubs], timeout=1) == []
            assert await admin.live()
            assert not await admin.model_ready(name)  # explicit mode: nothing is loaded after a restart
            await admin.load(name)
            assert await admin.model_ready(name)
        stubs = triton.stub_pids(name)
        server = triton.pid
    finally:
        triton.stop()
    assert _wait_gone([server, *stubs], timeout=1) == []
    # SIGTERM let Triton unload cleanly, at the restart and at the stop (the log file is appended to)
    assert triton.log_file.read_text().count("successfully unloaded 'restart_check'") == 2


def test_start_failure_shows_the_log_tail(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        repo = tmp_path / "repo"
        repo.mkdir()
        triton = EmbeddedTriton(repo, tmp_path / "work", http_port=busy.getsockname()[1])
        with pytest.raises(TritonLaunchError) as info:
            triton.start(timeout=30)
    assert "exited with code" in info.value.message
    assert "Address already in use" in info.value.message or "failed to start" in info.value.message
    assert str(triton.log_file) in info.value.message
    assert not triton.is_running()
