"""The activator: the gateway's cold path, inside the control-plane process.

Envoy sends it (see ``envoy.yaml.j2``):

- inference requests that Triton answered "not found" (a sleeping model), "unavailable" or "Stub
  process '<instance>' is not healthy." (a dead model process, ``controlplane.triton.dead_stub``):
  the activator wakes the model
  (``waker.serving``: the lifecycle's single-flight ``ensure_ready``, then the model is held loaded
  until the forward is done), forwards the request to Triton unchanged and returns Triton's answer
  unchanged. A request never runs twice: one that was running in a model process when it died
  (the lifecycle reads that from the request journal, by the gateway's ``x-snooze-request-id``) is
  refused with an error that says so, and one that only met the dead process is sent after the
  model is recovered (``lifecycle.recovery``);
- model readiness, metadata and config, answered for a published model as if it were loaded (a
  request would succeed), and the repository API (index; load/unload with the admin scope).

HTTP is an ASGI app (Starlette, served by uvicorn on a loopback port); gRPC is a grpc.aio server with
a generic handler and identity serializers, so inference messages are forwarded as raw bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
import httpx
import uvicorn
from google.protobuf import json_format
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tritonclient.grpc import model_config_pb2, service_pb2

from controlplane.auth import Scope, check_scope
from controlplane.errors import NotFoundError, SnoozeError, TritonModelLoadError, UnavailableError
from controlplane.gateway import triton_words as words
from controlplane.gateway.envoy import held_log_path, ready_dir_path
from controlplane.gateway.triton_words import UnknownModelError
from controlplane.gateway.wake_lua import HOLD_HEADER, HOLD_PATH, HOLD_WARM_HEADER
from controlplane.lifecycle.loading import config_for
from controlplane.lifecycle.overrides import ForbiddenOverrideError, MalformedOverrideError, parse_override
from controlplane.render import VERSION, parse_config
from controlplane.servers import EmbeddedUvicorn
from controlplane.settings import Settings
from controlplane.store import ModelStore, PublishedModel
from controlplane.triton.dead_stub import is_dead_stub_http_body, is_dead_stub_message
from controlplane.triton.journal import REQUEST_ID_HEADER

log = logging.getLogger("snoozeml.activator")
SERVICE = "inference.GRPCInferenceService"
# HTTP inference calls retried here (a body within the wake buffer): infer and generate, forwarded alike.
OPS = ("infer", "generate")
T = TypeVar("T")
# Lifecycle state -> Triton repository-index state, the vocabulary tritonclient users know.
INDEX_STATES = {
    "ready": "READY",
    "loading": "LOADING",
    "unloading": "UNLOADING",
    "unloaded": "UNAVAILABLE",
    "failed": "UNAVAILABLE",
}
# Not forwarded to Triton: hop-by-hop headers, and those httpx sets itself.
_HOP_HEADERS = {
    "connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade", "host", "content-length",
}  # fmt: skip
# Not forwarded as gRPC metadata: set by the channel itself.
_GRPC_RESERVED = {"te", "content-type", "user-agent", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding"}
_UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
_GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ALREADY_EXISTS,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    503: grpc.StatusCode.UNAVAILABLE,
}


class Waker(Protocol):
    """What the activator needs from the lifecycle manager (``controlplane.lifecycle.LifecycleManager``)."""

    def serving(self, model_id: str, *, timeout: float | None = None) -> contextlib.AbstractAsyncContextManager[None]:
        """``ensure_ready`` (wake, single flight), then hold the model loaded while the block runs."""

    async def admit(self, model_id: str, request_id: str) -> None: ...  # raises if it ran in a dead process
    async def after_dead_answer(self, model_id: str, request_id: str) -> None: ...  # raises unless safe to resend
    async def load(self, model_id: str, *, instances: int | None = None, override: Any = ...) -> Any: ...
    def config_override(self, model_id: str) -> dict[str, Any] | None: ...  # a client's, from a repository load
    async def unload(self, model_id: str, *, reason: str = "api") -> Any: ...
    def status(self, model_id: str) -> Any: ...  # ModelStatus: .state, .reason
    def add_state_listener(self, listener: Callable[[str, Any], None]) -> None: ...  # now, then on every change
    def remove_state_listener(self, listener: Callable[[str, Any], None]) -> None: ...


class ModelAnswers:
    """What the activator answers, shared by HTTP and gRPC: wake, readiness, metadata, config, index, admin."""

    def __init__(self, waker: Waker, store: ModelStore, settings: Settings) -> None:
        self.waker = waker
        self.store = store
        self.settings = settings
        # Unloaded by a client through Triton's repository API: not ready (Triton's answer after an unload)
        # until the model is READY again (a repository load, or a request that woke it).
        self.unloaded_by_client: set[str] = set()

    def published_for_load(self, name: str) -> PublishedModel:
        """``published`` for a repository load: an unpublished model in Triton's words for a load (500)."""
        try:
            return self.store.get(name)
        except NotFoundError as e:
            raise words.LoadUnknownModelError(name, e) from None

    async def unload(self, name: str) -> None:
        """Repository unload (admin): the model sleeps now and reports not ready until it is loaded again."""
        await self.waker.unload(name, reason="api")
        if self.state(name) != "ready":
            self.unloaded_by_client.add(name)

    def on_state(self, name: str, state: Any) -> None:
        """Lifecycle state listener: a model READY again (or gone) is no longer one a client unloaded."""
        if state is None or str(getattr(state, "value", state)) == "ready":
            self.unloaded_by_client.discard(name)

    def published(self, name: str, version: str = "") -> PublishedModel:
        """The published model; else Triton's own "unknown model" words (404), snoozeml's reason after."""
        try:
            model = self.store.get(name)
        except NotFoundError as e:
            raise UnknownModelError(words.not_found(name), e) from None
        if version and version != VERSION:
            raise UnknownModelError(
                words.version_not_found(name, version), f"model '{name}' is published as version {VERSION} only"
            )
        return model

    @contextlib.asynccontextmanager
    async def serving(self, name: str, timeout: float | None = None) -> AsyncIterator[None]:
        """Wake the model and keep it loaded (no idle unload, no eviction) until the block ends.

        A load that failed or outlived the deadline answers with Triton's words for a model without a
        loaded version first and snoozeml's reason after, as 503 / UNAVAILABLE with Retry-After (not
        Triton's 404): the next request tries the load again, so a client that retries 503 is right.
        The caller has checked that the model is published (``published``: Triton's words otherwise).
        """
        entered = False
        try:
            async with self.waker.serving(name, timeout=timeout):
                entered = True
                yield
        except UnavailableError as e:
            if entered or isinstance(e, words.NotYetAvailableError):
                raise
            raise words.NotYetAvailableError(name, e) from e

    async def forward(
        self,
        name: str,
        request_id: str,
        send: Callable[[], Awaitable[T]],
        dead: Callable[[T], bool],
        *,
        timeout: float | None = None,
    ) -> T:
        """Wake the model and ``send()`` the request to Triton, at most once to a live model process.

        A request that already ran in a model process that died (Envoy retried its "stub not
        healthy" answer here) is refused with the crash. One that meets a dead stub here is sent again
        after recovery only when the journal shows it never reached a live process (``recovery``).
        """
        self.published(name)
        await self.waker.admit(name, request_id)
        async with self.serving(name, timeout):
            answer = await send()
            if not dead(answer):
                return answer
            await self.waker.after_dead_answer(name, request_id)
            answer = await send()
            if dead(answer):
                await self.waker.after_dead_answer(name, request_id)
            return answer

    async def load(self, name: str, parameters: Mapping[str, Any]) -> None:
        """Repository load (admin) with the request's load parameters (``config``: the client's override, held
        through sleep and wake; ``file:`` ones are refused). A failed load answers in Triton's words and status:
        400 (load failed), or 500 for an override Triton could not read (``overrides``)."""
        files = [key for key in parameters if key != "config"]
        if files:  # never forwarded: Triton 2.51 aborts on a file: name longer than NAME_MAX
            raise words.RefusedLoadFilesError(
                name,
                BadRequestError(
                    f"load parameters {', '.join(sorted(files))} for model '{name}' are not accepted through the "
                    "gateway (only 'config')",
                    hint="publish a new package (snoozectl publish) to change a model's files",
                ),
            )
        text = parameters.get("config")
        try:
            override = None if text is None else parse_override(text, name)
            await self.waker.load(name, override=override)
        except MalformedOverrideError as e:
            raise words.BadConfigOverrideError(name, e) from e
        except (TritonModelLoadError, ForbiddenOverrideError) as e:
            raise words.LoadFailedError(name, e) from e
        if self.state(name) == "failed":
            raise words.LoadFailedError(name, SnoozeError(self.waker.status(name).reason or "unknown reason"))

    def state(self, name: str) -> str:
        """The lifecycle state's name (``ModelStatus.state`` is a str enum)."""
        state = self.waker.status(name).state
        return str(getattr(state, "value", state))

    def ready(self, name: str) -> bool:
        """Published and not failed: a request would be served (after a wake if it sleeps). Not ready after a
        client's repository unload, as Triton answers (Triton's client examples check it), until loaded again."""
        return self.store.exists(name) and self.state(name) != "failed" and name not in self.unloaded_by_client

    def loaded(self, name: str) -> bool:
        return self.state(name) == "ready"

    def config(self, model: PublishedModel) -> model_config_pb2.ModelConfig:
        """The config the model loads with: its published config.pbtxt, and a client's override if one holds."""
        override = self.waker.config_override(model.id)
        if not override:
            return parse_config(model.config_text, where=str(model.path / "config.pbtxt"))
        return json_format.ParseDict(config_for(model, override), model_config_pb2.ModelConfig())

    def metadata(self, model: PublishedModel) -> dict[str, Any]:
        """KServe v2 model metadata, as Triton answers it for the loaded model."""
        config = self.config(model)
        batch = [-1] if config.max_batch_size > 0 else []
        return {
            "name": model.id,
            "versions": [VERSION],
            "platform": config.platform or config.backend,
            "inputs": [{"name": t.name, "datatype": t.datatype, "shape": batch + t.dims} for t in model.inputs],
            "outputs": [{"name": t.name, "datatype": t.datatype, "shape": batch + t.dims} for t in model.outputs],
        }

    def index(self, ready_only: bool) -> list[dict[str, str]]:
        entries = []
        for model in self.store.list():
            lifecycle_state = self.state(model.id)
            state = INDEX_STATES.get(lifecycle_state, "UNKNOWN")
            if ready_only and state != "READY":
                continue
            reason = self.waker.status(model.id).reason or lifecycle_state
            entries.append({"name": model.id, "version": VERSION, "state": state, "reason": reason})
        return entries

    def check_admin(self, headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> None:
        """Repository load/unload through the gateway need the admin scope (cold path: checked here)."""
        check_scope(self.settings, headers, Scope.ADMIN, surface="activator")


class BadRequestError(SnoozeError):
    status_code = 400
    code = "bad_request"


class ReadyFlags:
    """One file per READY model in ``folder``: what the wake filter reads to let a warm stream on without
    waiting for Python (``wake_lua``; only that it exists). Its one line, from ``describe``, is the hint the
    gateway adds to Triton's answer for an input the model does not have (``input_names_hint``).

    ``update`` is a lifecycle state listener: it runs synchronously inside the transition, so a flag goes
    away the moment the model leaves READY (an idle unload, an eviction, a recovery, Triton gone), before
    the transition awaits anything. Flags left by an earlier run are removed at ``open``.
    """

    def __init__(self, folder: Path, describe: Callable[[str], str] | None = None) -> None:
        self.folder = folder
        self.describe = describe
        self._open = False

    def open(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._open = True

    def close(self) -> None:
        self._open = False
        shutil.rmtree(self.folder, ignore_errors=True)

    def ready(self, model: str) -> bool:
        return (self.folder / model).is_file()

    def update(self, model: str, state: Any) -> None:
        if not self._open or not model or model.startswith(".") or "/" in model:
            return
        path = self.folder / model
        try:
            if str(getattr(state, "value", state)) == "ready":
                text = self._describe(model)
                # Renamed into place: the gateway never reads half a line (a dot name is never a flag).
                partial = self.folder / f".{model}.partial"
                partial.write_text(text + "\n" if text else "", encoding="utf-8")
                os.replace(partial, path)
            else:
                path.unlink(missing_ok=True)
        except OSError as e:  # without its flag the model is only slower to stream (the cold path's call)
            log.warning("model '%s': ready flag %s not updated: %s", model, path, e)


    def _describe(self, model: str) -> str:
        if self.describe is None:
            return ""
        try:
            return self.describe(model)
        except Exception as e:  # a flag without its hint costs a line in one error, never the flag
            log.warning("model '%s': no input hint for the gateway: %s", model, e)
            return ""


def input_names_hint(record: Any) -> str:
    """The line the gateway adds to Triton's "unexpected inference input" for ``record`` (a PublishedModel)."""
    declared = ", ".join(f"'{t.name}' ({t.datatype}, dims {list(t.dims)})" for t in record.inputs)
    return (f"snoozeml: model '{record.id}' declares input(s) {declared}: send each input under its declared "
            "name (names are case-sensitive)")


class HoldRegistry:
    """Models held in use for the requests the wake filter let through (streams, large bodies).

    ``hold`` wakes the model (single flight) and keeps it in use (``serving``: no idle unload, no
    eviction, no scale-down) until Envoy's access log of held requests (``held_log``, one hold token per
    line, written when the request ends, normally or by a reset) names its token: ``tail`` reads it.
    The wake filter sets the token before it calls, so an end logged before its hold was taken (the
    client went away during the wake) releases the hold at once; ends that never had a hold (an unknown
    model) are forgotten after ``ENDED_MEMORY_SECS``.
    """

    ENDED_MEMORY_SECS = 600.0

    def __init__(self, answers: ModelAnswers, held_log: Path, *, poll_secs: float = 0.05) -> None:
        self.answers = answers
        self.held_log = held_log
        self.poll_secs = poll_secs
        self._holds: dict[str, tuple[str, contextlib.AsyncExitStack]] = {}
        self._ended: dict[str, float] = {}
        self._offset: int | None = None
        self.warm_holds = 0  # holds the wake filter sent without waiting (the model's ready flag was there)

    def open(self, model: str | None = None) -> int:
        """Requests held now (for ``model``, or all)."""
        return sum(1 for m, _ in self._holds.values() if model is None or m == model)

    async def hold(self, model: str, token: str, *, warm: bool = False) -> None:
        self.answers.published(model)
        self.warm_holds += warm
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(self.answers.serving(model))
        if not token or self._ended.pop(token, None) is not None or token in self._holds:
            await stack.aclose()
            return
        self._holds[token] = (model, stack)

    async def release(self, request_id: str) -> None:
        held = self._holds.pop(request_id, None)
        if held is None:
            self._ended[request_id] = time.monotonic()
            return
        await held[1].aclose()

    def _new_lines(self) -> list[str]:
        try:
            size = self.held_log.stat().st_size
        except FileNotFoundError:
            self._offset = self._offset or 0
            return []
        if self._offset is None or size < self._offset:  # first look (older runs' lines), or a new file
            self._offset = size if self._offset is None else 0
            return []
        if size == self._offset:
            return []
        with open(self.held_log, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        complete = data.rfind(b"\n") + 1
        self._offset += complete
        return [line.strip().strip('"') for line in data[:complete].decode("utf-8", "replace").splitlines()]

    async def tail(self) -> None:
        """Release holds as Envoy logs their requests' ends (runs until cancelled)."""
        while True:
            for line in self._new_lines():
                for token in line.split(","):  # a stream that held several models: each one's token
                    if token and token != "-":
                        await self.release(token)
            now = time.monotonic()
            for request_id, at in list(self._ended.items()):
                if now - at > self.ENDED_MEMORY_SECS:
                    del self._ended[request_id]
            await asyncio.sleep(self.poll_secs)

    async def aclose(self) -> None:
        for _, stack in list(self._holds.values()):
            await stack.aclose()
        self._holds.clear()


# ---------------------------------------------------------------------------------------------
# HTTP


def error_response(error: SnoozeError) -> JSONResponse:
    """The KServe v2 error shape (``{"error": ...}``, plus snoozeml's code and hint). The error says its fix too,
    as a gRPC answer's message does: tritonclient shows clients the ``error`` field alone."""
    headers = {}
    if isinstance(error, UnavailableError):
        headers["Retry-After"] = str(max(1, round(error.retry_after or 1)))
    return JSONResponse({**error.to_dict(), "error": str(error)}, status_code=error.status_code, headers=headers)


class HttpForwarder:
    """Sends a request to Triton's HTTP endpoint with its body and headers unchanged."""

    def __init__(self, triton_http_url: str, client: httpx.AsyncClient) -> None:
        self.base = triton_http_url.rstrip("/")
        self.client = client

    async def send(self, request: Request, body: bytes) -> Response:
        headers = [(k, v) for k, v in request.headers.items() if k not in _HOP_HEADERS and not k.startswith("x-envoy-")]
        url = f"{self.base}{request.url.path}" + (f"?{request.url.query}" if request.url.query else "")
        upstream = self.client.build_request(request.method, url, content=body, headers=headers)
        try:
            r = await self.client.send(upstream, stream=True)
        except httpx.TransportError as e:
            raise UnavailableError(f"Triton at {self.base} is not reachable: {e}", retry_after=1) from e
        try:
            raw = b"".join([chunk async for chunk in r.aiter_raw()])  # still encoded: passed on as is
        finally:
            await r.aclose()
        out = {k: v for k, v in r.headers.items() if k not in _HOP_HEADERS}
        return Response(raw, status_code=r.status_code, headers=out)


def _handled(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            return await fn(request)
        except SnoozeError as e:
            return error_response(e)

    return endpoint


def create_http_app(answers: ModelAnswers, forwarder: HttpForwarder, holds: HoldRegistry) -> Starlette:
    """The activator's KServe v2 HTTP app (the routes Envoy sends to ``activator_http``), and the wake
    filter's hold call (``wake_lua``; reached only from Envoy's Lua, no listener route leads there)."""

    def model_of(request: Request) -> tuple[str, str]:
        return request.path_params["model"], request.path_params.get("version", "")

    async def infer(request: Request) -> Response:
        name, version = model_of(request)
        answers.published(name, version)
        body = await request.body()
        return await answers.forward(
            name,
            request.headers.get(REQUEST_ID_HEADER, ""),
            lambda: forwarder.send(request, body),
            lambda r: r.status_code == 500 and is_dead_stub_http_body(r.body),
        )

    async def ready(request: Request) -> Response:
        name, version = model_of(request)
        try:
            answers.published(name, version)
        except UnknownModelError as e:  # Triton: 400 "Model version not ready" for any unknown model
            return JSONResponse({"error": words.explained(words.NOT_READY, e.message)}, 400)
        if not answers.ready(name):
            reason = f"model '{name}' failed to load: {answers.waker.status(name).reason}"
            return JSONResponse({"error": words.explained(words.NOT_READY, reason)}, 400)
        return Response(status_code=200)

    async def metadata(request: Request) -> Response:
        name, version = model_of(request)
        return JSONResponse(answers.metadata(answers.published(name, version)))

    async def config(request: Request) -> Response:
        name, version = model_of(request)
        model = answers.published(name, version)
        if answers.loaded(name):  # Triton's own answer includes load-time overrides (instances)
            return await forwarder.send(request, b"")
        return JSONResponse(json_format.MessageToDict(answers.config(model), preserving_proto_field_name=True))

    async def index(request: Request) -> Response:
        body = await request.body()
        ready_only = bool((await request.json()).get("ready", False)) if body else False
        return JSONResponse(answers.index(ready_only))

    def admin_model(request: Request) -> str:
        answers.check_admin(request.headers)
        return answers.published(request.path_params["model"]).id

    async def load(request: Request) -> Response:
        answers.check_admin(request.headers)
        name = answers.published_for_load(request.path_params["model"]).id
        body = await request.body()
        await answers.load(name, ((await request.json()).get("parameters") or {}) if body else {})
        return JSONResponse({})

    async def unload(request: Request) -> Response:
        await answers.unload(admin_model(request))
        return JSONResponse({})

    async def hold(request: Request) -> Response:
        warm = request.headers.get(HOLD_WARM_HEADER) == "1"
        await holds.hold(request.path_params["model"], request.headers.get(HOLD_HEADER, ""), warm=warm)
        return JSONResponse({})

    model = "/v2/models/{model}"
    versioned = "/v2/models/{model}/versions/{version}"
    routes = [Route(f"{p}/{op}", _handled(infer), methods=["POST"]) for p in (model, versioned) for op in OPS]
    routes += [Route(HOLD_PATH + "{model}", _handled(hold), methods=["POST"])]
    routes += [Route(f"{p}/ready", _handled(ready), methods=["GET"]) for p in (model, versioned)]
    routes += [Route(f"{p}/config", _handled(config), methods=["GET"]) for p in (model, versioned)]
    routes += [Route(p, _handled(metadata), methods=["GET"]) for p in (model, versioned)]
    routes += [
        Route("/v2/repository/index", _handled(index), methods=["POST"]),
        Route("/v2/repository/models/{model}/load", _handled(load), methods=["POST"]),
        Route("/v2/repository/models/{model}/unload", _handled(unload), methods=["POST"]),
    ]
    return Starlette(routes=routes)


# ---------------------------------------------------------------------------------------------
# gRPC


def _metadata(context: grpc.aio.ServicerContext) -> list[tuple[str, Any]]:
    return [
        (m.key, m.value)
        for m in context.invocation_metadata() or ()
        if not m.key.startswith((":", "x-envoy-")) and m.key not in _GRPC_RESERVED
    ]


def _is_dead_stub(answer: bytes | grpc.aio.AioRpcError) -> bool:
    return (
        isinstance(answer, grpc.aio.AioRpcError)
        and answer.code() == grpc.StatusCode.INTERNAL
        and is_dead_stub_message(answer.details() or "")
    )


def _parameter(value: service_pb2.ModelRepositoryParameter) -> Any:
    kind = value.WhichOneof("parameter_choice")
    raw = getattr(value, kind) if kind else ""
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw


class GrpcActivator:
    """The handlers of the gRPC methods Envoy sends to ``activator_grpc``; messages are raw bytes."""

    def __init__(self, answers: ModelAnswers, triton_grpc_url: str) -> None:
        self.answers = answers
        self.channel = grpc.aio.insecure_channel(triton_grpc_url, options=_UNLIMITED)

    def handler(self) -> grpc.GenericRpcHandler:
        methods = {
            "ModelInfer": self.model_infer,
            "ModelReady": self.model_ready,
            "ModelMetadata": self.model_metadata,
            "ModelConfig": self.model_config,
            "RepositoryIndex": self.repository_index,
            "RepositoryModelLoad": self.repository_load,
            "RepositoryModelUnload": self.repository_unload,
        }
        return grpc.method_handlers_generic_handler(
            SERVICE, {name: grpc.unary_unary_rpc_method_handler(self._handled(fn)) for name, fn in methods.items()}
        )

    @staticmethod
    def _handled(fn: Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]) -> Any:
        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                return await fn(request, context)
            except SnoozeError as e:
                if isinstance(e, UnavailableError):
                    context.set_trailing_metadata((("retry-after", str(max(1, round(e.retry_after or 1)))),))
                await context.abort(_GRPC_CODES.get(e.status_code, grpc.StatusCode.INTERNAL), str(e))

        return handle

    async def _forward(self, method: str, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        call = self.channel.unary_unary(f"/{SERVICE}/{method}")
        return await call(request, metadata=_metadata(context), timeout=context.time_remaining())

    async def model_infer(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        name = service_pb2.ModelInferRequest.FromString(request).model_name
        request_id = next((str(m.value) for m in context.invocation_metadata() or () if m.key == REQUEST_ID_HEADER), "")
        answer = await self.answers.forward(
            name,
            request_id,
            lambda: self._try_forward("ModelInfer", request, context),
            _is_dead_stub,
            timeout=context.time_remaining(),
        )
        if isinstance(answer, grpc.aio.AioRpcError):
            await context.abort(answer.code(), answer.details() or "")
        return answer

    async def _try_forward(
        self, method: str, request: bytes, context: grpc.aio.ServicerContext
    ) -> bytes | grpc.aio.AioRpcError:
        try:
            return await self._forward(method, request, context)
        except grpc.aio.AioRpcError as e:
            return e

    async def model_ready(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        msg = service_pb2.ModelReadyRequest.FromString(request)
        ready = msg.version in ("", VERSION) and self.answers.ready(msg.name)
        return service_pb2.ModelReadyResponse(ready=ready).SerializeToString()

    async def model_metadata(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        msg = service_pb2.ModelMetadataRequest.FromString(request)
        meta = self.answers.metadata(self.answers.published(msg.name, msg.version))
        tensor = service_pb2.ModelMetadataResponse.TensorMetadata
        return service_pb2.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]],
            outputs=[tensor(**t) for t in meta["outputs"]],
        ).SerializeToString()

    async def model_config(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        msg = service_pb2.ModelConfigRequest.FromString(request)
        model = self.answers.published(msg.name, msg.version)
        if self.answers.loaded(msg.name):
            try:
                return await self._forward("ModelConfig", request, context)
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "")
        return service_pb2.ModelConfigResponse(config=self.answers.config(model)).SerializeToString()

    async def repository_index(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        msg = service_pb2.RepositoryIndexRequest.FromString(request)
        entries = [service_pb2.RepositoryIndexResponse.ModelIndex(**e) for e in self.answers.index(msg.ready)]
        return service_pb2.RepositoryIndexResponse(models=entries).SerializeToString()

    def _check_admin(self, context: grpc.aio.ServicerContext) -> None:
        self.answers.check_admin([(m.key, str(m.value)) for m in context.invocation_metadata() or ()])

    async def repository_load(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self._check_admin(context)
        msg = service_pb2.RepositoryModelLoadRequest.FromString(request)
        self.answers.published_for_load(msg.model_name)
        parameters = {key: _parameter(value) for key, value in msg.parameters.items()}
        await self.answers.load(msg.model_name, parameters)
        return service_pb2.RepositoryModelLoadResponse().SerializeToString()

    async def repository_unload(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self._check_admin(context)
        msg = service_pb2.RepositoryModelUnloadRequest.FromString(request)
        self.answers.published(msg.model_name)
        await self.answers.unload(msg.model_name)
        return service_pb2.RepositoryModelUnloadResponse().SerializeToString()

    async def aclose(self) -> None:
        await self.channel.close()


# ---------------------------------------------------------------------------------------------
# Both, in the control plane's event loop


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class Activator:
    """The HTTP (uvicorn) and gRPC (grpc.aio) activator servers on loopback; start/stop in one event loop.

    Ports come from ``settings.activator_http_port`` / ``activator_grpc_port`` (0 = a free port);
    after ``start()``, ``http_address`` and ``grpc_address`` are what the Envoy bootstrap needs.
    """

    def __init__(
        self,
        waker: Waker,
        store: ModelStore,
        settings: Settings,
        *,
        triton_http_url: str,
        triton_grpc_url: str,
        host: str = "127.0.0.1",
    ) -> None:
        self.settings = settings
        self.host = host
        self.answers = ModelAnswers(waker, store, settings)
        self.triton_http_url = triton_http_url
        self.triton_grpc_url = triton_grpc_url
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self._client: httpx.AsyncClient | None = None
        self._grpc: GrpcActivator | None = None
        self._grpc_server: grpc.aio.Server | None = None
        self._uvicorn: EmbeddedUvicorn | None = None
        self._uvicorn_task: asyncio.Task[None] | None = None
        self.holds = HoldRegistry(self.answers, held_log_path(settings))
        self.ready_flags = ReadyFlags(ready_dir_path(settings), lambda m: input_names_hint(store.get(m)))
        self._tail_task: asyncio.Task[None] | None = None

    @property
    def http_address(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    async def start(self) -> None:
        self.ready_flags.open()
        self.answers.waker.add_state_listener(self.ready_flags.update)
        self.answers.waker.add_state_listener(self.answers.on_state)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        app = create_http_app(self.answers, HttpForwarder(self.triton_http_url, self._client), self.holds)
        self._tail_task = asyncio.create_task(self.holds.tail())
        sock = _bind(self.host, self.settings.activator_http_port)
        self.http_port = sock.getsockname()[1]
        self._uvicorn = EmbeddedUvicorn(
            uvicorn.Config(app, lifespan="off", access_log=False, log_level="warning", timeout_keep_alive=300)
        )
        self._uvicorn_task = asyncio.create_task(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._uvicorn_task.done():
                await self._uvicorn_task  # raises uvicorn's start-up error
                raise SnoozeError(f"the activator's HTTP server on {self.http_address} stopped during start-up")
            await asyncio.sleep(0.01)

        self._grpc = GrpcActivator(self.answers, self.triton_grpc_url)
        self._grpc_server = grpc.aio.server(options=_UNLIMITED)
        self._grpc_server.add_generic_rpc_handlers((self._grpc.handler(),))
        self.grpc_port = self._grpc_server.add_insecure_port(f"{self.host}:{self.settings.activator_grpc_port}")
        await self._grpc_server.start()

    async def stop(self, grace: float = 5.0) -> None:
        self.answers.waker.remove_state_listener(self.ready_flags.update)
        self.answers.waker.remove_state_listener(self.answers.on_state)
        self.ready_flags.close()
        if self._tail_task is not None:
            self._tail_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tail_task
            self._tail_task = None
        await self.holds.aclose()
        if self._grpc_server is not None:
            await self._grpc_server.stop(grace)
        if self._grpc is not None:
            await self._grpc.aclose()
        if self._uvicorn is not None and self._uvicorn_task is not None:
            self._uvicorn.should_exit = True
            await self._uvicorn_task
        if self._client is not None:
            await self._client.aclose()
        self._grpc_server = self._grpc = self._uvicorn = self._uvicorn_task = self._client = None
