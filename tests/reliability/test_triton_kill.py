"""tritonserver is killed (SIGKILL) mid-traffic.

Requests fail fast with 503 / UNAVAILABLE (none hangs past its deadline), the control plane restarts
Triton, and the same clients are served again without reconnecting by hand.

One of the two models forks a helper process at load (as a data loader or a tokenizer server would). It
inherits the stub's open files, Triton's client connections among them (Triton's accepted sockets are not
close-on-exec), so after the kill those connections stay open: Envoy's pooled ones, the control plane's.
A request sent over one waits for as long as the helper lives. The process watch (every 0.2 s, no call to
Triton) must notice the death and end the leftovers; the sweep (10 s here) must not be what notices it: in
CI a sweep that was waiting on such a connection held the restart up for its whole 10 s call timeout.
"""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest

from harness.probes import until_async
from harness.reliability import Traffic, report, summary

pytestmark = pytest.mark.integration

CLIENT_TIMEOUT = 8.0
SWEEP = 10.0  # the sweep's interval: longer than the process watch may take to see the death and restart
SLACK = 3.0  # scheduling on a busy 2-core machine; a hang would be the whole timeout or forever


def _lives(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_tritonserver_killed_mid_traffic(serve_factory, package):
    serve = serve_factory("tritonkill", sweep_interval_secs=str(SWEEP))
    await asyncio.to_thread(serve.start)
    await asyncio.to_thread(serve.publish, "alpha", package, params={"helper_secs": 600.0})
    await asyncio.to_thread(serve.publish, "beta", package)
    traffic = Traffic(serve, {"alpha": 2.0, "beta": 2.0}, grpc_clients=4, http_clients=2, timeout=CLIENT_TIMEOUT)
    traffic.start()
    try:
        # warm traffic on both models (on a loaded machine one model can answer 50 times before the other loads)
        await until_async(
            lambda: all(sum(r.ok for r in traffic.results if r.model == m) >= 25 for m in ("alpha", "beta")),
            "warm traffic on both models",
        )
        triton = await asyncio.to_thread(serve.tritonserver)
        helpers = [p for p in triton.children(recursive=True) if p.ppid() != triton.pid]
        assert helpers, "alpha's helper process (a child of its stub)"
        killed_at = time.monotonic()
        triton.kill()
        restarted = await until_async(lambda: (serve.tritonserver() or triton).pid != triton.pid, "a new tritonserver")
        recovered = await until_async(
            lambda: {r.model for r in traffic.results if r.ok and r.started > killed_at} == {"alpha", "beta"},
            "traffic to resume on both models",
        )
        resumed_at = time.monotonic()
        await asyncio.sleep(2.0)
    finally:
        results = await traffic.stop()

    total = summary(results)
    failed = [r for r in results if not r.ok]
    report(
        "tritonserver SIGKILL mid-traffic",
        failed=f"{total['failed']}/{total['total']}",
        restart_secs=round(restarted, 2),
        recovery_secs=round(recovered, 2),
        slowest_failure_secs=round(max((r.seconds for r in failed), default=0), 3),
        slowest_request_secs=total["max_seconds"],
        errors=total["errors"],
    )
    assert not any("WRONG ANSWER" in r.error for r in results)
    # Seen by the process watch, long before the next sweep; and the helper holding Triton's connections is gone.
    assert restarted < SWEEP / 2, restarted
    assert not any(_lives(p) for p in helpers), helpers
    # Fail fast, with the right status: nothing waits past its deadline.
    assert total["max_seconds"] <= CLIENT_TIMEOUT + SLACK, total
    for r in failed:
        when = f"sent {r.started - killed_at:+.3f} s after the kill, answered {r.ended - killed_at:+.3f} s"
        assert r.error.startswith(("StatusCode.UNAVAILABLE", "503")), f"{r.protocol} {r.model}: {r.error} ({when})"
    # Failures only around the crash; everything sent after the recovery was served.
    assert all(r.ok for r in results if r.started > resumed_at), total
    assert all(r.ended >= killed_at for r in failed)
    for model in ("alpha", "beta"):
        assert (await asyncio.to_thread(serve.status, model))["state"] == "ready"
    assert await asyncio.to_thread(serve.metric, "snooze_triton_restarts_total") == 1
