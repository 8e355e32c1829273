"""tritonserver is killed (SIGKILL) mid-traffic.

Requests fail fast with 503 / UNAVAILABLE (none hangs past its deadline), the control plane restarts
Triton, and the same clients are served again without reconnecting by hand.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from reliability_helpers import Traffic, report, summary
from serve_harness import until_async

pytestmark = pytest.mark.integration

CLIENT_TIMEOUT = 8.0
SLACK = 3.0  # scheduling on a busy 2-core machine; a hang would be the whole timeout or forever


async def test_tritonserver_killed_mid_traffic(serve_factory, package):
    serve = serve_factory("tritonkill")
    await asyncio.to_thread(serve.start)
    for model in ("alpha", "beta"):
        await asyncio.to_thread(serve.publish, model, package)
    traffic = Traffic(serve, {"alpha": 2.0, "beta": 2.0}, grpc_clients=4, http_clients=2, timeout=CLIENT_TIMEOUT)
    traffic.start()
    try:
        await until_async(lambda: sum(r.ok for r in traffic.results) >= 50, "warm traffic")
        triton = await asyncio.to_thread(serve.tritonserver)
        killed_at = time.monotonic()
        triton.kill()
        await until_async(lambda: (serve.tritonserver() or triton).pid != triton.pid, "a new tritonserver")
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
        recovery_secs=round(recovered, 2),
        slowest_failure_secs=round(max((r.seconds for r in failed), default=0), 3),
        slowest_request_secs=total["max_seconds"],
        errors=total["errors"],
    )
    assert not any("WRONG ANSWER" in r.error for r in results)
    # Fail fast, with the right status: nothing waits past its deadline.
    assert total["max_seconds"] <= CLIENT_TIMEOUT + SLACK, total
    for r in failed:
        assert r.error.startswith(("StatusCode.UNAVAILABLE", "503")), r.error
    # Failures only around the crash; everything sent after the recovery was served.
    assert all(r.ok for r in results if r.started > resumed_at), total
    assert all(r.ended >= killed_at for r in failed)
    for model in ("alpha", "beta"):
        assert (await asyncio.to_thread(serve.status, model))["state"] == "ready"
    assert await asyncio.to_thread(serve.metric, "snooze_triton_restarts_total") == 1
