"""Unary infers through the gateway: warm ones stay on Envoy, a sleeping model wakes over HTTP, gRPC and
shared memory, its metadata answers while it sleeps.

The stack (real Envoy + real tritonserver + the activator, see tests/harness/gateway.py) is shared by the
module's tests (tests/integration/gateway/conftest.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient

from controlplane.spec import DeploymentSpec, resolve
from harness.gateway import (
    API_KEY,
    GRPC_KEY,
    KEY,
    Stack,
    _successes,
    _x,
)
from harness.probes import grpc_infer, grpc_infer_async, http_infer, until

pytestmark = pytest.mark.integration


def test_warm_inference_stays_on_envoy(stack: Stack):
    name = stack.publish("gw_warm")
    stack.loop.run(stack.lifecycle.ensure_ready(name))
    before = stack.gateway.stats()
    retries_before = before.get("cluster.infer_http.upstream_rq_retry", 0)
    # Delta over this test's own requests: the stack is shared with tests whose wakes are retried.
    grpc_retries_before = before.get("cluster.infer_grpc.upstream_rq_retry", 0)
    x = _x()
    with stack.http() as client:
        np.testing.assert_allclose(http_infer(client, name, x, binary=True, headers=KEY), x * 3)
        np.testing.assert_allclose(http_infer(client, name, x, binary=False, headers=KEY), x * 3)
        np.testing.assert_allclose(http_infer(client, name, x, headers={"Authorization": f"Bearer {API_KEY}"}), x * 3)
        assert client.is_server_live() and client.is_server_ready()  # health: Triton, no key needed
    with stack.grpc() as client:
        np.testing.assert_allclose(grpc_infer(client, name, x, headers=GRPC_KEY), x * 3)
        np.testing.assert_allclose(grpc_infer(client, name, x, headers={"authorization": f"Bearer {API_KEY}"}), x * 3)
    stats = stack.gateway.stats()
    assert stats.get("cluster.infer_http.upstream_rq_retry", 0) == retries_before
    assert stats.get("cluster.infer_grpc.upstream_rq_retry", 0) == grpc_retries_before
    assert "envoy_cluster_upstream_rq_retry" in httpx.get(stack.gateway.prometheus_url).text
    # The listeners count answers by class; the router keeps no per-code cluster series (dynamic_stats off).
    assert stats["http.kserve_http.downstream_rq_2xx"] > before.get("http.kserve_http.downstream_rq_2xx", 0)
    assert stats["http.kserve_grpc.downstream_rq_2xx"] > before.get("http.kserve_grpc.downstream_rq_2xx", 0)
    # (a wake's retry, in another test, counts its answer under cluster.<name>.retry.*: not a per-code series)
    per_code = [k for k in stats if k.startswith("cluster.infer_") and ".upstream_rq_2" in k and ".retry." not in k]
    assert not per_code, sorted(stats)


def _lua_runs(stack: Stack) -> dict[str, int]:
    """Envoy's count of Lua runs, per listener and the infer_http cluster's upstream chain, and of filters a
    composite filter created (the shape hint, the dead-stub marker)."""
    stats = stack.gateway.stats()
    return {k: v for k, v in stats.items() if k.endswith(("lua.executions", "composite.filter_delegation_success"))}


def test_a_warm_unary_request_meets_no_lua(stack: Stack):
    """A unary infer to a loaded model: no Lua runs for it, over HTTP (its size in the headers) or gRPC (no
    content-length; its retry buffer takes any message): the wake filters are off on its route, the shape hint
    and the dead-stub marker are created only for a 400 / INVALID_ARGUMENT / 500."""
    name = stack.publish("gw_no_lua")
    stack.loop.run(stack.lifecycle.ensure_ready(name))
    x = _x()
    before = _lua_runs(stack)
    with stack.http() as client:
        for binary in (True, False):
            np.testing.assert_allclose(http_infer(client, name, x, binary=binary, headers=KEY), x * 3)
    r = httpx.post(f"{stack.gateway.http_url}/v2/models/{name}/generate", json={"x": [1.0]}, headers=KEY)
    assert r.status_code == 200, r.text
    assert _lua_runs(stack) == before
    with stack.grpc() as client:
        for _ in range(3):
            np.testing.assert_allclose(grpc_infer(client, name, x, headers=GRPC_KEY), x * 3)
    assert _lua_runs(stack) == before


def test_sleeping_model_wakes_over_http(stack: Stack):
    name = stack.publish("gw_sleep_http")
    assert not stack.triton_ready(name)
    x = _x(3)
    with stack.http() as client:
        np.testing.assert_allclose(http_infer(client, name, x, headers=KEY), x * 3)
    assert stack.triton_ready(name) and stack.load_count(name) == 1
    assert stack.gateway.stats()["cluster.infer_http.upstream_rq_retry"] >= 1
    # Put back to sleep: the next request wakes it again (non-binary JSON body this time).
    stack.loop.run(stack.lifecycle.unload(name))
    with stack.http() as client:
        np.testing.assert_allclose(http_infer(client, name, x, binary=False, headers=KEY), x * 3)
    assert stack.load_count(name) == 2


def test_sleeping_model_wakes_over_grpc(stack: Stack):
    name = stack.publish("gw_sleep_grpc")
    x = _x(1)
    with stack.grpc() as client:
        np.testing.assert_allclose(grpc_infer(client, name, x, headers=GRPC_KEY), x * 3)
    assert stack.triton_ready(name) and stack.load_count(name) == 1
    assert stack.gateway.stats()["cluster.infer_grpc.upstream_rq_retry"] >= 1


async def test_grpc_aio_client_wakes_and_single_flight(stack: Stack):
    name = stack.publish("gw_sleep_aio")
    x = _x(2)
    async with grpcaio.InferenceServerClient(stack.gateway.grpc_url) as client:
        assert await client.is_model_ready(name, headers=GRPC_KEY)
        results = await asyncio.gather(*(grpc_infer_async(client, name, x, headers=GRPC_KEY) for _ in range(20)))
    for y in results:
        np.testing.assert_allclose(y, x * 3)
    assert stack.load_count(name) == 1


def test_readiness_metadata_config_of_a_sleeping_model(stack: Stack):
    name = stack.publish("gw_meta")
    awake = stack.publish("gw_meta_awake")
    stack.loop.run(stack.lifecycle.ensure_ready(awake))
    with stack.http() as h, stack.grpc() as g:
        assert h.is_model_ready(name, headers=KEY) and g.is_model_ready(name, headers=GRPC_KEY)
        meta_http = h.get_model_metadata(name, headers=KEY)
        meta_grpc = g.get_model_metadata(name, headers=GRPC_KEY, as_json=True)
        config_http = h.get_model_config(name, headers=KEY)
        config_grpc = g.get_model_config(name, headers=GRPC_KEY).config
        index = {e["name"]: e for e in h.get_model_repository_index(headers=KEY)}
        assert not stack.triton_ready(name)  # none of this woke the model
        assert index[name]["state"] == "UNAVAILABLE" and index[awake]["state"] == "READY"

        assert meta_http == {
            "name": name,
            "versions": ["1"],
            "platform": "python",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, -1]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, -1]}],
        }
        assert meta_grpc["inputs"][0]["shape"] == ["-1", "-1"] and meta_grpc["platform"] == "python"
        assert config_http["name"] == name and config_http["max_batch_size"] == 8
        assert config_grpc.name == name and config_grpc.backend == "python" and config_grpc.max_batch_size == 8

        # Once awake the answers are Triton's own, and the metadata is the same as while asleep.
        stack.loop.run(stack.lifecycle.ensure_ready(name))
        triton = httpclient.InferenceServerClient(stack.triton.http_url.removeprefix("http://"))
        assert triton.get_model_metadata(name) == meta_http == h.get_model_metadata(name, headers=KEY)
        assert h.get_model_config(name, headers=KEY) == triton.get_model_config(name)
        assert g.get_model_config(name, headers=GRPC_KEY).config.name == name
        assert h.is_model_ready(name, headers=KEY) and g.is_model_ready(name, headers=GRPC_KEY)


SCALAR_ITEMS_PY = """
import numpy as np


class Model:
    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        words = inputs["word"]
        lengths = [len(w.decode("utf-8")) for w in words.reshape(-1)]
        return {"code": np.array(lengths, dtype=np.int64).reshape(words.shape)}
"""


def test_the_metadata_of_a_sleeping_model_with_items_of_rank_0_is_tritons(stack: Stack, tmp_path: Path):
    """An item of rank 0 (``dims: []``: one string per item, as an ONNX LabelEncoder's [N] input) is ``dims: [1]``
    in the config, reshaped to ``[]``: Triton's metadata says ``[-1, 1]``, and so does the gateway's while the model
    sleeps (it said ``[-1]``, and a client that built its request from it was refused; found by an outside user's
    LabelEncoder). A request of that shape wakes the model and is answered."""
    folder = tmp_path / "scalar-items"
    folder.mkdir()
    (folder / "snooze_model.py").write_text(SCALAR_ITEMS_PY)
    manifest = {"inputs": [{"name": "word", "datatype": "BYTES", "dims": []}],
                "outputs": [{"name": "code", "datatype": "INT64", "dims": []}]}  # fmt: skip
    (folder / "snooze_model.json").write_text(json.dumps(manifest))
    name = "gw_scalar_items"
    stack.store.publish(resolve(DeploymentSpec(id=name, path=folder, max_batch_size=8)))
    with stack.http() as h, stack.grpc() as g:
        asleep = h.get_model_metadata(name, headers=KEY)
        asleep_grpc = g.get_model_metadata(name, headers=GRPC_KEY, as_json=True)
        assert not stack.triton_ready(name)
        assert [t["shape"] for t in (*asleep["inputs"], *asleep["outputs"])] == [[-1, 1], [-1, 1]]
        assert asleep_grpc["inputs"][0]["shape"] == ["-1", "1"]
        words = np.array([[b"apple"], ["Zürich".encode()]], dtype=object)  # the shape the metadata gives: [n, 1]
        given = httpclient.InferInput("word", list(words.shape), "BYTES")
        given.set_data_from_numpy(words)
        answer = h.infer(name, [given], headers=dict(KEY)).as_numpy("code")
        assert answer.reshape(-1).tolist() == [5, 6]
        triton = httpclient.InferenceServerClient(stack.triton.http_url.removeprefix("http://"))
        assert triton.get_model_metadata(name) == asleep == h.get_model_metadata(name, headers=KEY)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_64_mib_request_wakes_a_sleeping_model(stack: Stack, protocol: str):
    """A body far over ``wake_buffer_bytes`` wakes its model and runs once, and the model is held only while
    the request runs. HTTP: the wake filter (the body is sent once); gRPC, whose retry buffer takes any message
    Triton accepts: the retry (Triton's 'unknown model', then the activator)."""
    name = stack.publish(f"gw_big_{protocol}")
    big = np.ones((1, 64 * 1024 * 1024 // 4), dtype=np.float32)
    retries = stack.gateway.stats().get(f"cluster.infer_{protocol}.upstream_rq_retry", 0)
    with stack.http() as h, stack.grpc() as g:
        y = http_infer(h, name, big, headers=KEY) if protocol == "http" else grpc_infer(g, name, big, headers=GRPC_KEY)
    assert y.shape == big.shape and float(y[0, 0]) == 3.0 and float(y[0, -1]) == 3.0
    assert stack.triton_ready(name) and stack.load_count(name) == 1
    resent = stack.gateway.stats().get(f"cluster.infer_{protocol}.upstream_rq_retry", 0) - retries
    assert resent == (0 if protocol == "http" else 1)
    assert _successes(stack, name, 2) == 2  # it ran once (Triton also counts the load's warm-up inference)
    until(lambda: stack.activator.holds.held(name) == 0, "the hold's release once the request ended")


def test_system_shared_memory_infer_wakes_a_sleeping_model(stack: Stack):
    """Triton's shared-memory example through the gateway: the region is registered with Triton (the
    default route), the request names it, and a sleeping model is woken by the retry path."""
    import tritonclient.utils.shared_memory as shm

    name = stack.publish("gw_shm")
    x = _x(2)
    region = shm.create_shared_memory_region("gw_shm_in", "/gw_shm_in", x.nbytes)
    try:
        shm.set_shared_memory_region(region, [x])
        with stack.http() as h:
            h.unregister_system_shared_memory("gw_shm_in", headers=KEY)
            h.register_system_shared_memory("gw_shm_in", "/gw_shm_in", x.nbytes, headers=KEY)
            inp = httpclient.InferInput("x", list(x.shape), "FP32")
            inp.set_shared_memory("gw_shm_in", x.nbytes)
            y = h.infer(name, [inp], headers=dict(KEY)).as_numpy("y")
            h.unregister_system_shared_memory("gw_shm_in", headers=KEY)
        np.testing.assert_allclose(y, x * 3)
        assert stack.load_count(name) == 1
    finally:
        shm.destroy_shared_memory_region(region)
