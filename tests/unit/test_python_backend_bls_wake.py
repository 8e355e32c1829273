"""The stub's side of BLS wake-ups (python_backend/bls_wake.py), outside Triton.

``triton_python_backend_utils`` exists only inside a python-backend stub, so its request, response and error
classes are stood in for here by small classes that answer as Triton 2.51's do (the words are the ones measured on
the embedded tritonserver; tests/integration/gateway/test_gateway_bls.py runs the same code in real stubs). The
control plane's wake route is a real HTTP server on a real unix socket, scripted.
Runs on Python 3.10 too (make test-runtime-py310): no controlplane import.
"""

from __future__ import annotations

import asyncio
import http.server
import importlib
import json
import os
import shutil
import socketserver
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from python_backend import bls_wake
from python_backend.journal import JOURNAL_ENV


def not_ready_words(model: str) -> str:
    """Triton 2.51's answer to a BLS call into a model it has not loaded (measured)."""
    return (
        f"Model {model} - Error when running inference: Failed for execute the inference request. "
        f"Model '{model}' is not ready."
    )


@pytest.mark.parametrize(
    ("message", "callee"),
    [
        (not_ready_words("add_sub"), "add_sub"),
        (not_ready_words("a - b"), "a - b"),  # the name itself may hold the separator
        (not_ready_words("m.v2-x"), "m.v2-x"),
        ("Model m - Error when running inference: Request for unknown model: 'm' is not found", "m"),
        ("Model m - Error when running inference: Request for unknown model: 'm' has no available versions", "m"),
        ("Model m - Error when running inference: Request for unknown model: 'm' version 3 is not found", "m"),
    ],
)
def test_triton_words_for_a_model_that_is_not_loaded_name_the_callee(message: str, callee: str) -> None:
    assert bls_wake.not_ready_callee(message) == callee


@pytest.mark.parametrize(
    "message",
    [
        "[snooze:model_error] model 'm': predict raised RuntimeError: Model 'm' is not ready.",  # the callee's own
        "Model a - Error when running inference: Failed for execute the inference request. Model 'b' is not ready.",
        not_ready_words("m") + " and more",
        "Model m - Error when running inference: Model m is using the decoupled. The current BLS request call "
        "doesn't support models using the decoupled transaction policy.",
        "Stub process 'm_0_0' is not healthy.",
        "",
    ],
)
def test_other_answers_are_not_taken_for_a_sleeping_callee(message: str) -> None:
    assert bls_wake.not_ready_callee(message) is None


# ------------------------------------------------------------------ stand-ins for the stub's classes


class Error:
    INTERNAL, UNAVAILABLE = "INTERNAL", "UNAVAILABLE"

    def __init__(self, message: str, code: str = "INTERNAL") -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> str:
        return self._code


class Response:
    def __init__(self, output_tensors: Any = (), error: Error | None = None) -> None:
        self.outputs, self._error = output_tensors, error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> Error | None:
        return self._error


class Stream:
    """Like the stub's ResponseIterator: a loop after the end replays every response from the first."""

    def __init__(self, responses: list[Response]) -> None:
        self.responses, self.at, self.done = responses, 0, False

    def __iter__(self) -> Stream:
        if self.done:
            self.at = 0
        return self

    def __next__(self) -> Response:
        if self.at >= len(self.responses):
            self.done = True
            raise StopIteration
        self.at += 1
        return self.responses[self.at - 1]


class Callees:
    """What the stand-in Triton answers per callee: asleep (Triton's words) until woken, then its answers."""

    def __init__(self) -> None:
        self.awake: set[str] = set()
        self.answers: dict[str, Callable[[], Any]] = {}
        self.sent: list[str] = []

    def answer(self, model: str, decoupled: bool) -> Any:
        self.sent.append(model)
        if model not in self.awake:
            asleep = Response(error=Error(not_ready_words(model)))
            return Stream([asleep]) if decoupled else asleep
        return self.answers[model]()


CALLEES = Callees()


class Request:
    def __init__(self, model_name: str, inputs: Any = (), requested_output_names: Any = (), timeout: int = 0) -> None:
        self.model_name, self._timeout = model_name, timeout

    def timeout(self) -> int:
        return self._timeout

    def exec(self, decoupled: bool = False) -> Any:
        return CALLEES.answer(self.model_name, decoupled)

    def async_exec(self, decoupled: bool = False) -> Any:
        return asyncio.get_running_loop().run_in_executor(None, CALLEES.answer, self.model_name, decoupled)


@pytest.fixture
def pb(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """The stand-in ``triton_python_backend_utils``, with bls_wake installed for caller 'front'."""
    global CALLEES
    CALLEES = Callees()
    module = types.ModuleType("triton_python_backend_utils")
    module.InferenceRequest = type("InferenceRequest", (Request,), {})
    module.InferenceResponse = Response
    module.TritonError = Error
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", module)
    monkeypatch.delenv(bls_wake.TIMEOUT_ENV, raising=False)
    bls_wake.install("front")
    try:
        yield module
    finally:
        bls_wake.uninstall()


class WakeRoute:
    """A scripted wake route on a unix socket: records each call, answers ``status`` / ``body``, and wakes the callee
    (in the stand-in Triton) when it answers 200."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / bls_wake.WAKE_SOCKET
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.status, self.body = 200, b'{"state": "READY"}'
        self.before_answer: Callable[[], None] = lambda: None
        route = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                callee = self.path.removeprefix(bls_wake.WAKE_PATH)
                route.calls.append((callee, json.loads(self.rfile.read(length))))
                route.before_answer()
                if route.status == 200:
                    CALLEES.awake.add(callee)
                self.send_response(route.status)
                self.send_header("Content-Length", str(len(route.body)))
                self.end_headers()
                self.wfile.write(route.body)

            def log_message(self, *args: Any) -> None:
                pass

            def address_string(self) -> str:
                return "unix"

        self.server = socketserver.ThreadingUnixStreamServer(str(self.path), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def route(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[WakeRoute]:
    monkeypatch.setenv(JOURNAL_ENV, str(tmp_path))
    served = WakeRoute(tmp_path)
    try:
        yield served
    finally:
        served.close()


def ok(value: str) -> Callable[[], Response]:
    return lambda: Response(output_tensors=[value])


# ------------------------------------------------------------------ exec


def test_a_call_into_a_sleeping_callee_wakes_it_and_is_sent_again(pb: types.ModuleType, route: WakeRoute) -> None:
    CALLEES.answers["back"] = ok("y")
    answer = pb.InferenceRequest(model_name="back", inputs=[], requested_output_names=["y"]).exec()
    assert not answer.has_error() and answer.outputs == ["y"]
    assert CALLEES.sent == ["back", "back"]  # asleep, then the same request once more
    assert [(callee, body["caller"]) for callee, body in route.calls] == [("back", "front")]


def test_a_call_into_an_awake_callee_asks_nothing(pb: types.ModuleType, route: WakeRoute) -> None:
    CALLEES.awake.add("back")
    CALLEES.answers["back"] = ok("y")
    assert pb.InferenceRequest(model_name="back").exec().outputs == ["y"]
    assert route.calls == [] and CALLEES.sent == ["back"]


def test_the_callees_own_error_is_the_callers_unchanged(pb: types.ModuleType, route: WakeRoute) -> None:
    own = Response(error=Error("[snooze:model_error] model 'back': predict raised ValueError: bad x", "INVALID_ARG"))
    CALLEES.answers["back"] = lambda: own
    assert pb.InferenceRequest(model_name="back").exec() is own
    assert CALLEES.sent == ["back", "back"]  # woken, then its answer: no third send


def test_a_callee_the_control_plane_does_not_publish_is_an_error_naming_it(
    pb: types.ModuleType, route: WakeRoute
) -> None:
    route.status, route.body = (
        404,
        json.dumps({"error": "model 'ghost' is not published (fix: publish 'ghost')"}).encode(),
    )
    answer = pb.InferenceRequest(model_name="ghost").exec()
    message = answer.error().message()
    assert message.startswith(not_ready_words("ghost"))  # Triton's words first, as clients parse them
    assert "could not wake model 'ghost' for 'front'" in message and "is not published" in message
    assert answer.error().code() == "INTERNAL"  # Triton's own code: never UNAVAILABLE, which the gateway retries
    assert CALLEES.sent == ["ghost"]


def test_a_callee_that_cannot_load_in_time_is_an_error_with_the_route_s_reason(
    pb: types.ModuleType, route: WakeRoute
) -> None:
    route.status, route.body = 503, b'{"error": "model \'back\' is not ready after 1.8s (it is loading)"}'
    message = pb.InferenceRequest(model_name="back").exec().error().message()
    assert "could not wake model 'back'" in message and "not ready after 1.8s" in message


def test_no_control_plane_listening_is_an_error_at_once(
    pb: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(JOURNAL_ENV, str(tmp_path))
    message = pb.InferenceRequest(model_name="back").exec().error().message()
    assert f"no snoozeml control plane listens at {tmp_path / bls_wake.WAKE_SOCKET}" in message


def test_a_triton_without_a_journal_folder_is_an_error_that_says_so(
    pb: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(JOURNAL_ENV, raising=False)
    message = pb.InferenceRequest(model_name="back").exec().error().message()
    assert f"this Triton has no {JOURNAL_ENV}" in message


def test_a_callee_triton_will_not_run_once_woken_ends_after_a_few_wakes(pb: types.ModuleType, route: WakeRoute) -> None:
    # evicted again before each retry, or a model_version the model lacks: Triton says "not ready" however often
    CALLEES.answers["back"] = lambda: Response(error=Error(not_ready_words("back")))
    message = pb.InferenceRequest(model_name="back").exec().error().message()
    assert "yet Triton still answered that it is not ready" in message and "model_version" in message
    assert len(route.calls) == bls_wake.WAKE_ROUNDS and len(CALLEES.sent) == bls_wake.WAKE_ROUNDS + 1


def test_a_wake_that_uses_up_the_bound_ends_the_call(pb: types.ModuleType, route: WakeRoute) -> None:
    CALLEES.answers["back"] = lambda: Response(error=Error(not_ready_words("back")))
    route.before_answer = lambda: time.sleep(1.0)  # the wake would take more than the call's 0.2 s
    message = pb.InferenceRequest(model_name="back", timeout=200_000).exec().error().message()
    assert "could not wake model 'back'" in message and len(route.calls) == 1


# ------------------------------------------------------------------ the bound


def test_the_request_s_own_timeout_bounds_the_wake(pb: types.ModuleType, route: WakeRoute) -> None:
    CALLEES.answers["back"] = ok("y")
    pb.InferenceRequest(model_name="back", timeout=2_000_000).exec()  # microseconds, as Triton's
    assert 0 < route.calls[0][1]["timeout_secs"] <= 2.0


def test_without_a_request_timeout_the_environment_s_bound_holds(
    pb: types.ModuleType, route: WakeRoute, monkeypatch: pytest.MonkeyPatch
) -> None:
    CALLEES.answers["back"] = ok("y")
    monkeypatch.setenv(bls_wake.TIMEOUT_ENV, "7")
    pb.InferenceRequest(model_name="back").exec()
    assert 0 < route.calls[0][1]["timeout_secs"] <= 7.0
    CALLEES.awake.clear()
    bls_wake.install("front", timeout_secs=3.0)  # the caller's own bound comes before the environment's
    pb.InferenceRequest(model_name="back").exec()
    assert 0 < route.calls[1][1]["timeout_secs"] <= 3.0


def test_without_any_bound_the_default_holds(pb: types.ModuleType, route: WakeRoute) -> None:
    CALLEES.answers["back"] = ok("y")
    pb.InferenceRequest(model_name="back").exec()
    assert 0 < route.calls[0][1]["timeout_secs"] <= bls_wake.DEFAULT_TIMEOUT_SECS


# ------------------------------------------------------------------ decoupled and async


def test_a_decoupled_call_wakes_its_callee_and_streams_every_response(pb: types.ModuleType, route: WakeRoute) -> None:
    parts = [Response(output_tensors=[str(i)]) for i in range(3)]
    CALLEES.answers["stream"] = lambda: Stream(list(parts))
    responses = pb.InferenceRequest(model_name="stream").exec(decoupled=True)
    assert [r.outputs for r in responses] == [["0"], ["1"], ["2"]]
    assert [r.outputs for r in responses] == [["0"], ["1"], ["2"]]  # a loop after the end replays, as Triton's
    assert CALLEES.sent == ["stream", "stream"] and len(route.calls) == 1


def test_a_decoupled_call_that_cannot_wake_streams_one_error(pb: types.ModuleType, route: WakeRoute) -> None:
    route.status, route.body = 404, b'{"error": "model \'ghost\' is not published"}'
    responses = list(pb.InferenceRequest(model_name="ghost").exec(decoupled=True))
    assert len(responses) == 1 and "is not published" in responses[0].error().message()


def test_an_awake_decoupled_callee_s_stream_is_unchanged(pb: types.ModuleType, route: WakeRoute) -> None:
    CALLEES.awake.add("stream")
    CALLEES.answers["stream"] = lambda: Stream([Response(output_tensors=["a"]), Response(output_tensors=["b"])])
    responses = pb.InferenceRequest(model_name="stream").exec(decoupled=True)
    assert [r.outputs for r in responses] == [["a"], ["b"]] and route.calls == []


def test_async_exec_wakes_without_holding_the_event_loop(pb: types.ModuleType, route: WakeRoute) -> None:
    CALLEES.answers["back"] = ok("y")
    loop_ran = threading.Event()
    route.before_answer = lambda: loop_ran.wait(10)  # the route answers only once the loop has run something else

    async def main() -> tuple[Any, bool]:
        async def other_work() -> None:
            while not route.calls:
                await asyncio.sleep(0.005)
            loop_ran.set()

        future = pb.InferenceRequest(model_name="back").async_exec()
        assert isinstance(future, asyncio.Future)  # as the stub's own: under way before it is awaited
        _, answer = await asyncio.gather(other_work(), future)
        return answer, loop_ran.is_set()

    answer, ran = asyncio.run(main())
    assert ran and answer.outputs == ["y"] and CALLEES.sent == ["back", "back"]


def test_async_decoupled_exec_wakes_its_callee(pb: types.ModuleType, route: WakeRoute) -> None:
    CALLEES.answers["stream"] = lambda: Stream([Response(output_tensors=["a"]), Response(output_tensors=["b"])])

    async def main() -> list[Any]:
        responses = await pb.InferenceRequest(model_name="stream").async_exec(decoupled=True)
        return [r.outputs for r in responses]

    assert asyncio.run(main()) == [["a"], ["b"]] and len(route.calls) == 1


def test_uninstall_gives_the_stub_its_own_methods_back(pb: types.ModuleType) -> None:
    patched = pb.InferenceRequest.exec
    bls_wake.uninstall()
    assert pb.InferenceRequest.exec is not patched and pb.InferenceRequest.exec is Request.exec
    bls_wake.install("front")


def test_a_second_copy_of_the_runtime_in_the_same_stub_does_not_wrap_twice(
    pb: types.ModuleType, route: WakeRoute, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # e.g. a folder wrapper's copy of python_backend and a model's own, both imported into one stub
    copy = tmp_path / "runtime_copy"
    shutil.copytree(Path(bls_wake.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        other = importlib.import_module("runtime_copy.bls_wake")
        patched = pb.InferenceRequest.exec
        other.install("front-again")
        assert pb.InferenceRequest.exec is patched
        CALLEES.answers["back"] = ok("y")
        pb.InferenceRequest(model_name="back").exec()
        assert route.calls[0][1]["caller"] == "front-again" and CALLEES.sent == ["back", "back"]
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "runtime_copy"]:
            del sys.modules[name]


def test_a_socket_path_too_long_for_sockaddr_un_is_reached_through_its_folder(tmp_path: Path) -> None:
    folder = tmp_path / ("d" * 60) / ("e" * 60)
    folder.mkdir(parents=True)
    served = WakeRouteAt(folder)
    try:
        CALLEES.awake.clear()
        bls_wake.wake("back", "front", 5.0, str(folder / bls_wake.WAKE_SOCKET))
        assert served.route.calls[0][0] == "back"
    finally:
        served.close()


class WakeRouteAt:
    """A WakeRoute bound through the folder's descriptor (its path is longer than sockaddr_un holds)."""

    def __init__(self, folder: Path) -> None:
        cwd = os.getcwd()
        os.chdir(folder)  # bound by a short relative name; the client must still reach it by its long path
        try:
            self.route = WakeRoute(Path("."))
        finally:
            os.chdir(cwd)

    def close(self) -> None:
        self.route.close()
