"""BLS calls into sleeping models, through the gateway: the callee is woken inside the caller's request.

The stack (real Envoy + real tritonserver + the activator with its BLS wake route, the real lifecycle; see
tests/harness/gateway.py) is shared by the module's tests. Callers are hand-written Triton python models
(tests/harness/bls.py) that read the callee's name from their request and call ``bls_wake.install`` in their
``initialize``; they are written into Triton's repository and loaded there directly, unpublished, until
Triton model folders are a package kind (then they are published like the rest). Callees are snoozeml
packages, published and asleep.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from controlplane.lifecycle.state import ModelState, UnloadReason
from controlplane.spec import DeploymentSpec, resolve
from harness.bls import SLOW_LOADER_PY, write_caller
from harness.gateway import GRPC_KEY, KEY, Stack, _publish_repeater, _successes, _write_package
from harness.probes import until

pytestmark = pytest.mark.integration

X = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)


def caller(stack: Stack, name: str, mode: str) -> str:
    """A BLS caller loaded in Triton (once per module: later tests find it loaded)."""
    if not stack.triton_ready(name):
        write_caller(stack.triton.model_repository, name, mode)
        stack.loop.run(stack.admin.load(name))
    return name


def asleep(stack: Stack, name: str) -> None:
    status = stack.lifecycle.status(name)
    assert status.state == ModelState.UNLOADED.value, status  # its reason says which path loads it
    assert not stack.triton_ready(name)


def idle_unload(stack: Stack, name: str) -> None:
    """What the sweeper does when the model's keep-alive ran out (this stack's sweeper is slowed down), and only
    once nothing uses the model, as the sweeper's idle unload: a wake-up whose load made the model READY holds it
    until it resumes (seen on two fresh clones: unloaded in that gap, the declared wake's wake-up found its model
    gone and loaded it again, as a request's must)."""
    rec = stack.lifecycle.states.get(name)
    assert rec is not None, name
    until(lambda: rec.in_use == 0 and rec.op is None, f"nothing using '{name}'", 30)
    stack.loop.run(stack.lifecycle.unload(name, reason=UnloadReason.IDLE))
    asleep(stack, name)


def bls_inputs(client_mod: Any, target: str, x: np.ndarray = X, timeout_us: int | None = None) -> list[Any]:
    inputs = [client_mod.InferInput("x", list(x.shape), "FP32"), client_mod.InferInput("target", [1], "BYTES")]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(np.array([target.encode()], dtype=object))
    if timeout_us is not None:
        inputs.append(client_mod.InferInput("timeout_us", [1], "INT64"))
        inputs[2].set_data_from_numpy(np.array([timeout_us], dtype=np.int64))
    return inputs


def http_bls(stack: Stack, name: str, target: str, **kw: Any) -> np.ndarray:
    client = httpclient.InferenceServerClient(stack.gateway.http_url.removeprefix("http://"), network_timeout=60)
    try:
        return client.infer(name, bls_inputs(httpclient, target, **kw), headers=dict(KEY)).as_numpy("y")
    finally:
        client.close()


def grpc_bls(stack: Stack, name: str, target: str, **kw: Any) -> np.ndarray:
    with stack.grpc() as client:
        return client.infer(name, bls_inputs(grpcclient, target, **kw), headers=GRPC_KEY, client_timeout=60).as_numpy(
            "y"
        )


def stream_bls(stack: Stack, name: str, target: str, x: np.ndarray) -> list[Any]:
    """One request to a decoupled caller on a gRPC stream through the gateway: what came back, until the caller's
    last response or an error."""
    results: list[Any] = []
    with stack.grpc() as client:
        client.start_stream(callback=lambda result, error: results.append(error or result), headers=GRPC_KEY)
        client.async_stream_infer(name, bls_inputs(grpcclient, target, x), enable_empty_final_response=True)
        until(
            lambda: any(isinstance(r, InferenceServerException) or r.get_response().parameters.get(
                "triton_final_response").bool_param for r in results),
            lambda: f"the stream's end (so far: {results})",
            timeout=60,
        )  # fmt: skip
        client.stop_stream()
    return results


@pytest.fixture(scope="module")
def slow_loader(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_package(
        tmp_path_factory.mktemp("bls_slow") / "slow",
        SLOW_LOADER_PY,
        params_schema={"load_secs": {"type": "float", "default": 0.0}},
    )


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_bls_call_wakes_the_sleeping_callee_its_request_names(stack: Stack, mode: str) -> None:
    name = caller(stack, f"blsg-caller-{mode}", mode)
    callee = stack.publish(f"blsg-scale-{mode}")
    asleep(stack, callee)
    np.testing.assert_allclose(http_bls(stack, name, callee), X * 3)
    assert stack.lifecycle.status(callee).state == ModelState.READY.value and stack.load_count(callee) == 1
    np.testing.assert_allclose(grpc_bls(stack, name, callee), X * 3)  # awake: no second load
    assert stack.load_count(callee) == 1

    idle_unload(stack, callee)
    np.testing.assert_allclose(grpc_bls(stack, name, callee), X * 3)
    assert stack.load_count(callee) == 2


def test_bls_traffic_is_the_callee_s_use_in_triton_s_statistics(stack: Stack) -> None:
    """The lifecycle reads Triton's last_inference and counts as a model's use: BLS calls must show there."""
    name = caller(stack, "blsg-caller-sync", "sync")
    callee = stack.publish("blsg-scale-stats")
    http_bls(stack, name, callee)  # woken
    before = stack.loop.run(stack.admin.model_stats(callee))
    started_ms = time.time() * 1000
    for _ in range(3):
        http_bls(stack, name, callee)
    _successes(stack, callee, at_least=before.success_count + 3)
    after = stack.loop.run(stack.admin.model_stats(callee))
    assert after.last_inference_ms >= started_ms - 5  # Triton stamps whole milliseconds


@pytest.mark.parametrize("mode", ["stream", "stream-async"])
def test_a_decoupled_bls_call_streams_a_woken_decoupled_callee(stack: Stack, repeater: Path, mode: str) -> None:
    name = caller(stack, f"blsg-caller-{mode}", mode)
    callee = _publish_repeater(stack, repeater, f"blsg-repeater-{mode}")
    asleep(stack, callee)
    x = np.array([3, 0, 1, 1], dtype=np.float32)  # the repeater: 3 responses, x * i

    def streamed() -> list[np.ndarray]:
        results = stream_bls(stack, name, callee, x)
        assert not any(isinstance(r, InferenceServerException) for r in results), results
        return [r.as_numpy("y") for r in results if r.as_numpy("y") is not None]

    for expected_loads in (1, 2):
        ys = streamed()
        assert len(ys) == 3
        for i, y in enumerate(ys, start=1):
            np.testing.assert_allclose(y, x * i)
        assert stack.load_count(callee) == expected_loads
        idle_unload(stack, callee)


def test_the_callee_s_own_error_reaches_the_client_unchanged_and_it_ran_once(stack: Stack, tmp_path: Path) -> None:
    name = caller(stack, "blsg-caller-sync", "sync")
    calls = tmp_path / "calls"
    callee = stack.publish_raiser("blsg-raiser", "the raiser refuses", calls, exception="NegativeCounts")
    asleep(stack, callee)
    with pytest.raises(InferenceServerException) as through_bls:
        http_bls(stack, name, callee)
    assert calls.read_text().splitlines() == ["call"]  # woken, then run once: never again for the wake
    direct = httpclient.InferenceServerClient(stack.gateway.http_url.removeprefix("http://"))
    try:
        inp = httpclient.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(X.reshape(1, 4))
        with pytest.raises(InferenceServerException) as called_directly:
            direct.infer(callee, [inp], headers=dict(KEY))
    finally:
        direct.close()
    assert through_bls.value.message() == called_directly.value.message()
    assert "the raiser refuses" in through_bls.value.message()


def test_a_callee_that_is_not_published_is_an_error_naming_it(stack: Stack) -> None:
    name = caller(stack, "blsg-caller-async", "async")
    with pytest.raises(InferenceServerException) as caught:
        http_bls(stack, name, "blsg-nobody")  # the client waits 60 s; the caller's bound is 60 s as well
    message = caught.value.message()
    assert "could not wake model 'blsg-nobody' for 'blsg-caller-async'" in message
    assert "model 'blsg-nobody' is not published" in message


def test_a_call_that_cannot_reach_the_control_plane_says_so(stack: Stack) -> None:
    name = caller(stack, "blsg-caller-sync", "sync")
    callee = stack.publish("blsg-scale-unreached")
    assert stack.activator.bls_wake is not None
    stack.loop.run(stack.activator.bls_wake.stop())
    try:
        with pytest.raises(InferenceServerException) as caught:
            http_bls(stack, name, callee)
        assert f"could not wake model '{callee}'" in caught.value.message()
        assert "no snoozeml control plane listens at" in caught.value.message()
        asleep(stack, callee)
    finally:
        stack.loop.run(stack.activator.bls_wake.start())
    np.testing.assert_allclose(http_bls(stack, name, callee), X * 3)


def test_the_request_s_own_timeout_bounds_the_wait_for_its_callee(stack: Stack, slow_loader: Path) -> None:
    name = caller(stack, "blsg-caller-sync", "sync")
    callee = "blsg-slow"
    stack.store.publish(
        resolve(DeploymentSpec(id=callee, path=slow_loader, max_batch_size=8, params={"load_secs": 8.0}))
    )
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as caught:
        # gRPC: Triton 2.51's HTTP frontend holds an answer sent on a connection served by the same HTTP thread as
        # a load call until the load returns (measured), and Envoy keeps its connections to Triton open
        grpc_bls(stack, name, callee, timeout_us=1_000_000)
    assert time.monotonic() - started < 6.0  # its 1 s bound, not the callee's 8 s load
    assert f"could not wake model '{callee}'" in caught.value.message()
    assert "is not ready after" in caught.value.message()
    # the load it started goes on: once it is done the same call answers
    until(lambda: stack.lifecycle.status(callee).state == ModelState.READY.value, "the slow callee's load", 60)
    np.testing.assert_allclose(grpc_bls(stack, name, callee, timeout_us=1_000_000), X + 1)


def test_a_model_s_declared_wakes_load_with_it(stack: Stack, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="snoozeml")  # the lifecycle's lines go with a failure's report
    back = stack.publish("blsg-back")
    front = "blsg-front"
    deployment = DeploymentSpec(id=front, path=stack.package, max_batch_size=8, wakes=[back, "blsg-not-published"])
    stack.store.publish(resolve(deployment))
    asleep(stack, front)
    asleep(stack, back)
    client = httpclient.InferenceServerClient(stack.gateway.http_url.removeprefix("http://"))
    try:
        inp = httpclient.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(X.reshape(1, 4))
        client.infer(front, [inp], headers=dict(KEY))  # wakes front, and with it back, never called
        until(lambda: stack.lifecycle.status(back).state == ModelState.READY.value, "the declared callee's load", 60)
        assert stack.load_count(back) == 1
        idle_unload(stack, back)
        client.infer(front, [inp], headers=dict(KEY))  # front is awake: its declared callees are left as they are
        status = stack.lifecycle.status(back)
        assert status.state == ModelState.UNLOADED.value, (status, stack.lifecycle.status(front))
        idle_unload(stack, front)
        client.infer(front, [inp], headers=dict(KEY))  # a wake again: with back again
        until(lambda: stack.lifecycle.status(back).state == ModelState.READY.value, "the declared callee's load", 60)
        assert stack.load_count(back) == 2
    finally:
        client.close()
