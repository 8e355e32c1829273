"""A model's python stub dies: mid-traffic (SIGKILL, a segfault in predict, os._exit in predict), under
a poison request, or while idle.

Failures are bounded by the requests the dead process was running, the model is recovered without
anyone asking, traffic resumes, and a model next to it loses nothing. A request never runs twice: the
one that killed its process gets an error saying so, once; a request that arrives after the process
died is served after recovery. A predict call past request_timeout_secs is answered with the timeout at
the limit and its process is ended by the runtime's watchdog (Python cannot stop the call): the same
recovery follows. Every scenario runs with Triton as serve's child and with Triton in a
process of its own (`snoozectl triton`, the deployed topology), and with the models' code in their stubs
and in preforked workers (where a dying worker takes its stub with it, so the same recovery applies;
what is killed is then the worker).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from harness.probes import until_async
from harness.reliability import Traffic, in_flight_at, infer_once, report, summary
from harness.serve import write_package

pytestmark = pytest.mark.integration

GRPC_CLIENTS, HTTP_CLIENTS = 4, 2  # on the faulty model; one request in flight each


PROTOCOLS = ("grpc", "http")


@pytest.fixture(scope="module")
def serve(serve_factory, package, tmp_path_factory, topology, worker):
    serve = serve_factory("stubfaults", topology=topology)
    serve.start()
    triggers = tmp_path_factory.mktemp("triggers")
    serve.publish("steady", package)
    serve.publish("victim", package, params={"scale": 3.0}, worker=worker)
    for kind in ("segv", "exit"):
        params = {"crash": kind, "crash_file": str(triggers / kind)}
        serve.publish(f"crash-{kind}", package, params=params, worker=worker)
    for protocol in PROTOCOLS:
        calls = str(triggers / f"calls-{protocol}")
        serve.publish(f"poison-{protocol}", package, params={"crash": "poison", "calls": calls}, worker=worker)
        serve.publish(f"idle-{protocol}", package, params={"scale": 4.0}, worker=worker)
    limited = write_package(tmp_path_factory.mktemp("limited") / "scale", request_timeout_secs=1)
    for protocol in PROTOCOLS:  # x[:, 0] == -2 holds predict for 3 s, past the 1 s limit
        marker = str(triggers / f"overrun-{protocol}")
        serve.publish(f"overrun-{protocol}", limited, params={"marker": marker}, worker=worker)
    serve.triggers = triggers
    serve.worker = worker
    yield serve
    serve.stop()  # when its topology and worker are done: not idling beside the next ones


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
        [old] = await asyncio.to_thread(serve.model_pids, model, serve.worker)
        fault_at = time.monotonic()
        if fault == "sigkill":
            os.kill(old, signal.SIGKILL)
        else:
            (serve.triggers / fault).touch()  # the next predict call crashes the model's process
        await until_async(lambda: serve.model_pids(model, serve.worker) not in ([], [old]), "a new model process")
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
        f"stub {fault} mid-traffic ({serve.topology}, {serve.worker})",
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


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_poison_request_runs_once_and_its_client_is_told(serve, protocol):
    model = f"poison-{protocol}"
    calls = serve.triggers / f"calls-{protocol}"
    ok = await infer_once(serve, model, protocol, np.array([[1.0, 1.0]], np.float32))
    assert not isinstance(ok, str), ok
    [old] = await asyncio.to_thread(serve.model_pids, model, serve.worker)
    started = time.monotonic()
    error = await infer_once(serve, model, protocol, np.array([[-1.0, 1.0]], np.float32))
    answered = time.monotonic() - started
    assert isinstance(error, str), "the poison request succeeded"
    # Executed exactly once: the model saw the poison row once (a retry would have run it again).
    await asyncio.sleep(1.0)  # a second run, had there been one, would have logged by now
    rows = calls.read_text().split()
    assert rows.count("-1") == 1, rows
    expected = "500" if protocol == "http" else "StatusCode.INTERNAL"
    assert error.startswith(expected), error
    for words in ("died while running this request", "exit code 1", "not retried", "being restarted"):
        assert words in error, error
    # Recovered: served by a new process, and status says what happened.
    after = await infer_once(serve, model, protocol, np.array([[3.0, 1.0]], np.float32))
    assert not isinstance(after, str), after
    np.testing.assert_allclose(after, [[6.0, 2.0]])
    assert await asyncio.to_thread(serve.model_pids, model, serve.worker) not in ([], [old])
    status = await asyncio.to_thread(serve.status, model)
    assert status["state"] == "ready" and "exit code 1" in (status["last_crash"] or ""), status
    if serve.worker == "preforked":  # the client is told it was the worker
        assert f"preforked worker process (pid {old}" in error, error
    report(f"poison request ({serve.topology}, {serve.worker}, {protocol})", executions=rows.count("-1"),
           answer_secs=round(answered, 2), client_error=error[:120])  # fmt: skip


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_request_after_its_model_process_died_is_served(serve, protocol):
    model = f"idle-{protocol}"
    x = np.array([[1.0, 2.0]], np.float32)
    first = await infer_once(serve, model, protocol, x)
    assert not isinstance(first, str), first
    [old] = await asyncio.to_thread(serve.model_pids, model, serve.worker)
    loads = (await asyncio.to_thread(serve.status, model))["load_count"]
    os.kill(old, signal.SIGKILL)
    started = time.monotonic()
    answer = await infer_once(serve, model, protocol, x)  # sent at once: before or after the death is seen
    recovery = time.monotonic() - started
    assert not isinstance(answer, str), answer
    np.testing.assert_allclose(answer, x * 4.0)
    assert await asyncio.to_thread(serve.model_pids, model, serve.worker) not in ([], [old])
    status = await asyncio.to_thread(serve.status, model)
    assert status["load_count"] == loads + 1 and "SIGKILL" in (status["last_crash"] or ""), status
    report(f"request after SIGKILL of an idle model process ({serve.topology}, {serve.worker}, {protocol})",
           answered_after_secs=round(recovery, 3))  # fmt: skip


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_call_past_its_time_limit_is_answered_then_its_model_restarts(serve, protocol):
    model = f"overrun-{protocol}"
    marker = serve.triggers / model
    x = np.array([[1.0, 2.0]], np.float32)
    first = await infer_once(serve, model, protocol, x)
    assert not isinstance(first, str), first
    [old] = await asyncio.to_thread(serve.model_pids, model, serve.worker)
    started = time.monotonic()
    error = await infer_once(serve, model, protocol, np.array([[-2.0, 1.0]], np.float32))  # holds 3 s
    answered = time.monotonic() - started
    assert isinstance(error, str), "the overrunning request succeeded"
    assert f"[snooze:timeout] model '{model}': predict did not finish within request_timeout_secs=1 s" in error
    assert "this instance's process ends and the model is restarted" in error, error
    assert answered < 2.5, answered  # at the limit, not when the 3 s call would have returned
    # The next request is not held behind the overrunning call: a new process serves it.
    after = await infer_once(serve, model, protocol, x)
    served = time.monotonic() - started
    assert not isinstance(after, str), after
    np.testing.assert_allclose(after, x * 2.0)
    assert served < 3.0 + 2.0, served
    assert await asyncio.to_thread(serve.model_pids, model, serve.worker) not in ([], [old])
    status = await asyncio.to_thread(serve.status, model)
    assert "predict overran request_timeout_secs" in (status["last_crash"] or ""), status
    # Run once: neither the gateway nor the activator sent the timed-out request again.
    assert marker.read_text().split().count("started") == 1
    report(f"predict past request_timeout_secs ({serve.topology}, {serve.worker}, {protocol})",
           timeout_answer_secs=round(answered, 2), next_request_served_secs=round(served, 2),
           last_crash=status["last_crash"])  # fmt: skip
