"""The control API: ``create_app(settings, services)`` builds it; handlers are thin and call
``ModelOperations``. Every error leaves as the one JSON shape ``{"error", "code", "hint"}``."""

from __future__ import annotations

import logging
import math
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Body, Depends, FastAPI, Path, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive

from controlplane.api.listing import SUMMARY_TOP, ListQuery
from controlplane.api.operations import ModelOperations, describe_validation_errors
from controlplane.api.schemas import (
    ErrorBody,
    LoadRequest,
    ModelDetail,
    ModelStatusBody,
    ModelSummary,
    RuntimeBody,
)
from controlplane.api.services import ControlPlaneServices
from controlplane.auth import Scope, check_scope
from controlplane.errors import AuthError, InvalidPackageError, SnoozeError, UnavailableError
from controlplane.lifecycle.state import ModelState
from controlplane.settings import Settings
from controlplane.spec import MODEL_ID_PATTERN, DeploymentSpec, PackageKind
from controlplane.upload import too_large

log = logging.getLogger(__name__)

API_VERSION = "v1"
_MULTIPART_SLACK = 1024 * 1024  # form boundaries and the deployment field, on top of the archive
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in (
        (401, "Missing or invalid API key"),
        (403, "The key lacks the admin scope, or the action is disabled"),
        (404, "No such model"),
        (413, "Package larger than the upload limit"),
        (422, "Invalid package or request; the error names the file or field and the fix"),
    )
}
_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["package"],
                    "properties": {
                        "package": {
                            "type": "string",
                            "format": "binary",
                            "description": ".tar.gz, .tgz, .tar or .zip of the package folder (its files at the "
                            "root of the archive or in one top-level folder)",
                        },
                        "deployment": {
                            "type": "string",
                            "description": "JSON object of deployment fields (DeploymentSpec without 'path'), "
                            'e.g. {"max_batch_size": 8, "idle_timeout_secs": 120}',
                        },
                        "id": {"type": "string", "description": "Model id (or the 'id' query parameter)"},
                    },
                }
            }
        },
    }
}

ModelId = Annotated[str, Path(pattern=MODEL_ID_PATTERN, description="Model id", examples=["my-net"])]

# Declared for the OpenAPI document (the "Authorize" button); check_scope reads the headers itself.
_api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="An admin API key")
_bearer = HTTPBearer(auto_error=False, description="An admin API key as a bearer token")


def _error_response(exc: SnoozeError) -> JSONResponse:
    headers = {}
    if exc.status_code == 503:
        retry_after = exc.retry_after if isinstance(exc, UnavailableError) and exc.retry_after else 1
        headers["Retry-After"] = str(math.ceil(retry_after))
    if isinstance(exc, AuthError):
        headers["WWW-Authenticate"] = 'Bearer realm="snoozeml"'
    return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SnoozeError)
    async def snooze_error(request: Request, exc: SnoozeError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        message = describe_validation_errors(exc.errors(), f"{request.method} {request.url.path}")
        body = {"error": message, "code": "invalid_request", "hint": "see the API docs at /docs"}
        return JSONResponse(body, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, f"http_{exc.status_code}")
        body = {"error": f"{request.method} {request.url.path}: {exc.detail}", "code": code, "hint": "see /docs"}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        body = {
            "error": f"internal error: {type(exc).__name__}: {exc}",
            "code": "internal",
            "hint": "see the control plane's log",
        }
        return JSONResponse(body, status_code=500)


def _limited_receive(receive: Receive, limit: int, what: str) -> Receive:
    """Count the request body while it streams in and stop it at ``limit`` bytes."""
    seen = 0

    async def limited() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise too_large(what, limit - _MULTIPART_SLACK)
        return message

    return limited


def _admin_router(settings: Settings, services: ControlPlaneServices, ops: ModelOperations) -> APIRouter:
    """Every /v1 route, each behind the admin scope."""

    async def require_admin(
        request: Request,
        _key: Annotated[str | None, Security(_api_key_header)] = None,
        _token: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)] = None,
    ) -> None:
        check_scope(settings, request.headers, Scope.ADMIN, metrics=services.metrics, surface="api")

    router = APIRouter(prefix=f"/{API_VERSION}", dependencies=[Depends(require_admin)], responses=_ERRORS)
    _publish_routes(router, settings, ops)
    _model_routes(router, services, ops)
    return router


def _publish_routes(router: APIRouter, settings: Settings, ops: ModelOperations) -> None:
    """Publish: an uploaded archive, or a folder on the server's filesystem."""

    @router.post(
        "/models",
        status_code=201,
        response_model=ModelDetail,
        tags=["models"],
        summary="Publish a package archive",
        description="Upload a .tar.gz/.tgz/.tar/.zip of a package folder as multipart field `package`, with "
        "deployment settings as JSON in field `deployment`. The package is validated (manifest, "
        "signature, params, import of `snooze_model.py` in a child process) and rendered before the "
        "repository changes; the model folder then appears in one rename. A loaded model is reloaded.",
        openapi_extra=_UPLOAD_BODY,
    )
    async def publish_upload(
        request: Request,
        model_id: Annotated[str | None, Query(alias="id", description="Model id")] = None,
    ) -> dict[str, Any]:
        limit = int(settings.max_upload_mb * 2**20) + _MULTIPART_SLACK
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise too_large("the upload", limit - _MULTIPART_SLACK)
        limited = Request(request.scope, _limited_receive(request.receive, limit, "the upload"))
        async with limited.form(max_files=1, max_fields=4) as form:
            package = form.get("package")
            if not isinstance(package, UploadFile):
                raise InvalidPackageError(
                    "the upload has no file field 'package'",
                    hint="send the archive as multipart/form-data field 'package' (snoozectl publish does)",
                )
            archive_name = package.filename or "upload"
            if package.size is not None and package.size > limit - _MULTIPART_SLACK:
                raise too_large(archive_name, limit - _MULTIPART_SLACK)
            deployment = form.get("deployment")
            form_id = form.get("id")
            return await ops.publish_archive(
                package.file,
                archive_name,
                ids=[model_id, form_id if isinstance(form_id, str) else None],
                deployment_json=deployment if isinstance(deployment, str) else None,
            )

    @router.post(
        "/models:from-path",
        status_code=201,
        response_model=ModelDetail,
        tags=["models"],
        summary="Publish a package folder on the server",
        description="Publish the folder at `path` on the server's filesystem (absolute). Refused unless the "
        "server sets `SNOOZE_ALLOW_LOCAL_PATHS`.",
    )
    async def publish_path(deployment: Annotated[DeploymentSpec, Body()]) -> dict[str, Any]:
        return await ops.publish_path(deployment)


def _model_routes(router: APIRouter, services: ControlPlaneServices, ops: ModelOperations) -> None:
    """List, describe, delete, load and unload published models; the shared runtime."""

    @router.get(
        "/models",
        response_model=None,  # built from the lifecycle's own types: not validated again (10,000 models: seconds)
        responses={200: {"model": list[ModelSummary], "description": "The models, by id"}},
        tags=["models"],
        summary="List published models",
        description="By id. Filters: state, kind, id prefix. Pages: `limit`, then `after` = the header "
        "`X-Next-After` of the previous page (absent on the last page); `X-Total-Count`: how many match in all.",
    )
    async def list_models(
        state: Annotated[ModelState | None, Query(description="Only models in this state")] = None,
        kind: Annotated[PackageKind | None, Query(description="Only models of this kind")] = None,
        prefix: Annotated[str, Query(description="Only ids that start with this")] = "",
        limit: Annotated[int | None, Query(ge=1, description="At most this many (default: all)")] = None,
        after: Annotated[str, Query(description="The cursor: ids after this one")] = "",
    ) -> Response:
        kind_value = kind.value if kind is not None else None
        page = await ops.list(ListQuery(state=state, kind=kind_value, prefix=prefix, limit=limit, after=after))
        headers = {"X-Total-Count": str(page.total)}
        if page.next_after is not None:
            headers["X-Next-After"] = page.next_after
        # orjson: 10,000 models are 7 MB of JSON, 100-280 ms with the json module, 15-50 ms with orjson (measured)
        return Response(orjson.dumps(page.models, default=str), media_type="application/json", headers=headers)

    @router.get(
        "/models:summary",
        tags=["models"],
        summary="Counts by state and kind, memory held, the largest and most recently used models, publishing",
    )
    async def models_summary(
        top: Annotated[int, Query(ge=0, le=1000, description="Models in each list")] = SUMMARY_TOP,
    ) -> dict[str, Any]:
        return await ops.summary(top)

    @router.get(
        "/publishing",
        tags=["models"],
        summary="How far `serve --models` is in publishing its packages (in the background)",
    )
    async def publishing() -> dict[str, Any]:
        return services.publishing.describe() if services.publishing is not None else {"in_progress": False}

    @router.get(
        "/runtime",
        response_model=RuntimeBody,
        tags=["models"],
        summary="Processes shared by models, the eviction policy and the wake queue",
        description="The preloaded parents of preforked models: what each imported and the memory it holds "
        "itself (the pages its workers share with it, counted once; also counted in the memory budget); the "
        "eviction policy in use; and the wake queue (loads of sleeping models waiting for a load slot or for "
        "memory, oldest first).",
    )
    async def runtime() -> dict[str, Any]:
        return await run_in_threadpool(services.lifecycle.runtime)

    @router.get(
        "/models/{model_id}",
        response_model=ModelDetail,
        tags=["models"],
        summary="Describe one model",
        description="Deployment, signature, params, manifest metadata, generated config, lifecycle state, "
        "and Triton's statistics while it is loaded.",
    )
    async def get_model(model_id: ModelId) -> dict[str, Any]:
        return await ops.describe(model_id)

    @router.delete(
        "/models/{model_id}",
        status_code=204,
        tags=["models"],
        summary="Unload and delete a model",
        response_class=Response,
    )
    async def delete_model(model_id: ModelId) -> Response:
        await ops.delete(model_id)
        return Response(status_code=204)

    @router.post(
        "/models/{model_id}/load",
        response_model=ModelStatusBody,
        tags=["lifecycle"],
        summary="Load (wake) a model",
        description="Returns once the model is ready (a cold start).",
    )
    async def load_model(model_id: ModelId, body: Annotated[LoadRequest | None, Body()] = None) -> dict[str, Any]:
        return await ops.load(model_id, body.instances if body else None)

    @router.post(
        "/models/{model_id}/unload",
        response_model=ModelStatusBody,
        tags=["lifecycle"],
        summary="Unload a model",
        description="It wakes again on its next request.",
    )
    async def unload_model(model_id: ModelId) -> dict[str, Any]:
        return await ops.unload(model_id)


def create_app(settings: Settings, services: ControlPlaneServices) -> FastAPI:
    """The control API over ``services``; nothing global, so several apps can live in one process."""
    app = FastAPI(
        title="snoozeml control API",
        version=API_VERSION,
        description="Publish model packages to Triton and manage their lifecycle. Every /v1 route needs an "
        "admin API key (X-API-Key or Authorization: Bearer). Errors are JSON: {error, code, hint}.",
        docs_url=None,  # served below from packaged assets: FastAPI's own pages load them from a CDN
        redoc_url=None,
    )
    _install_error_handlers(app)
    install_offline_docs(app)
    app.include_router(_admin_router(settings, services, ModelOperations(services)))

    @app.get("/health/live", tags=["health"], summary="The control API is running")
    async def live() -> dict[str, str]:
        return {"status": "live"}

    @app.get(
        "/health/ready",
        tags=["health"],
        summary="Triton is reachable and ready",
        responses={503: {"model": ErrorBody, "description": "Triton is not ready"}},
    )
    async def ready() -> dict[str, str]:
        if not await services.triton.ready():
            raise UnavailableError(
                f"Triton at {services.triton.http_url} is not ready",
                hint="wait for it to start, or check its log",
                retry_after=1,
            )
        return {"status": "ready"}

    @app.get(
        "/metrics",
        tags=["health"],
        summary="snoozeml's metrics and Triton's own (nv_*: per-model requests, failures, latency) in Prometheus "
        "text format",
    )
    async def metrics() -> Response:
        triton = (await _triton_metrics(services)).encode()
        return Response(services.metrics.render() + triton, media_type=CONTENT_TYPE_LATEST)

    return app


async def _triton_metrics(services: ControlPlaneServices) -> str:
    """Triton's metrics port is not one of snoozeml's: its text is passed on here. Triton drops a model's
    nv_* series when the model unloads, so they restart from zero after each wake (rate() copes)."""
    if services.triton.metrics_url is None:
        return ""
    try:
        text = await services.triton.metrics_text()
    except SnoozeError as exc:
        return f"# Triton's metrics are unavailable: {exc.message}\n"
    return f"# Triton's own metrics, from {services.triton.metrics_url}/metrics\n{text}"


DOCS_ASSETS = "/docs-assets"


def install_offline_docs(app: FastAPI) -> None:
    """/docs (Swagger UI) and /redoc with their scripts and styles served from an installed package,
    so that they work on a machine without internet access."""
    from importlib.resources import files

    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
    from starlette.staticfiles import StaticFiles

    assets = files("fastapi_offline") / "static"
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(assets)), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> Response:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - docs",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png",
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> Response:
        return get_redoc_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{DOCS_ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{DOCS_ASSETS}/favicon.png",
            with_google_fonts=False,
        )
