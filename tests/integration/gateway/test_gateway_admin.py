"""The repository API, config overrides, dead-stub recovery and the closed gate through the gateway.

The stack (real Envoy + real tritonserver + the activator, see tests/harness/gateway.py) is shared by the
module's tests (tests/integration/gateway/conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from harness.gateway import (
    ADMIN_KEY,
    GRPC_KEY,
    KEY,
    Stack,
    _successes,
    _x,
)
from harness.probes import grpc_infer, http_infer, until

pytestmark = pytest.mark.integration


def test_repository_load_unload_need_the_admin_scope(stack: Stack):
    # A loaded model for the unauthenticated unload to leave alone; this module's stack has none before.
    stack.loop.run(stack.lifecycle.ensure_ready(stack.publish("gw_warm")))
    name = stack.publish("gw_admin")
    with stack.http() as h, stack.grpc() as g:
        with pytest.raises(InferenceServerException) as info:
            h.load_model(name, headers=KEY)
        assert info.value.status() == "403" and "'admin' scope" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            g.load_model(name, headers=GRPC_KEY)
        assert info.value.status() == "StatusCode.PERMISSION_DENIED"
        with pytest.raises(InferenceServerException) as info:
            h.unload_model("gw_warm")
        assert info.value.status() == "401"
        assert not stack.triton_ready(name) and stack.triton_ready("gw_warm")

        h.load_model(name, headers={"X-API-Key": ADMIN_KEY})
        assert stack.triton_ready(name)
        g.unload_model(name, headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert not stack.triton_ready(name)
        with pytest.raises(InferenceServerException, match="not accepted through the gateway"):
            h.load_model(name, headers={"X-API-Key": ADMIN_KEY}, config="{}", files={"file:1/model.py": b"x"})


def test_repository_unload_and_load_answer_as_triton_does(stack: Stack):
    """What Triton's model-control client examples check: a model a client unloaded through the repository API
    is not ready (a sleeping model otherwise is) until it is loaded again, by a repository load or a request that
    wakes it; a load of a model the repository lacks fails in Triton's words ("failed to load", 500 / INTERNAL)."""
    name = stack.publish("gw_control")
    admin, grpc_admin = {"X-API-Key": ADMIN_KEY}, {"x-api-key": ADMIN_KEY}
    with stack.http() as h, stack.grpc() as g:
        assert h.is_model_ready(name, headers=KEY) and g.is_model_ready(name, headers=GRPC_KEY)  # asleep: ready
        g.load_model(name, headers=grpc_admin)
        g.unload_model(name, headers=grpc_admin)
        assert not g.is_model_ready(name, headers=GRPC_KEY) and not h.is_model_ready(name, headers=KEY)
        http_infer(h, name, _x(), headers=KEY)  # a request still wakes it, and then it is ready again
        assert g.is_model_ready(name, headers=GRPC_KEY) and h.is_model_ready(name, headers=KEY)
        h.unload_model(name, headers=admin)
        assert not h.is_model_ready(name, headers=KEY)
        h.load_model(name, headers=admin)
        assert h.is_model_ready(name, headers=KEY) and stack.triton_ready(name)
        words = "failed to load 'gw_nope', failed to poll from model repository"
        with pytest.raises(InferenceServerException) as info:
            h.load_model("gw_nope", headers=admin)
        assert info.value.status() == "500" and info.value.message().startswith(words)
        assert "'gw_nope' is not published" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            g.load_model("gw_nope", headers=grpc_admin)
        assert info.value.status() == "StatusCode.INTERNAL" and info.value.message().startswith(words)
        # Triton 2.51 aborts on a load whose file parameter's name is longer than NAME_MAX (measured): load
        # parameters never reach Triton through the gateway. Triton's newest model-control example sends one and
        # expects INTERNAL, "failed to poll from model repository", then a live server.
        refused = f"failed to load '{name}', failed to poll from model repository: snoozeml: "
        for client, headers, status in ((g, grpc_admin, "StatusCode.INTERNAL"), (h, admin, "500")):
            with pytest.raises(InferenceServerException, match="not accepted through the gateway") as info:
                client.load_model(name, headers=headers, config="{}", files={"file:" + "A" * 256: b"a"})
            assert info.value.status() == status and info.value.message().startswith(refused), info.value
            assert client.is_server_live() and stack.triton_ready(name)


def test_a_clients_config_override_holds_through_sleep_and_wake(stack: Stack):
    """What Triton's model-control examples do: a repository load with a config override (max_batch_size 8 ->
    16). It holds while the model sleeps (the activator's config answer) and through the wake a request makes,
    until a load without one; a malformed override (Triton 2.51's words and status) and one that changes a field
    snoozeml owns are refused and change nothing."""
    name = stack.publish("gw_override")
    admin, grpc_admin = {"X-API-Key": ADMIN_KEY}, {"x-api-key": ADMIN_KEY}

    def batch_sizes() -> tuple[int, int]:
        return h.get_model_config(name, headers=KEY)["max_batch_size"], g.get_model_config(
            name, headers=GRPC_KEY
        ).config.max_batch_size

    with stack.http() as h, stack.grpc() as g:
        assert batch_sizes() == (8, 8)
        h.load_model(name, headers=admin, config='{"max_batch_size":"16"}')
        assert stack.triton_ready(name) and batch_sizes() == (16, 16)

        stack.loop.run(stack.lifecycle.unload(name, reason="idle"))  # asleep, as after an idle unload
        assert not stack.triton_ready(name) and batch_sizes() == (16, 16)
        loads = stack.load_count(name)
        y = grpc_infer(g, name, _x(12), headers=GRPC_KEY)  # wakes it; 12 rows: more than the published max_batch_size
        assert y.shape == (12, 4) and stack.load_count(name) == loads + 1 and batch_sizes() == (16, 16)

        malformed = '"parameters": {"config": {{"max_batch_size": "16"}}}'  # the examples' wrong format
        words = f"failed to load '{name}', failed to poll from model repository: snoozeml: "
        for client, headers, status in ((h, admin, "500"), (g, grpc_admin, "StatusCode.INTERNAL")):
            with pytest.raises(InferenceServerException) as info:
                client.load_model(name, headers=headers, config=malformed)
            assert info.value.status() == status and info.value.message().startswith(words)
            assert f"override for model '{name}' is not JSON" in info.value.message()
            with pytest.raises(InferenceServerException) as info:
                client.load_model(name, headers=headers, config='{"backend": "onnxruntime"}')
            assert info.value.message().startswith(f"load failed for model '{name}': ")
            assert "changes 'backend'" in info.value.message()
        assert stack.load_count(name) == loads + 1 and batch_sizes() == (16, 16)

        g.load_model(name, headers=grpc_admin, config='{"max_batch_size": 4}')  # a new one replaces it
        assert batch_sizes() == (4, 4)
        h.load_model(name, headers=admin)  # a load without an override: the published config again
        assert stack.triton_ready(name) and batch_sizes() == (8, 8)
        triton = httpclient.InferenceServerClient(stack.triton.http_url.removeprefix("http://"))
        assert triton.get_model_config(name)["max_batch_size"] == 8
        assert "snooze_config_override" not in triton.get_model_config(name)["parameters"]


def test_dead_stub_is_recovered_through_the_activator(stack: Stack):
    name = stack.publish("gw_stub")
    stack.loop.run(stack.lifecycle.ensure_ready(name))
    x = _x()
    for pid in stack.triton.stub_pids(name):
        os.kill(pid, signal.SIGKILL)
    # Neither request reached the dead process (the journal says so): both are served after recovery.
    with stack.grpc() as g:  # gRPC: Envoy matches grpc-message and retries to the activator
        np.testing.assert_allclose(grpc_infer(g, name, x, headers=GRPC_KEY), x * 3)
    # counted as the recovery's op ends, a few awaits after the model is READY and the request was sent on
    until(lambda: stack.recoveries(name) == 1, "one recovery counted", timeout=10)

    for pid in stack.triton.stub_pids(name):
        os.kill(pid, signal.SIGKILL)
    with stack.http() as h:  # HTTP: a Lua filter marks the dead stub's 500 for the same retry
        np.testing.assert_allclose(http_infer(h, name, x, headers=KEY), x * 3)
    until(lambda: stack.recoveries(name) == 2, "a second recovery counted", timeout=10)


def test_closed_gate_refuses_on_open_connections_then_opens(stack: Stack):
    """The snapshot gate (``close_gate``): requests on HTTP and gRPC connections opened before it closed,
    for a loaded and a sleeping model, get 503 / UNAVAILABLE and reach neither Triton nor the activator."""
    warm, asleep = stack.publish("gw_gate"), stack.publish("gw_gate_asleep")
    stack.loop.run(stack.lifecycle.ensure_ready(warm))
    loaded = _successes(stack, warm, at_least=1)  # the load's own warm-up inference
    x = _x()
    with stack.http() as h, stack.grpc() as g, httpx.Client(base_url=stack.gateway.http_url, headers=KEY) as raw:
        np.testing.assert_allclose(http_infer(h, warm, x, headers=KEY), x * 3)
        np.testing.assert_allclose(grpc_infer(g, warm, x, headers=GRPC_KEY), x * 3)
        assert raw.get(f"/v2/models/{warm}/ready").status_code == 200  # a keep-alive connection, now idle
        # Triton counts a request just after answering it: wait for both (a count of 2 was once read as
        # warm-up + the first request, with the second counted later).
        served = _successes(stack, warm, at_least=loaded + 2)
        stack.gateway.close_gate()
        try:
            assert stack.gateway.gate_closed()
            for model in (warm, asleep):
                with pytest.raises(InferenceServerException) as info:
                    http_infer(h, model, x, headers=KEY)
                assert info.value.status() == "503" and "snapshot" in info.value.message()
                with pytest.raises(InferenceServerException) as info:
                    grpc_infer(g, model, x, headers=GRPC_KEY)
                assert info.value.status() == "StatusCode.UNAVAILABLE" and "snapshot" in info.value.message()
            answer = raw.post(f"/v2/models/{warm}/infer", json={"inputs": []})
            assert answer.status_code == 503 and "snapshot" in answer.json()["error"]
            # Streams and large bodies too: the wake filter wakes nothing behind a closed gate.
            answer = raw.post(f"/v2/models/{asleep}/generate_stream", json={"x": [1.0]})
            assert answer.status_code == 503 and "snapshot" in answer.json()["error"]
            errors: list[Any] = []
            g.start_stream(callback=lambda result, error: errors.append(error), headers=GRPC_KEY)
            inp = grpcclient.InferInput("x", [1, 4], "FP32")
            inp.set_data_from_numpy(_x(1))
            with contextlib.suppress(InferenceServerException):  # the stream may be answered before the request
                g.async_stream_infer(asleep, [inp])
            until(lambda: errors, "the closed gate's answer on the stream")
            g.stop_stream()
            assert errors[0].status() == "StatusCode.UNAVAILABLE" and "snapshot" in errors[0].message()
            time.sleep(0.5)
            assert _successes(stack, warm) == served
            assert not stack.triton_ready(asleep)
        finally:
            stack.gateway.open_gate()
        assert not stack.gateway.gate_closed()
        np.testing.assert_allclose(http_infer(h, warm, x, headers=KEY), x * 3)
        np.testing.assert_allclose(grpc_infer(g, warm, x, headers=GRPC_KEY), x * 3)
        assert _successes(stack, warm, at_least=served + 2) == served + 2
