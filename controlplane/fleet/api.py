"""The fleet API: the control API of every node, seen as one.

The nodes share one model store, so a publish or delete goes to one live node (which validates it
once and writes it atomically; the others pick it up from the store within ``store_poll_secs``).
Status merges every node's view: per model, which nodes hold it loaded and their memory. A load goes
through the fleet gateway (the node that owns the model loads it); an unload goes to every node.
The same keys as the nodes: requests carry the client's key on to them, and every /v1 route needs the
admin scope here too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from controlplane.api.app import install_offline_docs
from controlplane.auth import Scope, check_scope, presented_key
from controlplane.errors import ConflictError, NotFoundError, SnoozeError, UnavailableError
from controlplane.fleet.gateway import NodeAddress
from controlplane.settings import Settings

# Headers a node needs from the client's request (auth, the body's type); the rest is the fleet API's.
_FORWARD = ("x-api-key", "authorization", "content-type")
_LOADED = ("ready", "loading", "unloading")

NodesFn = Callable[[], Sequence[NodeAddress]]


def merge_status(per_node: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One model's status across nodes: loaded where any node has it, summed instances and memory,
    the latest access, and ``nodes`` (name -> that node's state, instances, memory) for nodes holding it
    or failing it."""
    if not per_node:
        return {"state": "unloaded", "nodes": {}}
    states = [s["state"] for s in per_node.values()]
    state = next((s for s in ("ready", "loading", "unloading", "failed") if s in states), states[0])
    holding = {n: s for n, s in per_node.items() if s["state"] in _LOADED or s["state"] == "failed"}
    first = next(iter(per_node.values()))
    accesses = [a for s in per_node.values() if (a := s.get("last_access"))]
    colds = [c for s in per_node.values() if (c := s.get("last_cold_start_secs"))]
    memory = [m for s in holding.values() if (m := s.get("memory_bytes"))]
    return {
        **first,
        "state": state,
        "reason": next((s.get("reason") for s in holding.values() if s["state"] == state), first.get("reason")),
        "instances": sum(int(s.get("instances") or 0) for s in holding.values()),
        "last_access": max(accesses) if accesses else None,
        "memory_bytes": sum(memory) if memory else None,
        "last_cold_start_secs": max(colds) if colds else None,
        "load_count": sum(int(s.get("load_count") or 0) for s in per_node.values()),
        "nodes": {
            n: {k: s.get(k) for k in ("state", "reason", "instances", "memory_bytes", "memory_source")}
            for n, s in sorted(holding.items())
        },
    }


class FleetClient:
    """Calls to every node's control API, concurrently; dead nodes are left out (and named)."""

    def __init__(self, nodes: NodesFn, *, timeout: float = 10.0) -> None:
        self.nodes = nodes
        self.http = httpx.AsyncClient(timeout=timeout)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def each(
        self, method: str, path: str, headers: dict[str, str], **kw: Any
    ) -> dict[str, httpx.Response | Exception]:
        nodes = list(self.nodes())

        async def call(node: NodeAddress) -> httpx.Response | Exception:
            try:
                return await self.http.request(method, f"{node.api_url}{path}", headers=headers, **kw)
            except httpx.HTTPError as e:
                return e

        answers = await asyncio.gather(*(call(n) for n in nodes))
        return {n.name: a for n, a in zip(nodes, answers, strict=True)}

    async def first_live(self, send: Callable[[NodeAddress], Awaitable[httpx.Response]]) -> httpx.Response:
        """``send`` to the first node that answers; UnavailableError when none does."""
        errors = []
        for node in self.nodes():
            try:
                return await send(node)
            except httpx.TransportError as e:
                errors.append(f"{node.name}: {e}")
        raise UnavailableError(
            "no node of the fleet answers: " + ("; ".join(errors) or "no nodes"),
            hint="check the nodes (snoozectl status per node) and the fleet's node list",
            retry_after=2,
        )


def _answered(responses: dict[str, httpx.Response | Exception]) -> dict[str, httpx.Response]:
    return {n: r for n, r in responses.items() if isinstance(r, httpx.Response)}


def _relay(r: httpx.Response) -> Response:
    return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))


class FleetApi:
    """The route handlers; ``nodes`` is called on every request (a static list, or a DNS lookup)."""

    def __init__(self, settings: Settings, nodes: NodesFn, *, gateway_http_url: str) -> None:
        self.settings = settings
        self.nodes = nodes
        self.gateway_http_url = gateway_http_url
        self.fleet = FleetClient(nodes)

    def admin(self, request: Request) -> dict[str, str]:
        """The admin scope, checked here as on the nodes; the headers the nodes need."""
        check_scope(self.settings, request.headers, Scope.ADMIN, surface="fleet api")
        return {k: v for k, v in request.headers.items() if k in _FORWARD}

    async def _statuses(self, request: Request, path: str) -> tuple[dict[str, Any], list[str]]:
        answers = _answered(await self.fleet.each("GET", path, self.admin(request)))
        dead = sorted({n.name for n in self.nodes()} - set(answers))
        for r in answers.values():
            if r.status_code in (401, 403):
                raise SnoozeError(r.json().get("error", "refused by a node"))
        return {n: r.json() for n, r in answers.items() if r.status_code == 200}, dead

    @staticmethod
    def _merged(per_node_models: dict[str, dict[str, Any]], dead: list[str]) -> dict[str, Any]:
        first = next(iter(per_node_models.values()))
        status = merge_status({n: m["status"] for n, m in per_node_models.items()})
        return {**first, "status": {**status, "unreachable_nodes": dead}}

    async def live(self) -> dict[str, str]:
        return {"status": "live"}

    async def ready(self) -> dict[str, Any]:
        answers = _answered(await self.fleet.each("GET", "/health/ready", {}))
        up = sorted(n for n, r in answers.items() if r.status_code == 200)
        if not up:
            raise UnavailableError("no node of the fleet is ready", hint="check the nodes' logs", retry_after=2)
        return {"status": "ready", "ready_nodes": up}

    async def list_nodes(self, request: Request) -> list[dict[str, Any]]:
        answers = await self.fleet.each("GET", "/health/ready", {})
        models, _ = await self._statuses(request, "/v1/models")
        out = []
        for node in self.nodes():
            answer = answers.get(node.name)
            loaded = sorted(m["id"] for m in models.get(node.name, []) if m["status"]["state"] in _LOADED)
            ok = isinstance(answer, httpx.Response) and answer.status_code == 200
            out.append({"name": node.name, "api_url": node.api_url, "ready": ok, "loaded": loaded})
        return out

    async def list_models(self, request: Request) -> list[dict[str, Any]]:
        per_node, dead = await self._statuses(request, "/v1/models")
        by_model: dict[str, dict[str, Any]] = {}
        for node, models in per_node.items():
            for m in models:
                by_model.setdefault(m["id"], {})[node] = m
        return [self._merged(by_model[m], dead) for m in sorted(by_model)]

    async def get_model(self, model_id: str, request: Request) -> dict[str, Any]:
        per_node, dead = await self._statuses(request, f"/v1/models/{model_id}")
        if not per_node:
            raise NotFoundError(f"model '{model_id}' is not published on any live node of the fleet")
        return self._merged(per_node, dead)

    async def forward_to_one(self, request: Request) -> Response:
        """Publish or delete: one live node validates and writes the shared store; the others see it
        within their store_poll_secs."""
        headers = self.admin(request)
        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        http = self.fleet.http
        r = await self.fleet.first_live(
            lambda node: http.request(request.method, f"{node.api_url}{path}", content=body, headers=headers)
        )
        return _relay(r)

    async def load(self, model_id: str, request: Request) -> Any:
        """Through the fleet gateway: the node that owns the model (the ring) loads it."""
        self.admin(request)
        body = await request.body()
        if body and (await request.json()).get("instances") is not None:
            raise ConflictError(
                f"model '{model_id}': an instance count is a node's business in a fleet",
                hint="load it through the fleet (the owning node loads it), or call that node's API with instances",
            )
        key = presented_key(request.headers)
        url = f"{self.gateway_http_url}/v2/repository/models/{model_id}/load"
        try:
            r = await self.fleet.http.post(url, headers={"x-api-key": key} if key else {})
        except httpx.TransportError as e:
            raise UnavailableError(f"the fleet gateway at {self.gateway_http_url} is not reachable: {e}") from e
        if r.status_code != 200:
            return _relay(r)
        return await self.get_model(model_id, request)

    async def unload(self, model_id: str, request: Request) -> Any:
        """Every node that holds it lets it go."""
        answers = _answered(await self.fleet.each("POST", f"/v1/models/{model_id}/unload", self.admin(request)))
        refused = [r for r in answers.values() if r.status_code >= 400]
        if refused and len(refused) == len(answers):
            return _relay(refused[0])
        return await self.get_model(model_id, request)


def create_fleet_app(settings: Settings, nodes: NodesFn, *, gateway_http_url: str) -> FastAPI:
    """The fleet API's ASGI app; nothing global, so several can live in one process."""
    app = FastAPI(
        title="snoozeml fleet API",
        description="The control API of every node of a snoozeml fleet, seen as one. Errors: {error, code, hint}.",
        docs_url=None,  # served from packaged assets below (FastAPI's own pages load them from a CDN)
        redoc_url=None,
    )
    install_offline_docs(app)
    api = FleetApi(settings, nodes, gateway_http_url=gateway_http_url)
    app.router.on_shutdown.append(api.fleet.aclose)

    @app.exception_handler(SnoozeError)
    async def snooze_error(_: Request, exc: SnoozeError) -> JSONResponse:
        headers = (
            {"Retry-After": str(round(exc.retry_after))}
            if isinstance(exc, UnavailableError) and exc.retry_after
            else None
        )
        return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=headers)

    app.add_api_route("/health/live", api.live, methods=["GET"])
    app.add_api_route("/health/ready", api.ready, methods=["GET"])
    app.add_api_route("/v1/nodes", api.list_nodes, methods=["GET"])
    app.add_api_route("/v1/models", api.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id}", api.get_model, methods=["GET"])
    for route in ("/v1/models", "/v1/models:from-path"):
        app.add_api_route(route, api.forward_to_one, methods=["POST"])
    app.add_api_route("/v1/models/{model_id}", api.forward_to_one, methods=["DELETE"])
    app.add_api_route("/v1/models/{model_id}/load", api.load, methods=["POST"])
    app.add_api_route("/v1/models/{model_id}/unload", api.unload, methods=["POST"])
    return app
