"""The activator's KServe v2 HTTP adapter: a Starlette app over ``handlers.ModelAnswers``."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from controlplane.errors import SnoozeError, UnavailableError
from controlplane.gateway import triton_words as words
from controlplane.gateway.handlers import HoldRegistry, ModelAnswers
from controlplane.gateway.triton_words import UnknownModelError, internal_error_message
from controlplane.gateway.wake_lua import HOLD_HEADER, HOLD_PATH, HOLD_WARM_HEADER
from controlplane.spec.triton_folder import triton_config_json
from controlplane.triton.dead_stub import is_dead_stub_http_body
from controlplane.triton.journal import REQUEST_ID_HEADER

log = logging.getLogger("snoozeml.gateway")

# HTTP inference calls retried here (a body within the wake buffer): infer and generate, forwarded alike.
OPS = ("infer", "generate")
# Not forwarded to Triton: hop-by-hop headers, and those httpx sets itself.
_HOP_HEADERS = {
    "connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade", "host", "content-length",
}  # fmt: skip


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
        except Exception as e:  # a bug here: the client still gets the KServe error shape, not a bare text 500
            log.exception("activator: %s %s failed", request.method, request.url.path)
            return JSONResponse({"error": internal_error_message(e), "code": "internal"}, status_code=500)

    return endpoint


def create_http_app(answers: ModelAnswers, forwarder: HttpForwarder, holds: HoldRegistry) -> Starlette:
    """The activator's KServe v2 HTTP app (the routes Envoy sends to ``activator_http``), and the wake
    filter's hold call (``wake_lua``; reached only from Envoy's Lua, no listener route leads there)."""

    def model_of(request: Request) -> tuple[str, str]:
        return request.path_params["model"], request.path_params.get("version", "")

    async def infer(request: Request) -> Response:
        name, version = model_of(request)
        body = await request.body()
        return await answers.forward(
            name,
            request.headers.get(REQUEST_ID_HEADER, ""),
            lambda: forwarder.send(request, body),
            lambda r: r.status_code == 500 and is_dead_stub_http_body(r.body),
            version=version,
        )

    async def ready(request: Request) -> Response:
        name, version = model_of(request)
        try:
            answers.published(name, version)
        except UnknownModelError as e:  # Triton: 400 "Model version not ready" for any unknown model
            return JSONResponse({"error": words.explained(words.NOT_READY, e.message)}, 400)
        if not answers.ready(name):
            reason = f"model '{name}' failed to load: {answers.lifecycle.status(name).reason}"
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
        # As Triton writes it: every plain field (max_batch_size 0 too), 64-bit numbers as numbers.
        return JSONResponse(triton_config_json(answers.config(model)))

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
