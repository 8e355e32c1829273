"""A load whose load() never returns (the default load_timeout_secs, 300 s) holds no unload and no stop.

With such a load in flight and a request waiting on it: an unload answers within seconds, the model's
processes are gone, the waiting request gets a 503 naming the cancel (a 404 after a delete; after a republish,
the new version's answer: the model is still published), the neighbour serves throughout;
Ctrl-C or SIGTERM stops ``snoozectl serve`` within shutdown_grace_secs (5 s here) + 5 s with nothing left
running, and a second Ctrl-C during the graceful stop ends it within 2 s. Both topologies (Triton as the
control plane's child, and in a process of its own).
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import numpy as np
import pytest

from harness.probes import until_async
from harness.reliability import infer_once, report
from harness.serve import alive_pids, write_package

pytestmark = pytest.mark.integration

GRACE = 5.0  # SNOOZE_SHUTDOWN_GRACE_SECS of serve_factory


async def hung_load(serve) -> asyncio.Task:
    """A request that starts the hanging load; returns once Triton runs the model's load(). The task's result is
    the request's answer (an array) or its error (a string)."""
    waiting = asyncio.create_task(infer_once(serve, "hung", "grpc", np.ones((1, 2), np.float32), timeout=120))
    await until_async(lambda: serve.stub_pids("hung"), "the hung model's stub", timeout=60)
    await asyncio.sleep(1.0)  # in load() now
    return waiting


@pytest.fixture(scope="module")
def published(serve_factory, package, tmp_path_factory, topology):
    serve = serve_factory("hungload", topology=topology)
    serve.start()
    hanging = write_package(tmp_path_factory.mktemp("hung") / "pkg")  # load_timeout_secs: the default, 300 s
    serve.publish("steady", package)
    serve.publish("hung", hanging, params={"load_sleep": 600.0})
    serve.hanging = hanging
    yield serve
    serve.stop()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("action", ["unload", "republish", "delete"])
async def test_an_unload_delete_or_republish_during_a_hung_load_cancels_it(published, action):
    serve = published
    if "hung" not in await asyncio.to_thread(serve.models):
        await asyncio.to_thread(serve.publish, "hung", serve.hanging, params={"load_sleep": 600.0})
    assert isinstance(await infer_once(serve, "steady", "grpc", np.ones((1, 2), np.float32)), np.ndarray)
    waiting = await hung_load(serve)
    hung_pids = await asyncio.to_thread(serve.stub_pids, "hung")
    started = time.monotonic()
    async with httpx.AsyncClient(headers=serve._headers(), timeout=30) as client:
        if action == "unload":
            r = await client.post(f"{serve.api_url}/v1/models/hung/unload")
        elif action == "delete":
            r = await client.delete(f"{serve.api_url}/v1/models/hung")
        else:  # a new version that loads: scale 5
            r = await client.post(
                f"{serve.api_url}/v1/models:from-path",
                json={"id": "hung", "path": str(serve.hanging), "params": {"scale": 5.0}},
            )
    answered = time.monotonic() - started
    # the hung load's processes (after a republish, the new version's may run by then)
    gone = await until_async(lambda: alive_pids(hung_pids) == [], "the hung load's stub to be gone", timeout=10)
    if action != "republish":
        assert await asyncio.to_thread(serve.stub_pids, "hung") == []
    answer = await asyncio.wait_for(waiting, 30)
    neighbour = await infer_once(serve, "steady", "grpc", np.ones((1, 2), np.float32))
    report(f"{action} during a hung load ({serve.topology})", answer_secs=round(answered, 2),
           processes_gone_secs=round(answered + gone, 2), client_answer=str(answer)[:160])  # fmt: skip
    assert r.status_code in (200, 201, 204), r.text
    assert answered < 5.0 and answered + gone < 5.0
    if action == "republish":  # still published: the request that waited gets the new version's answer
        assert isinstance(answer, np.ndarray), answer
        np.testing.assert_array_equal(answer, np.full((1, 2), 5.0, np.float32))
        assert (await asyncio.to_thread(serve.status, "hung"))["state"] == "ready"
        deleted = await asyncio.to_thread(
            lambda: httpx.delete(f"{serve.api_url}/v1/models/hung", headers=serve._headers(), timeout=60)
        )
        assert deleted.status_code in (200, 204), deleted.text  # the next case publishes the hanging version again
        assert isinstance(neighbour, np.ndarray)
        return
    assert isinstance(answer, str), f"a request to the cancelled load succeeded: {answer}"
    error = answer
    if action == "delete":  # Triton's unknown-model words, as for any model that is not published
        assert "deleted during its load" in error or "unknown model" in error.lower(), error
    else:
        assert error.startswith("StatusCode.UNAVAILABLE"), error
        assert f"load was cancelled ({'unloaded' if action == 'unload' else 'republished'})" in error, error
        status = await asyncio.to_thread(serve.status, "hung")
        assert status["state"] == "unloaded", status
    assert isinstance(neighbour, np.ndarray)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("signals", [("SIGINT",), ("SIGTERM",), ("SIGINT", "SIGINT")], ids="+".join)
async def test_a_stop_during_a_hung_load_is_bounded_and_leaves_nothing(
    serve_factory, package, tmp_path, topology, signals
):
    serve = serve_factory("hungstop", topology=topology)
    serve.start()
    serve.publish("hung", write_package(tmp_path / "pkg"), params={"load_sleep": 600.0})
    waiting = await hung_load(serve)
    assert serve.proc is not None
    serve.descendants()  # noted, to find leftovers
    started = time.monotonic()
    serve.proc.send_signal(getattr(signal, signals[0]))
    if len(signals) > 1:
        await asyncio.sleep(0.5)
        forced = time.monotonic()
        serve.proc.send_signal(getattr(signal, signals[1]))
    while serve.proc.poll() is None and time.monotonic() - started < GRACE + 30:
        await asyncio.sleep(0.05)
    took = time.monotonic() - started
    exited = serve.proc.poll() is not None
    waiting.cancel()
    await asyncio.sleep(0.5)  # the kernel reaps what was killed
    if topology == "embedded":
        left = [p.pid for p in serve.leftovers()]
    else:  # `snoozectl triton` runs on; the cancelled load's stub must not
        left = serve.stub_pids("hung")
    report(f"stop during a hung load ({topology}, {'+'.join(signals)})", stop_secs=round(took, 2),
           after_second_signal_secs=round(took - (forced - started), 2) if len(signals) > 1 else None,
           leftovers=left)  # fmt: skip
    assert exited, f"snoozectl serve did not exit within {GRACE + 30:g} s of {signals}"
    assert took < GRACE + 5, took
    if len(signals) > 1:
        assert took - (forced - started) < 2.0, took
    assert left == [], left
