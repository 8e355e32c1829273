"""Errors through the gateway in Triton's words: unknown models, failed loads, auth refusals, a model's own
errors and refusals (run once, reaching the client).

The stack (real Envoy + real tritonserver + the activator, see tests/harness/gateway.py) is shared by the
module's tests (tests/integration/gateway/conftest.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from controlplane.errors import GatewayError
from controlplane.gateway.envoy import ApiKey, EnvoyGateway, Upstream, render_bootstrap
from controlplane.settings import Settings
from controlplane.spec import DeploymentSpec, resolve
from harness.gateway import (
    ADMIN_KEY,
    GRPC_KEY,
    KEY,
    WORKERS,
    Stack,
    _stream_error,
    _write_package,
    _x,
)
from harness.probes import grpc_infer, http_infer

pytestmark = pytest.mark.integration


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
            http_infer(h, "gw_nope", _x(), headers=KEY)
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
            grpc_infer(g, "gw_nope", _x(), headers=GRPC_KEY)
        assert info.value.status() == "StatusCode.NOT_FOUND" and info.value.message().startswith(nope)
        _unknown_in_tritons_words((g.get_model_metadata, g.get_model_config), GRPC_KEY, "StatusCode.NOT_FOUND", known)
        assert not g.is_model_ready("gw_nope", headers=GRPC_KEY)
        assert _stream_error(g, "gw_nope").startswith(nope)


def test_a_wrong_input_name_gets_tritons_words_then_the_declared_inputs(stack: Stack):
    name = stack.publish("gw_names")
    stack.loop.run(stack.lifecycle.ensure_ready(name))
    words = f"unexpected inference input 'q' for model '{name}'"
    line = (
        f"snoozeml: model '{name}' declares input(s) 'x' (FP32, dims [-1]): send each input under its "
        "declared name (names are case-sensitive)"
    )
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
            http_infer(h, "gw_broken", _x(), headers=KEY)
        assert info.value.status() == "503" and info.value.message().startswith(words)
        assert "no weights here" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            grpc_infer(g, "gw_broken", _x(), headers=GRPC_KEY)
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
                http_infer(h, name, _x(), headers=KEY)
        else:
            with stack.grpc() as g:
                grpc_infer(g, name, _x(), headers=GRPC_KEY)
    assert info.value.status() == ("500" if protocol == "http" else "StatusCode.INTERNAL"), info.value
    assert f"{exception}: {message}" in info.value.message(), info.value.message()
    assert info.value.message().startswith(f"[snooze:model_error] model '{name}': predict raised"), info.value.message()
    # A retry would have run predict again before the client got its answer.
    assert calls.read_text().split() == ["call"]
    assert stack.recoveries(name) == 0 and stack.load_count(name) == 1


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
                    http_infer(h, name, _x(), headers=KEY)
            else:
                with stack.grpc() as g:
                    grpc_infer(g, name, _x(), headers=GRPC_KEY)
        message = info.value.message()
        assert info.value.status() == status[protocol == "grpc"], (exception, message)
        if exception == "NegativeCounts":
            assert message == f"[snooze:invalid_input] model '{name}': predict refused the input: counts must be >= 0"
        else:
            assert message.startswith(f"[snooze:model_error] model '{name}': predict raised ValueError: counts")
        assert calls.read_text().split() == ["call"]  # not retried
