"""The gateway end to end: real Envoy + real tritonserver + the activator, with standard tritonclient clients.

The activator runs in its own event loop in a background thread (as it runs in the control plane's
loop), so the tests can use the blocking ``tritonclient.http`` / ``tritonclient.grpc`` clients as
users do. The waker is the real ``LifecycleManager``; its sweeper is slowed down so that what these
tests see (wake-ups, dead-stub recovery) comes through the gateway's retry path.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import textwrap
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from controlplane.gateway.activator import Activator
from controlplane.gateway.envoy import ApiKey, EnvoyGateway, GatewayError, Upstream, render_bootstrap
from controlplane.lifecycle import LifecycleManager
from controlplane.render import embedded_target
from controlplane.settings import Settings
from controlplane.spec import DeploymentSpec, SequenceSpec, resolve
from controlplane.store import ModelStore
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.launcher import EmbeddedTriton, free_port
from tests.serve_harness import until

pytestmark = pytest.mark.integration

API_KEY = "infer-key-123"
ADMIN_KEY = "admin-key-456"
WAKE_BUFFER = 256 * 1024
T = TypeVar("T")

MODEL_PY = """
import numpy as np


class Model:
    def __init__(self, scale=2.0):
        self.scale = scale

    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        return {"y": (inputs["x"] * self.scale).astype(np.float32)}
"""


class LoopThread:
    """An asyncio loop in a daemon thread: the activator's home, like the control plane's loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Stack:
    triton: EmbeddedTriton
    store: ModelStore
    lifecycle: LifecycleManager
    admin: TritonAdminClient
    gateway: EnvoyGateway
    loop: LoopThread
    package: Path
    raiser: Path
    activator: Activator

    def publish(self, name: str) -> str:
        self.store.publish(resolve(DeploymentSpec(id=name, path=self.package, max_batch_size=8)))
        return name

    def triton_ready(self, name: str) -> bool:
        return self.loop.run(self.admin.model_ready(name))

    def load_count(self, name: str) -> int:
        return self.lifecycle.status(name).load_count

    def recoveries(self, name: str) -> float:
        labels = {"model": name, "cause": "dead_stub"}
        return self.lifecycle.metrics.registry.get_sample_value("snooze_recoveries_total", labels) or 0

    def publish_raiser(self, name: str, message: str, calls: Path, exception: str = "RuntimeError",
                       worker: str = "in-stub") -> str:  # fmt: skip
        """A model whose predict logs its call to ``calls`` and raises ``exception(message)``."""
        params = {"message": message, "calls": str(calls), "exception": exception}
        spec = DeploymentSpec(id=name, path=self.raiser, max_batch_size=8, params=params, worker=worker)
        self.store.publish(resolve(spec))
        return name

    def http(self) -> httpclient.InferenceServerClient:
        return httpclient.InferenceServerClient(self.gateway.http_url.removeprefix("http://"))

    def grpc(self) -> grpcclient.InferenceServerClient:
        return grpcclient.InferenceServerClient(self.gateway.grpc_url)


def _write_package(folder: Path, source: str, **manifest: Any) -> Path:
    """A custom package with x -> y, FP32 [-1]: ``source`` as snooze_model.py, ``manifest`` added."""
    folder.mkdir()
    (folder / "snooze_model.py").write_text(textwrap.dedent(source))
    tensor = {"datatype": "FP32", "dims": [-1]}
    manifest = {"inputs": [{"name": "x", **tensor}], "outputs": [{"name": "y", **tensor}], **manifest}
    (folder / "snooze_model.json").write_text(json.dumps(manifest))
    return folder


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_package(
        tmp_path_factory.mktemp("gw_package") / "scale",
        MODEL_PY,
        params={"scale": 3.0},
        params_schema={"scale": {"type": "float", "default": 2.0}},
    )


RAISER_PY = """
class _Refusal(ValueError):
    snooze_error = "invalid_input"  # the duck-typed refusal (docs/packages.md), on a base class


class NegativeCounts(_Refusal):
    pass


class Model:
    def __init__(self, message="", calls="", exception="RuntimeError"):
        self.message, self.calls, self.exception = message, calls, exception

    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        with open(self.calls, "a") as f:
            f.write("call\\n")
        kinds = {"RuntimeError": RuntimeError, "SystemExit": SystemExit, "ValueError": ValueError,
                 "NegativeCounts": NegativeCounts}
        raise kinds[self.exception](self.message)
"""


@pytest.fixture(scope="module")
def raiser(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A package whose predict raises its ``message`` param, logging each call to its ``calls`` file."""
    return _write_package(
        tmp_path_factory.mktemp("gw_raiser") / "raiser",
        RAISER_PY,
        warmup=False,  # its predict always raises: with the load's warm-up on, no load would succeed
        params_schema={
            "message": {"type": "str", "default": ""},
            "calls": {"type": "str", "default": ""},
            "exception": {"type": "str", "default": "RuntimeError"},
        },
    )


@pytest.fixture(scope="module")
def stack(
    embedded_triton: EmbeddedTriton, package: Path, raiser: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("gateway")
    settings = Settings(
        work_dir=work,
        http_port=free_port(),
        grpc_port=free_port(),
        api_keys=[API_KEY],
        admin_keys=[ADMIN_KEY],
        wake_buffer_bytes=WAKE_BUFFER,
        sweep_interval_secs=3600,
    )
    store = ModelStore(embedded_triton.model_repository, embedded_target())
    loop = LoopThread()
    admin = loop.run(_admin(embedded_triton))
    lifecycle = LifecycleManager(settings, store, admin, triton_process=embedded_triton)
    loop.run(lifecycle.start())
    activator = Activator(
        lifecycle, store, settings, triton_http_url=embedded_triton.http_url, triton_grpc_url=embedded_triton.grpc_url
    )
    loop.run(activator.start())
    gateway = EnvoyGateway(
        settings,
        triton_http=embedded_triton.http_url,
        triton_grpc=embedded_triton.grpc_url,
        activator_http=activator.http_address,
        activator_grpc=activator.grpc_address,
    )
    try:
        gateway.start()
        yield Stack(embedded_triton, store, lifecycle, admin, gateway, loop, package, raiser, activator)
    finally:
        gateway.stop()
        loop.run(activator.stop())
        loop.run(lifecycle.stop())
        loop.run(admin.aclose())
        loop.close()


async def _admin(triton: EmbeddedTriton) -> TritonAdminClient:
    return TritonAdminClient(triton.http_url, triton.metrics_url, timeout=60)


KEY = {"X-API-Key": API_KEY}
GRPC_KEY = {"x-api-key": API_KEY}


def _x(rows: int = 2) -> np.ndarray:
    return np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)


def http_infer(client: httpclient.InferenceServerClient, name: str, x: np.ndarray, *, binary: bool = True,
               headers: dict[str, str] | None = None) -> np.ndarray:  # fmt: skip
    inp = httpclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("y", binary_data=binary)
    # A copy: tritonclient.http adds Inference-Header-Content-Length to the dict it is given.
    headers = dict(headers if headers is not None else KEY)
    return client.infer(name, [inp], outputs=[out], headers=headers).as_numpy("y")


def grpc_infer(client: grpcclient.InferenceServerClient, name: str, x: np.ndarray,
               headers: dict[str, str] | None = None) -> np.ndarray:  # fmt: skip
    inp = grpcclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(name, [inp], headers=headers if headers is not None else GRPC_KEY).as_numpy("y")


def test_warm_inference_stays_on_envoy(stack: Stack):
    name = stack.publish("gw_warm")
    stack.loop.run(stack.lifecycle.ensure_ready(name))
    retries_before = stack.gateway.stats().get("cluster.infer_http.upstream_rq_retry", 0)
    x = _x()
    with stack.http() as client:
        np.testing.assert_allclose(http_infer(client, name, x, binary=True), x * 3)
        np.testing.assert_allclose(http_infer(client, name, x, binary=False), x * 3)
        np.testing.assert_allclose(http_infer(client, name, x, headers={"Authorization": f"Bearer {API_KEY}"}), x * 3)
        assert client.is_server_live() and client.is_server_ready()  # health: Triton, no key needed
    with stack.grpc() as client:
        np.testing.assert_allclose(grpc_infer(client, name, x), x * 3)
        np.testing.assert_allclose(grpc_infer(client, name, x, {"authorization": f"Bearer {API_KEY}"}), x * 3)
    stats = stack.gateway.stats()
    assert stats.get("cluster.infer_http.upstream_rq_retry", 0) == retries_before
    assert stats.get("cluster.infer_grpc.upstream_rq_retry", 0) == 0
    assert "envoy_cluster_upstream_rq_retry" in httpx.get(stack.gateway.prometheus_url).text


def _lua_runs(stack: Stack) -> dict[str, int]:
    """Envoy's count of Lua runs, per listener and the infer_http cluster's upstream chain, and of filters a
    composite filter created (the shape hint, the dead-stub marker)."""
    stats = stack.gateway.stats()
    return {k: v for k, v in stats.items() if k.endswith(("lua.executions", "composite.filter_delegation_success"))}


def test_a_warm_unary_request_meets_no_lua(stack: Stack):
    """A unary infer to a loaded model whose size the headers tell: no Lua runs for it (the wake filters are off
    on its route; the shape hint and the dead-stub marker are created only for a 400 / INVALID_ARGUMENT / 500).
    gRPC carries no content-length: there the first wake stage reads the message's 5-byte frame header, once."""
    name = stack.publish("gw_no_lua")
    stack.loop.run(stack.lifecycle.ensure_ready(name))
    x = _x()
    before = _lua_runs(stack)
    with stack.http() as client:
        for binary in (True, False):
            np.testing.assert_allclose(http_infer(client, name, x, binary=binary), x * 3)
    r = httpx.post(f"{stack.gateway.http_url}/v2/models/{name}/generate", json={"x": [1.0]}, headers=KEY)
    assert r.status_code == 200, r.text
    assert _lua_runs(stack) == before
    with stack.grpc() as client:
        for _ in range(3):
            np.testing.assert_allclose(grpc_infer(client, name, x), x * 3)
    after = _lua_runs(stack)
    assert after.pop("http.kserve_grpc.lua.executions") == before.pop("http.kserve_grpc.lua.executions") + 3
    assert after == before


def test_sleeping_model_wakes_over_http(stack: Stack):
    name = stack.publish("gw_sleep_http")
    assert not stack.triton_ready(name)
    x = _x(3)
    with stack.http() as client:
        np.testing.assert_allclose(http_infer(client, name, x), x * 3)
    assert stack.triton_ready(name) and stack.load_count(name) == 1
    assert stack.gateway.stats()["cluster.infer_http.upstream_rq_retry"] >= 1
    # Put back to sleep: the next request wakes it again (non-binary JSON body this time).
    stack.loop.run(stack.lifecycle.unload(name))
    with stack.http() as client:
        np.testing.assert_allclose(http_infer(client, name, x, binary=False), x * 3)
    assert stack.load_count(name) == 2


def test_sleeping_model_wakes_over_grpc(stack: Stack):
    name = stack.publish("gw_sleep_grpc")
    x = _x(1)
    with stack.grpc() as client:
        np.testing.assert_allclose(grpc_infer(client, name, x), x * 3)
    assert stack.triton_ready(name) and stack.load_count(name) == 1
    assert stack.gateway.stats()["cluster.infer_grpc.upstream_rq_retry"] >= 1


async def test_grpc_aio_client_wakes_and_single_flight(stack: Stack):
    name = stack.publish("gw_sleep_aio")
    x = _x(2)
    inp = grpcaio.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    async with grpcaio.InferenceServerClient(stack.gateway.grpc_url) as client:
        assert await client.is_model_ready(name, headers=GRPC_KEY)
        results = await asyncio.gather(*(client.infer(name, [inp], headers=GRPC_KEY) for _ in range(20)))
    for r in results:
        np.testing.assert_allclose(r.as_numpy("y"), x * 3)
    assert stack.load_count(name) == 1


def test_readiness_metadata_config_of_a_sleeping_model(stack: Stack):
    name = stack.publish("gw_meta")
    with stack.http() as h, stack.grpc() as g:
        assert h.is_model_ready(name, headers=KEY) and g.is_model_ready(name, headers=GRPC_KEY)
        meta_http = h.get_model_metadata(name, headers=KEY)
        meta_grpc = g.get_model_metadata(name, headers=GRPC_KEY, as_json=True)
        config_http = h.get_model_config(name, headers=KEY)
        config_grpc = g.get_model_config(name, headers=GRPC_KEY).config
        index = {e["name"]: e for e in h.get_model_repository_index(headers=KEY)}
        assert not stack.triton_ready(name)  # none of this woke the model
        assert index[name]["state"] == "UNAVAILABLE" and index["gw_warm"]["state"] == "READY"

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


def _stream_error(g: grpcclient.InferenceServerClient, model: str) -> str:
    """The error a stream's first request for ``model`` gets, through the stream's callback."""
    errors: list[Any] = []
    g.start_stream(callback=lambda result, error: errors.append(error), headers=GRPC_KEY)
    inp = grpcclient.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(_x(1))
    g.async_stream_infer(model, [inp])
    until(lambda: errors, "the stream's error")
    g.stop_stream()
    assert errors[0] is not None, "the stream answered without an error"
    return errors[0].message()


def _unknown_in_tritons_words(calls: Any, headers: dict[str, str], status: str, known: str) -> None:
    """Metadata and config calls for an unknown model, and for a version the known model lacks."""
    for call in calls:
        with pytest.raises(InferenceServerException) as info:
            call("gw_nope", headers=headers)
        assert info.value.status() == status
        assert info.value.message().startswith("Request for unknown model: 'gw_nope' is not found")
        with pytest.raises(InferenceServerException) as info:
            call(known, "7", headers=headers)
        assert info.value.message().startswith(f"Request for unknown model: '{known}' version 7 is not found")


def test_unknown_model_answers_in_tritons_words(stack: Stack):
    """Triton's own words and status first (clients check ``startswith("Request for unknown model")``),
    snoozeml's reason after, on every call that names a model, over HTTP and gRPC."""
    nope = "Request for unknown model: 'gw_nope' is not found"
    known = stack.publish("gw_words")
    with stack.http() as h:
        with pytest.raises(InferenceServerException) as info:
            http_infer(h, "gw_nope", _x())
        assert info.value.status() == "404" and info.value.message().startswith(nope)
        assert "'gw_nope' is not published (fix: list models with `snoozectl status`)" in info.value.message()
        _unknown_in_tritons_words((h.get_model_metadata, h.get_model_config), KEY, "404", known)
        assert not h.is_model_ready("gw_nope", headers=KEY)
    for path in ("infer", "versions/1/infer", "generate", "generate_stream"):
        raw = httpx.post(f"{stack.gateway.http_url}/v2/models/gw_nope/{path}", json={"inputs": []}, headers=KEY)
        assert raw.status_code == 404 and raw.json()["error"].startswith(nope), (path, raw.text)
    ready = httpx.get(f"{stack.gateway.http_url}/v2/models/gw_nope/ready", headers=KEY)
    assert ready.status_code == 400 and ready.json()["error"].startswith("Model version not ready")
    with stack.grpc() as g:
        with pytest.raises(InferenceServerException) as info:
            grpc_infer(g, "gw_nope", _x())
        assert info.value.status() == "StatusCode.NOT_FOUND" and info.value.message().startswith(nope)
        _unknown_in_tritons_words((g.get_model_metadata, g.get_model_config), GRPC_KEY, "StatusCode.NOT_FOUND", known)
        assert not g.is_model_ready("gw_nope", headers=GRPC_KEY)
        assert _stream_error(g, "gw_nope").startswith(nope)


def test_a_wrong_input_name_gets_tritons_words_then_the_declared_inputs(stack: Stack):
    name = stack.publish("gw_names")
    stack.loop.run(stack.lifecycle.ensure_ready(name))
    words = f"unexpected inference input 'q' for model '{name}'"
    line = (f"snoozeml: model '{name}' declares input(s) 'x' (FP32, dims [-1]): send each input under its "
            "declared name (names are case-sensitive)")
    for lib, client, headers in ((httpclient, stack.http(), KEY), (grpcclient, stack.grpc(), GRPC_KEY)):
        inp = lib.InferInput("q", [2, 4], "FP32")
        inp.set_data_from_numpy(_x())
        with client, pytest.raises(InferenceServerException) as info:
            client.infer(name, [inp], headers=dict(headers))  # a copy: tritonclient.http adds to the dict
        assert info.value.message() == f"{words}\n{line}", info.value.message()
        assert info.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")


BROKEN_PY = """
class Model:
    def load(self, model_dir, device):
        raise RuntimeError("no weights here")

    def predict(self, inputs):
        return inputs
"""


def test_failed_load_answers_in_tritons_words(stack: Stack, tmp_path: Path):
    """A model whose load fails: requests get Triton's "has no available versions" (as 503 / UNAVAILABLE:
    the next request tries the load again), a repository load gets Triton's "load failed for model"
    (400 / INVALID_ARGUMENT, Triton's status too), each with snoozeml's reason after."""
    broken = _write_package(tmp_path / "broken", BROKEN_PY)
    stack.store.publish(resolve(DeploymentSpec(id="gw_broken", path=broken, max_batch_size=8)))
    words = "Request for unknown model: 'gw_broken' has no available versions"
    with stack.http() as h, stack.grpc() as g:
        with pytest.raises(InferenceServerException) as info:
            http_infer(h, "gw_broken", _x())
        assert info.value.status() == "503" and info.value.message().startswith(words)
        assert "no weights here" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            grpc_infer(g, "gw_broken", _x())
        assert info.value.status() == "StatusCode.UNAVAILABLE" and info.value.message().startswith(words)
        ready = httpx.get(f"{stack.gateway.http_url}/v2/models/gw_broken/ready", headers=KEY)
        assert ready.status_code == 400 and ready.json()["error"].startswith("Model version not ready")
        with pytest.raises(InferenceServerException) as info:
            h.load_model("gw_broken", headers={"X-API-Key": ADMIN_KEY})
        assert info.value.status() == "400" and info.value.message().startswith("load failed for model 'gw_broken'")
        with pytest.raises(InferenceServerException) as info:
            g.load_model("gw_broken", headers={"x-api-key": ADMIN_KEY})
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert info.value.message().startswith("load failed for model 'gw_broken'")


@pytest.mark.parametrize("headers", [{}, {"X-API-Key": "wrong"}, {"Authorization": "Bearer wrong"}])
def test_http_auth_refusals_are_kserve_errors(stack: Stack, headers: dict[str, str]):
    with stack.http() as client:
        with pytest.raises(InferenceServerException) as info:
            http_infer(client, "gw_warm", _x(), headers=headers)
    assert info.value.status() == "401" and "missing or invalid API key" in info.value.message()
    assert info.value.message().startswith("This API is restricted, expecting header 'x-api-key'")  # Triton's words
    raw = httpx.get(f"{stack.gateway.http_url}/v2/models/gw_warm", headers=headers)
    assert raw.status_code == 401 and raw.headers["content-type"] == "application/json"
    assert raw.json() == {"error": pytest.approx(info.value.message())}


@pytest.mark.parametrize("headers", [{}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}])
def test_grpc_auth_refusals(stack: Stack, headers: dict[str, str]):
    with stack.grpc() as client:
        with pytest.raises(InferenceServerException) as info:
            grpc_infer(client, "gw_warm", _x(), headers=headers)
        assert info.value.status() == "StatusCode.UNAUTHENTICATED"
        assert info.value.message().startswith("This API is restricted, expecting header 'x-api-key'")
        assert "missing or invalid API key" in info.value.message()
        assert client.is_server_live()  # health needs no key


def test_repository_load_unload_need_the_admin_scope(stack: Stack):
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
        http_infer(h, name, _x())  # a request still wakes it, and then it is ready again
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
        y = grpc_infer(g, name, _x(12))  # wakes it; 12 rows: more than the published max_batch_size
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


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_64_mib_request_wakes_a_sleeping_model(stack: Stack, protocol: str):
    """A body far over ``wake_buffer_bytes`` wakes its model (the wake filter, not the retry), runs once,
    and the model is held only while the request runs."""
    name = stack.publish(f"gw_big_{protocol}")
    big = np.ones((1, 64 * 1024 * 1024 // 4), dtype=np.float32)
    retries = stack.gateway.stats().get(f"cluster.infer_{protocol}.upstream_rq_retry", 0)
    with stack.http() as h, stack.grpc() as g:
        y = http_infer(h, name, big) if protocol == "http" else grpc_infer(g, name, big)
    assert y.shape == big.shape and float(y[0, 0]) == 3.0 and float(y[0, -1]) == 3.0
    assert stack.triton_ready(name) and stack.load_count(name) == 1
    assert stack.gateway.stats().get(f"cluster.infer_{protocol}.upstream_rq_retry", 0) == retries  # no re-send
    assert _successes(stack, name, 2) == 2  # it ran once (Triton also counts the load's warm-up inference)
    until(lambda: stack.activator.holds.open(name) == 0, "the hold's release once the request ended")


def _generate(stack: Stack, name: str, op: str, body: Any) -> httpx.Response:
    return httpx.post(f"{stack.gateway.http_url}/v2/models/{name}/{op}", json=body, headers=KEY, timeout=60)


def test_generate_and_generate_stream_wake_a_sleeping_model(stack: Stack):
    name = stack.publish("gw_generate")
    r = _generate(stack, name, "generate", {"x": [1.0, 2.0]})
    assert r.status_code == 200, r.text
    assert r.json()["y"] == [3.0, 6.0] and stack.load_count(name) == 1
    stack.loop.run(stack.lifecycle.unload(name))
    r = _generate(stack, name, "generate_stream", {"x": [2.0, 4.0]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = [json.loads(line.removeprefix("data: ")) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["y"] for e in events] == [[6.0, 12.0]] and stack.load_count(name) == 2
    until(lambda: stack.activator.holds.open(name) == 0, "the stream's hold released at its end")
    r = _generate(stack, "gw_nope", "generate_stream", {"x": [2.0]})  # Triton's own answer, unchanged
    assert r.status_code == 404 and r.json()["error"] == "Request for unknown model: 'gw_nope' is not found"


def test_a_stream_wakes_a_sleeping_model_and_holds_it_while_open(stack: Stack):
    name = stack.publish("gw_stream")
    results: list[Any] = []
    with stack.grpc() as g:
        g.start_stream(callback=lambda result, error: results.append(error or result), headers=GRPC_KEY)
        for rows in (1, 2, 3):
            inp = grpcclient.InferInput("x", [rows, 4], "FP32")
            inp.set_data_from_numpy(_x(rows))
            g.async_stream_infer(name, [inp], request_id=str(rows))
        until(lambda: len(results) == 3, "three answers on the stream")
        assert all(not isinstance(r, InferenceServerException) for r in results), results
        for r in results:
            rows = int(r.get_response().id)
            np.testing.assert_allclose(r.as_numpy("y"), _x(rows) * 3)
        assert stack.load_count(name) == 1 and stack.activator.holds.open(name) == 1
        # While the stream is open the model is in use: an unload by the sweeper would not pick it.
        assert stack.lifecycle.states.record(name).users >= 1
        g.stop_stream()
    until(lambda: stack.activator.holds.open(name) == 0, "the hold's release at the stream's end")
    assert stack.lifecycle.states.record(name).users == 0


def test_a_stream_holds_every_model_it_names(stack: Stack):
    """One ModelStreamInfer stream, messages for a READY model then a sleeping one: the second is woken before
    its first message goes on, and each is held while the stream is open."""
    first, second = stack.publish("gw_stream_first"), stack.publish("gw_stream_second")
    stack.loop.run(stack.lifecycle.ensure_ready(first))
    until(lambda: stack.activator.ready_flags.ready(first), "the first model's ready flag")
    results: list[Any] = []
    with stack.grpc() as g:
        g.start_stream(callback=lambda result, error: results.append(error or result), headers=GRPC_KEY)
        for rows, name in enumerate((first, second, first, second), start=1):
            inp = grpcclient.InferInput("x", [rows, 4], "FP32")
            inp.set_data_from_numpy(_x(rows))
            g.async_stream_infer(name, [inp], request_id=f"{name}-{rows}")
        until(lambda: len(results) == 4, "four answers on the stream")
        assert all(not isinstance(r, InferenceServerException) for r in results), results
        for r in results:
            rows = int(r.get_response().id.rpartition("-")[2])
            np.testing.assert_allclose(r.as_numpy("y"), _x(rows) * 3)
        assert stack.load_count(first) == 1 and stack.load_count(second) == 1
        until(lambda: stack.activator.holds.open(first) == 1 and stack.activator.holds.open(second) == 1,
              "a hold of each model the stream names")  # fmt: skip
        g.stop_stream()
    until(lambda: stack.activator.holds.open(first) + stack.activator.holds.open(second) == 0,
          "both holds released at the stream's end")  # fmt: skip


def test_a_stream_wakes_a_sleeping_model_it_names_after_an_earlier_wake(stack: Stack):
    """A stream's first message woke its model; a later message names another sleeping model (each sent after
    the answer to the one before): that model is woken before its message moves on too (the next wake filter of
    the chain takes over where the one that waited ended), where it used to get Triton's "unknown model"."""
    names = [stack.publish(f"gw_stream_later{i}") for i in (1, 2, 3)]
    results: list[Any] = []
    with stack.grpc() as g:
        g.start_stream(callback=lambda result, error: results.append(error or result), headers=GRPC_KEY)
        for rows, name in enumerate([*names, names[0]], start=1):
            inp = grpcclient.InferInput("x", [rows, 4], "FP32")
            inp.set_data_from_numpy(_x(rows))
            g.async_stream_infer(name, [inp], request_id=f"{name}-{rows}")
            until(lambda rows=rows: len(results) == rows, f"answer {rows} on the stream")
        assert all(not isinstance(r, InferenceServerException) for r in results), results
        for r in results:
            rows = int(r.get_response().id.rpartition("-")[2])
            np.testing.assert_allclose(r.as_numpy("y"), _x(rows) * 3)
        assert [stack.load_count(name) for name in names] == [1, 1, 1]
        until(lambda: [stack.activator.holds.open(name) for name in names] == [1, 1, 1],
              "a hold of each model the stream names")  # fmt: skip
        g.stop_stream()
    until(lambda: sum(stack.activator.holds.open(name) for name in names) == 0, "every hold released at the end")


@contextlib.contextmanager
def _control_plane_blocked(stack: Stack) -> Iterator[None]:
    """The activator's event loop (the control plane's) stuck in a blocking call while the block runs."""
    blocked, release = threading.Event(), threading.Event()
    stack.loop.loop.call_soon_threadsafe(lambda: (blocked.set(), release.wait(60)))
    assert blocked.wait(10), "the control plane's loop never ran the blocking call"
    try:
        yield
    finally:
        release.set()


@pytest.mark.parametrize("protocol", ["grpc", "sse"])
def test_a_warm_stream_does_not_wait_for_the_activator(stack: Stack, protocol: str):
    """A READY model's stream goes on to Triton at once (its ready flag), even with the control plane stuck:
    its hold reaches the activator after, and keeps the model in use while the stream is open."""
    name = stack.publish(f"gw_warm_{protocol}")
    stack.loop.run(stack.lifecycle.ensure_ready(name))
    until(lambda: stack.activator.ready_flags.ready(name), "the model's ready flag")
    warm_holds = stack.activator.holds.warm_holds
    answers: list[Any] = []
    got = threading.Event()
    with stack.grpc() as g:
        with _control_plane_blocked(stack):
            if protocol == "grpc":
                g.start_stream(callback=lambda result, error: (answers.append(error or result), got.set()),
                               headers=GRPC_KEY)  # fmt: skip
                inp = grpcclient.InferInput("x", [1, 4], "FP32")
                inp.set_data_from_numpy(_x(1))
                g.async_stream_infer(name, [inp])
            else:
                answers.append(_generate(stack, name, "generate_stream", {"x": [2.0, 4.0]}))
                got.set()
            answered = got.wait(30)
        assert answered, "the warm stream waited for the stuck control plane"
        if protocol == "grpc":
            np.testing.assert_allclose(answers[0].as_numpy("y"), _x(1) * 3)
            until(lambda: stack.activator.holds.open(name) == 1, "the stream's hold, sent without waiting")
            assert stack.lifecycle.states.record(name).users >= 1
            g.stop_stream()
        else:
            assert answers[0].status_code == 200 and '"y":[6.0,12.0]' in answers[0].text.replace(" ", ""), answers
    until(lambda: stack.activator.holds.warm_holds == warm_holds + 1, "the warm hold at the activator")
    until(lambda: stack.activator.holds.open(name) == 0, "the hold's release at the stream's end")
    assert stack.load_count(name) == 1
    stack.loop.run(stack.lifecycle.unload(name))
    assert not stack.activator.ready_flags.ready(name)  # asleep: the next stream waits for its wake-up


def test_dead_stub_is_recovered_through_the_activator(stack: Stack):
    name = stack.publish("gw_stub")
    stack.loop.run(stack.lifecycle.ensure_ready(name))
    x = _x()
    for pid in stack.triton.stub_pids(name):
        os.kill(pid, signal.SIGKILL)
    # Neither request reached the dead process (the journal says so): both are served after recovery.
    with stack.grpc() as g:  # gRPC: Envoy matches grpc-message and retries to the activator
        np.testing.assert_allclose(grpc_infer(g, name, x), x * 3)
    assert stack.recoveries(name) == 1

    for pid in stack.triton.stub_pids(name):
        os.kill(pid, signal.SIGKILL)
    with stack.http() as h:  # HTTP: a Lua filter marks the dead stub's 500 for the same retry
        np.testing.assert_allclose(http_infer(h, name, x), x * 3)
    assert stack.recoveries(name) == 2


# A model's own errors that read like Triton's dead-stub answer, or like other gateway signals.
LOOKALIKES = {
    "healthy": ("RuntimeError", "feature store is not healthy"),
    "stub": ("RuntimeError", "Stub process 'x' is not healthy."),
    "own_stub": ("RuntimeError", "Stub process '{name}_0_0' is not healthy."),
    "exit": ("SystemExit", "Stub process '{name}_0_0' is not healthy."),  # not an Exception: framed all the same
    "ready": ("RuntimeError", "cache not ready"),
}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("lookalike", sorted(LOOKALIKES))
def test_a_models_own_error_runs_once_and_reaches_its_client(stack: Stack, tmp_path: Path, protocol: str,
                                                             lookalike: str):  # fmt: skip
    """Only Triton's own dead-stub answer is retried: a model raising an error with the same words runs
    once per request, its client gets the model's words, and the model is not restarted."""
    name = f"gw_raise_{lookalike}_{protocol}"
    exception, message = LOOKALIKES[lookalike]
    message = message.format(name=name)
    calls = tmp_path / "calls"
    stack.publish_raiser(name, message, calls, exception)
    stack.loop.run(stack.lifecycle.ensure_ready(name))
    with pytest.raises(InferenceServerException) as info:
        if protocol == "http":
            with stack.http() as h:
                http_infer(h, name, _x())
        else:
            with stack.grpc() as g:
                grpc_infer(g, name, _x())
    assert info.value.status() == ("500" if protocol == "http" else "StatusCode.INTERNAL"), info.value
    assert f"{exception}: {message}" in info.value.message(), info.value.message()
    assert info.value.message().startswith(f"[snooze:model_error] model '{name}': predict raised"), info.value.message()
    # A retry would have run predict again before the client got its answer.
    assert calls.read_text().split() == ["call"]
    assert stack.recoveries(name) == 0 and stack.load_count(name) == 1


def test_closed_gate_refuses_on_open_connections_then_opens(stack: Stack):
    """The snapshot gate (``close_gate``): requests on HTTP and gRPC connections opened before it closed,
    for a loaded and a sleeping model, get 503 / UNAVAILABLE and reach neither Triton nor the activator."""
    warm, asleep = stack.publish("gw_gate"), stack.publish("gw_gate_asleep")
    stack.loop.run(stack.lifecycle.ensure_ready(warm))
    loaded = _successes(stack, warm, at_least=1)  # the load's own warm-up inference
    x = _x()
    with stack.http() as h, stack.grpc() as g, httpx.Client(base_url=stack.gateway.http_url, headers=KEY) as raw:
        np.testing.assert_allclose(http_infer(h, warm, x), x * 3)
        np.testing.assert_allclose(grpc_infer(g, warm, x), x * 3)
        assert raw.get(f"/v2/models/{warm}/ready").status_code == 200  # a keep-alive connection, now idle
        # Triton counts a request just after answering it: wait for both (a count of 2 was once read as
        # warm-up + the first request, with the second counted later).
        served = _successes(stack, warm, at_least=loaded + 2)
        stack.gateway.close_gate()
        try:
            assert stack.gateway.gate_closed()
            for model in (warm, asleep):
                with pytest.raises(InferenceServerException) as info:
                    http_infer(h, model, x)
                assert info.value.status() == "503" and "snapshot" in info.value.message()
                with pytest.raises(InferenceServerException) as info:
                    grpc_infer(g, model, x)
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
        np.testing.assert_allclose(http_infer(h, warm, x), x * 3)
        np.testing.assert_allclose(grpc_infer(g, warm, x), x * 3)
        assert _successes(stack, warm, at_least=served + 2) == served + 2


def _successes(stack: Stack, name: str, at_least: int = 0) -> int:
    """Triton's count of successful requests for the model, once it reached ``at_least`` (5 s at most)."""
    deadline = time.monotonic() + 5
    while (count := stack.loop.run(stack.admin.model_stats(name)).success_count) < at_least:
        assert time.monotonic() < deadline, f"Triton counts {count} requests for {name}, expected {at_least}"
        time.sleep(0.05)
    return count


def test_auth_off_renders_no_auth_filter():
    common: dict[str, Any] = dict(
        host="127.0.0.1", http_port=1, grpc_port=2, admin_port=0, wake_buffer_bytes=1024,
        triton_http=Upstream("127.0.0.1", 3), triton_grpc=Upstream("127.0.0.1", 4),
        activator_http=Upstream("127.0.0.1", 5), activator_grpc=Upstream("127.0.0.1", 6),
    )  # fmt: skip
    assert "api_key_auth" not in render_bootstrap(**common)
    on = render_bootstrap(**common, api_keys=[ApiKey('a"b', "api-0")])
    assert on.count("envoy.filters.http.api_key_auth") == 2 + 3  # two listeners; health routes opt out
    assert '"a\\"b"' in on


def test_auth_on_without_keys_is_refused(tmp_path: Path):
    with pytest.raises(GatewayError, match="no API keys are configured"):
        EnvoyGateway(Settings(work_dir=tmp_path), triton_http="a:1", triton_grpc="a:2",
                     activator_http="a:3", activator_grpc="a:4")  # fmt: skip


REPEATER_PY = """
import time

import numpy as np


class Model:
    def __init__(self, log=""):
        self.log = log

    def load(self, model_dir, device):
        pass

    def _note(self, text):
        if self.log:
            with open(self.log, "a") as f:
                f.write(text + "\\n")

    def predict(self, inputs):
        # x = [n, mode, ...]: n responses of x * i; mode < 0 raises after two, mode > 0 sleeps that long
        x = inputs["x"]
        try:
            for i in range(1, int(x[0]) + 1):
                if x[1] < 0 and i == 3:
                    raise RuntimeError("the repeater failed after two")
                self._note(f"yield {i}")
                yield {"y": (x * i).astype(np.float32)}
                if x[1] > 0:
                    time.sleep(float(x[1]))
        finally:
            self._note("closed")
"""


@pytest.fixture(scope="module")
def repeater(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A decoupled package (predict is a generator): n responses per request."""
    return _write_package(
        tmp_path_factory.mktemp("gw_repeater") / "repeater",
        REPEATER_PY,
        params_schema={"log": {"type": "str", "default": ""}},
    )


def _publish_repeater(stack: Stack, repeater: Path, name: str, log: Path | None = None, worker: str = "in-stub") -> str:
    params = {"log": str(log)} if log else {}
    spec = DeploymentSpec(id=name, path=repeater, max_batch_size=0, params=params, worker=worker)
    stack.store.publish(resolve(spec))
    return name


WORKERS = ["in-stub", "preforked"]


@pytest.mark.parametrize("worker", WORKERS)
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_model_refusing_its_input_gets_400_invalid_argument_with_its_words(stack: Stack, tmp_path: Path,
                                                                              protocol: str, worker: str):  # fmt: skip
    """An exception whose class (a base of it, here) says ``snooze_error = "invalid_input"`` is the client's
    error, in the stub and in a preforked worker; a plain ValueError with the same words stays a 500."""
    for exception, status in (("NegativeCounts", ("400", "StatusCode.INVALID_ARGUMENT")),
                              ("ValueError", ("500", "StatusCode.INTERNAL"))):  # fmt: skip
        name = f"gw_refuse_{exception.lower()}_{worker.replace('-', '_')}_{protocol}"
        calls = tmp_path / f"{name}.calls"
        stack.publish_raiser(name, "counts must be >= 0", calls, exception, worker=worker)
        stack.loop.run(stack.lifecycle.ensure_ready(name))
        with pytest.raises(InferenceServerException) as info:
            if protocol == "http":
                with stack.http() as h:
                    http_infer(h, name, _x())
            else:
                with stack.grpc() as g:
                    grpc_infer(g, name, _x())
        message = info.value.message()
        assert info.value.status() == status[protocol == "grpc"], (exception, message)
        if exception == "NegativeCounts":
            assert message == f"[snooze:invalid_input] model '{name}': predict refused the input: counts must be >= 0"
        else:
            assert message.startswith(f"[snooze:model_error] model '{name}': predict raised ValueError: counts")
        assert calls.read_text().split() == ["call"]  # not retried


def _stream(g: grpcclient.InferenceServerClient, name: str, x: list[float]) -> list[Any]:
    """One request on a gRPC stream; every answer (result or error) until the stream's final answer."""
    answers: list[Any] = []
    done = threading.Event()

    def callback(result: Any, error: Any) -> None:
        if error is not None:
            answers.append(error)
            done.set()
        elif result.get_response().parameters["triton_final_response"].bool_param:
            done.set()
        else:
            answers.append(result)

    g.start_stream(callback=callback, headers=GRPC_KEY)
    inp = grpcclient.InferInput("x", [len(x)], "FP32")
    inp.set_data_from_numpy(np.array(x, dtype=np.float32))
    g.async_stream_infer(name, [inp], enable_empty_final_response=True)
    assert done.wait(60), f"no final answer on the stream; got {answers}"
    g.stop_stream()
    return answers


@pytest.mark.parametrize("worker", WORKERS)
def test_decoupled_model_streams_each_yield_over_grpc_and_sse(stack: Stack, repeater: Path, worker: str):
    name = _publish_repeater(stack, repeater, f"gw_repeat_{worker}", worker=worker)
    assert "decoupled: true" in stack.store.get(name).config_text
    with stack.grpc() as g:
        answers = _stream(g, name, [4.0, 0.0])  # asleep: the stream wakes it
    assert [a.as_numpy("y").tolist() for a in answers] == [[4.0 * i, 0.0] for i in (1, 2, 3, 4)]
    assert stack.load_count(name) == 1
    notes = [json.loads(p.read_text()) for p in stack.triton.journal_dir.glob("*.worker")]
    assert any(n.get("model") == name for n in notes) == (worker == "preforked")  # a worker ran it, not the stub
    stack.loop.run(stack.lifecycle.unload(name))
    r = _generate(stack, name, "generate_stream", {"x": [3.0, 0.0]})
    events = [json.loads(line.removeprefix("data: ")) for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and [e["y"] for e in events] == [[3.0, 0.0], [6.0, 0.0], [9.0, 0.0]], r.text
    assert stack.load_count(name) == 2


@pytest.mark.parametrize("worker", WORKERS)
def test_decoupled_error_mid_stream_keeps_what_was_sent(stack: Stack, repeater: Path, worker: str):
    name = _publish_repeater(stack, repeater, f"gw_repeat_fail_{worker}", worker=worker)
    with stack.grpc() as g:
        answers = _stream(g, name, [5.0, -1.0])
    assert [a.as_numpy("y").tolist() for a in answers[:2]] == [[5.0, -1.0], [10.0, -2.0]]
    assert isinstance(answers[2], InferenceServerException) and len(answers) == 3
    assert "the repeater failed after two" in answers[2].message()
    assert answers[2].message().startswith(f"[snooze:model_error] model '{name}'")


@pytest.mark.parametrize("worker", WORKERS)
def test_a_cancelled_stream_stops_the_generator(stack: Stack, repeater: Path, tmp_path: Path, worker: str):
    log = tmp_path / "repeater.log"
    name = _publish_repeater(stack, repeater, f"gw_repeat_cancel_{worker}", log, worker=worker)
    got = threading.Event()
    with stack.grpc() as g:
        g.start_stream(callback=lambda result, error: got.set(), headers=GRPC_KEY)
        inp = grpcclient.InferInput("x", [2], "FP32")
        inp.set_data_from_numpy(np.array([10_000.0, 0.05], dtype=np.float32))
        g.async_stream_infer(name, [inp])
        assert got.wait(60)
        g.stop_stream(cancel_requests=True)
    lines = until(lambda: (t := log.read_text().splitlines()) and t[-1] == "closed" and t, "the generator's close")
    assert len(lines) - 1 < 10_000  # it stopped: far from all the responses it was asked for
    until(lambda: stack.activator.holds.open(name) == 0, "the cancelled stream's hold released")


def _journaled_ids(stack: Stack) -> set[str]:
    """Every request id the model processes' journals hold now (controlplane/triton/journal.py layout)."""
    ids: set[str] = set()
    for path in stack.triton.journal_dir.glob("*.journal"):
        raw = path.read_bytes()
        size = int.from_bytes(raw[:4], "little")
        ids.update(i for i in raw[4 : 4 + size].decode().split("\n") if i)
    return ids


def test_an_open_stream_keeps_its_model_awake_and_is_journaled(stack: Stack, repeater: Path):
    """Open work is in use: across its idle timeout a stream's model is not unloaded; once the stream
    ends the model sleeps on its normal timeout. A streamed request is in the journal like any other."""
    name = "gw_stream_idle"
    stack.store.publish(resolve(DeploymentSpec(id=name, path=stack.package, max_batch_size=8, idle_timeout_secs=1)))
    results: list[Any] = []
    with stack.grpc() as g:
        g.start_stream(callback=lambda result, error: results.append(error or result), headers=GRPC_KEY)
        inp = grpcclient.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(_x(1))
        g.async_stream_infer(name, [inp])
        until(lambda: results, "the stream's answer")
        time.sleep(1.5)  # past idle_timeout_secs with the stream open
        stack.loop.run(stack.lifecycle.sweep())
        assert stack.triton_ready(name) and stack.lifecycle.status(name).state == "ready"
        g.stop_stream()
    until(lambda: stack.activator.holds.open(name) == 0, "the hold's release")
    until(lambda: stack.loop.run(stack.lifecycle.sweep()) or not stack.triton_ready(name), "the idle unload", 30)

    repeat = _publish_repeater(stack, repeater, "gw_repeat_journal")
    before = _journaled_ids(stack)
    with stack.grpc() as g:
        assert len(_stream(g, repeat, [2.0, 0.0])) == 2
    assert _journaled_ids(stack) - before  # the stream's request carried the gateway's id into the journal


TEXT_GENERATOR = Path(__file__).resolve().parents[2] / "examples" / "models" / "text-generator"


def test_the_text_generator_example_streams_tokens_asleep_at_the_start(stack: Stack):
    """The README's two snippets: tritonclient's stream and curl's generate_stream, each waking it."""
    name = "gw_text_generator"
    stack.store.publish(resolve(DeploymentSpec(id=name, path=TEXT_GENERATOR)))
    tokens: list[str] = []
    done = threading.Event()

    def on_token(result: Any, error: Any) -> None:
        assert error is None, error
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.set()
        else:
            tokens.append(result.as_numpy("token").reshape(-1)[0].decode())

    with stack.grpc() as g:
        prompt = grpcclient.InferInput("prompt", [1, 1], "BYTES")
        prompt.set_data_from_numpy(np.array([[b"the model"]], dtype=object))
        max_tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
        max_tokens.set_data_from_numpy(np.array([[12]], dtype=np.int32))
        g.start_stream(callback=on_token, headers=GRPC_KEY)
        g.async_stream_infer(name, [prompt, max_tokens], enable_empty_final_response=True)
        assert done.wait(60)
        g.stop_stream()
    assert len(tokens) == 12 and all(t.startswith(" ") and t.strip() for t in tokens)
    stack.loop.run(stack.lifecycle.unload(name))
    r = _generate(stack, name, "generate_stream", {"prompt": "the model", "max_tokens": 12})
    events = [json.loads(line.removeprefix("data: ")) for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and [e["token"] for e in events] == tokens, r.text  # same seed, same text


def test_a_crash_mid_stream_ends_it_with_an_error_and_runs_nothing_again(stack: Stack, repeater: Path, tmp_path: Path):
    log = tmp_path / "crash.log"
    name = _publish_repeater(stack, repeater, "gw_repeat_crash", log)
    answers: list[Any] = []
    with stack.grpc() as g:
        g.start_stream(callback=lambda result, error: answers.append(error or result), headers=GRPC_KEY)
        inp = grpcclient.InferInput("x", [2], "FP32")
        inp.set_data_from_numpy(np.array([10_000.0, 0.05], dtype=np.float32))
        g.async_stream_infer(name, [inp])
        until(lambda: answers, "the first token")
        for pid in stack.triton.stub_pids(name):
            os.kill(pid, signal.SIGKILL)
        until(lambda: isinstance(answers[-1], InferenceServerException), "the stream's error after the crash")
        g.stop_stream()
    assert all(not isinstance(a, InferenceServerException) for a in answers[:-1])
    starts = log.read_text().count("yield 1\n")
    # The model recovers (the process watch) and serves again; the crashed request never ran again.
    until(lambda: stack.recoveries(name) >= 1, "the recovery")
    with stack.grpc() as g:
        assert len(_stream(g, name, [2.0, 0.0])) == 2
    assert log.read_text().count("yield 1\n") == starts + 1


def test_bad_input_to_the_stream_and_generate_entry_points_gets_tritons_error(stack: Stack):
    """A stream whose first message names no model, a generate body that is not a JSON object: Triton's
    own error, nothing woken, and the gateway keeps serving."""
    name = stack.publish("gw_bad_input")
    with stack.grpc() as g:
        assert _stream_error(g, "").startswith("Request for unknown model")
    r = httpx.post(f"{stack.gateway.http_url}/v2/models/{name}/generate", content=b"[1, 2]", headers=KEY)
    direct = httpx.post(f"{stack.triton.http_url}/v2/models/{name}/generate", content=b"[1, 2]")
    assert (r.status_code, r.json()) == (direct.status_code, direct.json())  # Triton's answer, unchanged
    r = httpx.post(f"{stack.gateway.http_url}/v2/models/{name}/generate_stream", content=b"not json", headers=KEY)
    direct = httpx.post(f"{stack.triton.http_url}/v2/models/{name}/generate_stream", content=b"not json")
    assert (r.status_code, r.json()) == (direct.status_code, direct.json())
    with stack.grpc() as g:
        np.testing.assert_allclose(grpc_infer(g, name, _x()), _x() * 3)


def test_a_client_leaving_a_generate_stream_releases_its_hold(stack: Stack, repeater: Path):
    name = _publish_repeater(stack, repeater, "gw_repeat_sse_leave")
    url = f"{stack.gateway.http_url}/v2/models/{name}/generate_stream"
    # 60 tokens (3 s): over HTTP the stream's generator may run on after the client left.
    with httpx.Client(timeout=60) as client, client.stream("POST", url, json={"x": [60.0, 0.05]}, headers=KEY) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
        assert stack.activator.holds.open(name) == 1  # the open stream holds its model
    until(lambda: stack.activator.holds.open(name) == 0, "the hold's release once the client left")
    assert stack.lifecycle.states.record(name).users == 0


# x86_64 epoll_wait, epoll_pwait, epoll_pwait2: where Triton's HTTP (libevhtp) and gRPC event loops wait.
EPOLL_SYSCALLS = {"232", "281", "441"}
PTRACE_SEIZE, PTRACE_INTERRUPT, PTRACE_DETACH, WAIT_ALL = 0x4206, 0x4207, 17, 0x40000000


def _event_loop_threads(pid: int) -> list[int]:
    """Threads of ``pid`` waiting in epoll: its HTTP and gRPC event loops, none that runs a model or hands
    a model's responses over (those wait on locks)."""
    tids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            call = (task / "syscall").read_text().split()
            if call and call[0] in EPOLL_SYSCALLS:
                tids.append(int(task.name))
    return tids


def _stall(tids: list[int], secs: float) -> None:
    """Stop these threads (not their process) for ``secs``, as a busy machine deschedules them: ptrace
    seize + interrupt, then detach (one tracer thread does all of it)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    seized = []
    try:
        for tid in tids:
            args = (ctypes.c_long(tid), ctypes.c_void_p(None), ctypes.c_void_p(None))
            if libc.ptrace(ctypes.c_long(PTRACE_SEIZE), *args) != 0:
                if ctypes.get_errno() == errno.ESRCH:  # the thread ended since it was listed
                    continue
                raise OSError(ctypes.get_errno(), f"ptrace seize of thread {tid}")
            seized.append(args)
            libc.ptrace(ctypes.c_long(PTRACE_INTERRUPT), *args)
            os.waitpid(tid, WAIT_ALL)
        time.sleep(secs)
    finally:
        for args in seized:
            libc.ptrace(ctypes.c_long(PTRACE_DETACH), *args)


def test_a_fast_sse_stream_outlives_a_stalled_triton_http_thread(stack: Stack, repeater: Path):
    """Triton's HTTP frontend hands each response of a stream to its connection's thread through a socket
    that holds ~280 of them and dropped what did not fit: a thread descheduled for a moment while a model
    streams lost tokens and the stream's end, and the response never ended (controlplane/triton/defer_send.c)."""
    name = _publish_repeater(stack, repeater, "gw_repeat_stalled_http")
    assert _generate(stack, name, "generate_stream", {"x": [1.0, 0.0]}).status_code == 200  # awake
    threads = _event_loop_threads(stack.triton.pid)
    try:
        _stall(threads[:1], 0)
    except OSError as e:  # a machine that forbids ptrace cannot stall a thread
        pytest.skip(f"cannot stop one of Triton's threads here: {e}")
    n, stalled = 1500, threading.Event()
    # The model streams on while Triton's HTTP threads stand still.
    firsts = _stream_events(stack, name, n, at=50, then=lambda: (_stall(threads, 1.0), stalled.set()))
    assert stalled.wait(10)
    assert len(firsts) == n and firsts == [float(n * i) for i in range(1, n + 1)]


def _stream_events(stack: Stack, name: str, n: int, *, at: int, then: Callable[[], object]) -> list[float]:
    """The first values of the ``n`` events of a generate_stream through the gateway, with ``then`` started on
    a thread after the ``at``-th event; fails if the stream stops before its end."""
    url = f"{stack.gateway.http_url}/v2/models/{name}/generate_stream"
    events: list[float] = []
    with (
        httpx.Client(timeout=httpx.Timeout(10, read=20)) as client,
        client.stream("POST", url, json={"x": [float(n), 0.0]}, headers=KEY) as r,
    ):
        try:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: "))["y"][0])
                    if len(events) == at:
                        threading.Thread(target=then, daemon=True).start()
        except httpx.ReadTimeout:
            pytest.fail(f"the stream stopped after {len(events)} of {n} events and never ended")
    return events


SLOW_LOAD_PY = """
import time


class Model:
    def load(self, model_dir, device):
        time.sleep(1.0)

    def predict(self, inputs):
        return {"y": inputs["x"]}
"""


def test_a_stream_open_while_another_model_wakes_gets_every_event(stack: Stack, repeater: Path, tmp_path: Path):
    """Triton runs a model load on the HTTP thread of the connection that asked for it (the control plane's),
    which may also carry streams: during the load that thread hands nothing over, and the streamed responses
    that did not fit its socket were lost, the stream's end with them (without defer_send.c: 332-456 of 4,000
    events here, then silence)."""
    name = _publish_repeater(stack, repeater, "gw_repeat_during_wake")
    slow = _write_package(tmp_path / "slow", SLOW_LOAD_PY, warmup=False)
    stack.store.publish(resolve(DeploymentSpec(id="gw_slow_load", path=slow, max_batch_size=8)))
    assert _generate(stack, name, "generate_stream", {"x": [1.0, 0.0]}).status_code == 200  # awake
    n, woken = 3000, threading.Event()

    def wake_the_other() -> None:
        stack.loop.run(stack.lifecycle.ensure_ready("gw_slow_load"))
        woken.set()

    events = _stream_events(stack, name, n, at=50, then=wake_the_other)  # another model wakes while this one streams
    assert woken.wait(30) and stack.triton_ready("gw_slow_load")
    assert len(events) == n and events == [float(n * i) for i in range(1, n + 1)]


ACCUMULATOR_PY = """
import numpy as np


class Model:
    def __init__(self, calls=""):
        self.calls = calls

    def load(self, model_dir, device):
        self.totals = {}

    def predict(self, inputs, sequence):
        if self.calls:
            with open(self.calls, "a") as f:
                f.write(f"{sequence.correlation_id}\\n")
        x = inputs["x"]
        total = x if sequence.start else self.totals[sequence.correlation_id] + x
        if sequence.end:
            self.totals.pop(sequence.correlation_id, None)
        else:
            self.totals[sequence.correlation_id] = total
        return {"y": total.astype(np.float32)}
"""


@pytest.fixture(scope="module")
def accumulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_package(
        tmp_path_factory.mktemp("gw_accumulator") / "accumulator",
        ACCUMULATOR_PY,
        params_schema={"calls": {"type": "str", "default": ""}},
    )


@pytest.mark.parametrize("strategy", ["direct", "oldest"])
def test_a_sequence_model_keeps_state_per_correlation_id_asleep_at_the_start(
    stack: Stack, accumulator: Path, strategy: str, tmp_path: Path
):
    name = f"gw_accumulate_{strategy}"
    sequence = SequenceSpec(strategy=strategy, max_sequence_idle_secs=30)
    calls = tmp_path / "calls"
    spec = DeploymentSpec(
        id=name, path=accumulator, max_batch_size=8, idle_timeout_secs=60, sequence=sequence,
        params={"calls": str(calls)},
    )  # fmt: skip
    stack.store.publish(resolve(spec))
    config = stack.store.get(name).config_text
    assert f"{strategy} {{" in config and "sequence_batching" in config and "dynamic_batching" not in config

    def grpc_step(g: grpcclient.InferenceServerClient, cid: int, value: float, start: bool, end: bool) -> float:
        inp = grpcclient.InferInput("x", [1, 1], "FP32")
        inp.set_data_from_numpy(np.array([[value]], dtype=np.float32))
        r = g.infer(name, [inp], sequence_id=cid, sequence_start=start, sequence_end=end, headers=GRPC_KEY)
        return float(r.as_numpy("y")[0, 0])

    def http_step(h: httpclient.InferenceServerClient, cid: int, value: float, start: bool, end: bool) -> float:
        inp = httpclient.InferInput("x", [1, 1], "FP32")
        inp.set_data_from_numpy(np.array([[value]], dtype=np.float32))
        r = h.infer(name, [inp], sequence_id=cid, sequence_start=start, sequence_end=end, headers=dict(KEY))
        return float(r.as_numpy("y")[0, 0])

    with stack.grpc() as g, stack.http() as h:
        assert grpc_step(g, 1000, 1.0, True, False) == 1.0  # asleep: this wakes it
        assert http_step(h, 2000, 10.0, True, False) == 10.0
        # Two live sequences: the model's process noted them, and a sweep holds the model in use.
        stack.loop.run(stack.lifecycle.sweep())
        assert stack.lifecycle.sequences.live(name) and stack.lifecycle.states.record(name).users >= 1
        assert grpc_step(g, 1000, 2.0, False, False) == 3.0
        assert http_step(h, 2000, 20.0, False, False) == 30.0
        assert grpc_step(g, 1000, 3.0, False, True) == 6.0
        stack.loop.run(stack.lifecycle.sweep())
        assert stack.lifecycle.sequences.live(name)  # 2000 is still open
        assert http_step(h, 2000, 30.0, False, True) == 60.0
        stack.loop.run(stack.lifecycle.sweep())
        assert not stack.lifecycle.sequences.live(name) and stack.lifecycle.states.record(name).users == 0
        assert stack.load_count(name) == 1
        inp = grpcclient.InferInput("x", [1, 1], "FP32")
        inp.set_data_from_numpy(np.array([[1.0]], dtype=np.float32))
        with pytest.raises(InferenceServerException) as info:  # no correlation id: Triton's own error
            g.infer(name, [inp], headers=GRPC_KEY)
        assert "correlation ID" in info.value.message() and info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert grpc_step(g, 3000, 5.0, True, True) == 5.0  # and it keeps serving
    # predict saw the sequences' requests only: never the direct strategy's fillers of idle batch slots
    assert set(calls.read_text().split()) == {"1000", "2000", "3000"}


def test_sequence_settings_triton_would_refuse_are_refused_naming_the_field(tmp_path: Path):
    with pytest.raises(ValueError, match="max_candidate_sequences applies to strategy"):
        SequenceSpec(strategy="direct", max_candidate_sequences=4)
    with pytest.raises(ValueError, match="max_sequence_idle_secs"):
        SequenceSpec(max_sequence_idle_secs=0)
    with pytest.raises(ValueError, match=r"idle_timeout_secs \(10\) is below sequence.max_sequence_idle_secs"):
        DeploymentSpec(id="s", path=tmp_path, idle_timeout_secs=10, sequence=SequenceSpec(max_sequence_idle_secs=60))


async def test_aio_stream_and_custom_channel_args_wake_a_sleeping_decoupled_model(stack: Stack, repeater: Path):
    """tritonclient.grpc.aio's ``stream_infer`` (an async iterator of requests) and a client built with
    custom channel arguments, as Triton's aio and channel-args examples drive them."""
    name = _publish_repeater(stack, repeater, "gw_repeat_aio")
    inp = grpcaio.InferInput("x", [2], "FP32")
    inp.set_data_from_numpy(np.array([3.0, 0.0], dtype=np.float32))

    async def requests() -> Any:
        yield {"model_name": name, "inputs": [inp], "request_id": "aio-1"}

    options = [("grpc.max_send_message_length", 64 * 1024 * 1024), ("grpc.keepalive_time_ms", 30_000)]
    async with grpcaio.InferenceServerClient(stack.gateway.grpc_url, channel_args=options) as client:
        answers = []
        async for result, error in client.stream_infer(requests(), headers=GRPC_KEY):
            assert error is None, error
            answers.append(result.as_numpy("y").tolist())
            if len(answers) == 3:
                break
    assert answers == [[3.0, 0.0], [6.0, 0.0], [9.0, 0.0]] and stack.load_count(name) == 1


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


def test_memory_pressure_evicts_another_model_than_one_with_an_open_stream(stack: Stack, repeater: Path):
    """A model streaming to a client is in use: an eviction passes it by and takes an idle one, even one
    used more recently."""
    streaming = _publish_repeater(stack, repeater, "gw_repeat_evict")
    idle = stack.publish("gw_evict_idle")
    answers: list[Any] = []
    evicted: list[str] = []

    def evict() -> bool:  # Triton's pending count (a metric) may still show the idle model's request
        evicted.extend(stack.loop.run(stack.lifecycle.loader.evict(newcomer, 1 << 62, "test: memory pressure")))
        return idle in evicted

    with stack.grpc() as g:
        g.start_stream(callback=lambda result, error: answers.append(error or result), headers=GRPC_KEY)
        try:
            inp = grpcclient.InferInput("x", [2], "FP32")
            inp.set_data_from_numpy(np.array([10_000.0, 0.05], dtype=np.float32))
            g.async_stream_infer(streaming, [inp])
            until(lambda: answers, "the first token")
            with stack.http() as h:
                np.testing.assert_allclose(http_infer(h, idle, _x()), _x() * 3)  # used after the stream began
            newcomer = stack.lifecycle.states.record(stack.publish("gw_evict_newcomer"))
            # The other tests' models count as in use here: only these two are candidates (and no slow unload
            # of another test's model runs).
            others = [r for r in stack.lifecycle.states.values() if r.id not in (streaming, idle)]
            for r in others:
                r.users += 1
            try:
                until(evict, "the idle model's eviction", 30)
            finally:
                for r in others:
                    r.users -= 1
            assert streaming not in evicted and stack.triton_ready(streaming) and not stack.triton_ready(idle)
        finally:
            g.stop_stream(cancel_requests=True)
