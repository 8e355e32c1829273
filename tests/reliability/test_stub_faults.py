"""A model's python stub dies mid-traffic (SIGKILL, a segfault in predict, os._exit in predict).

Failures are bounded by the requests in flight on that model when it died, the model is recovered
without anyone asking, traffic resumes, and a model next to it loses nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from reliability_helpers import Traffic, in_flight_at, report, summary
from serve_harness import until_async

pytestmark = pytest.mark.integration

GRPC_CLIENTS, HTTP_CLIENTS = 4, 2  # on the faulty model; one request in flight each


@pytest.fixture(scope="module")
def serve(serve_factory, package, tmp_path_factory):
    serve = serve_factory("stubfaults")
    serve.start()
    triggers = tmp_path_factory.mktemp("triggers")
    serve.publish("steady", package)
    serve.publish("victim", package, params={"scale": 3.0})
    for kind in ("segv", "exit"):
        serve.publish(f"crash-{kind}", package, params={"crash": kind, "crash_file": str(triggers / kind)})
    serve.triggers = triggers
    return serve


@pytest.mark.parametrize("fault", ["sigkill", "segv", "exit"])
async def test_stub_dies_mid_traffic(serve, fault):
    model = {"sigkill": "victim", "segv": "crash-segv", "exit": "crash-exit"}[fault]
    scale = 3.0 if model == "victim" else 2.0
    # Clients alternate models: GRPC_CLIENTS gRPC and HTTP_CLIENTS HTTP clients on each.
    models = {model: scale, "steady": 2.0}
    traffic = Traffic(serve, models, grpc_clients=2 * GRPC_CLIENTS, http_clients=2 * HTTP_CLIENTS)
    traffic.start()
    try:
        await until_async(lambda: sum(r.ok and r.model == model for r in traffic.results) >= 20, "warm traffic")
        [old] = await asyncio.to_thread(serve.stub_pids, model)
        fault_at = time.monotonic()
        if fault == "sigkill":
            os.kill(old, signal.SIGKILL)
        else:
            (serve.triggers / fault).touch()  # the next predict call crashes the stub
        await until_async(lambda: serve.stub_pids(model) not in ([], [old]), "a new stub")
        recovered = await until_async(
            lambda: any(r.ok and r.model == model and r.started > fault_at + 0.5 for r in traffic.results),
            "traffic to resume",
        )
        resumed_at = time.monotonic()
        await asyncio.sleep(2.0)
    finally:
        results = await traffic.stop()

    faulty, steady = summary(results, model), summary(results, "steady")
    failed = [r for r in results if r.model == model and not r.ok]
    died_at = min((r.ended for r in failed), default=fault_at)
    bound = max(in_flight_at(results, died_at, model), GRPC_CLIENTS + HTTP_CLIENTS)
    report(
        f"stub {fault} mid-traffic",
        failed=f"{faulty['failed']}/{faulty['total']}",
        failed_grpc=sum(r.protocol == "grpc" for r in failed),
        failed_http=sum(r.protocol == "http" for r in failed),
        in_flight_bound=bound,
        recovery_secs=round(recovered, 2),
        neighbour_failed=f"{steady['failed']}/{steady['total']}",
        errors=faulty["errors"],
    )
    assert steady["failed"] == 0, steady
    assert faulty["failed"] <= bound, faulty
    assert not any("WRONG ANSWER" in r.error for r in results)
    # Every failure belongs to the moment of the crash: requests sent after the recovery all succeeded.
    assert all(r.ok for r in results if r.model == model and r.started > resumed_at), faulty
    status = await asyncio.to_thread(serve.status, model)
    assert status["state"] == "ready", status
