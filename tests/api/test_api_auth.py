"""Admin scope on every /v1 route; health and metrics stay open."""

from __future__ import annotations

import httpx
import pytest

from controlplane.api.services import ControlPlaneServices
from controlplane.settings import Settings
from harness.api import ADMIN_KEY, INFERENCE_KEY

V1_ROUTES = [
    ("GET", "/v1/models"),
    ("POST", "/v1/models"),
    ("POST", "/v1/models:from-path"),
    ("GET", "/v1/models/m1"),
    ("DELETE", "/v1/models/m1"),
    ("POST", "/v1/models/m1/load"),
    ("POST", "/v1/models/m1/unload"),
]


@pytest.mark.parametrize(("method", "path"), V1_ROUTES)
async def test_every_v1_route_needs_an_admin_key(client: httpx.AsyncClient, method: str, path: str) -> None:
    r = await client.request(method, path)
    assert r.status_code == 401
    assert r.json()["error"] == "missing API key"
    assert "X-API-Key" in r.json()["hint"]
    assert r.headers["www-authenticate"].startswith("Bearer")
    r = await client.request(method, path, headers={"X-API-Key": "wrong"})
    assert r.status_code == 401 and r.json()["error"] == "invalid API key"
    r = await client.request(method, path, headers={"X-API-Key": INFERENCE_KEY})
    assert r.status_code == 403 and "'admin' scope" in r.json()["error"]


async def test_admin_key_as_bearer_token(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200


async def test_refusals_are_counted(client: httpx.AsyncClient, services: ControlPlaneServices) -> None:
    await client.get("/v1/models")
    await client.get("/v1/models", headers={"X-API-Key": "wrong"})
    await client.get("/v1/models", headers={"X-API-Key": INFERENCE_KEY})
    text = (await client.get("/metrics")).text
    for reason in ("missing", "invalid", "scope"):
        assert f'snooze_auth_failures_total{{reason="{reason}",surface="api"}} 1.0' in text


async def test_auth_off_lets_everything_through(client: httpx.AsyncClient, settings: Settings) -> None:
    settings.auth = "off"
    assert (await client.get("/v1/models")).status_code == 200


async def test_health_and_metrics_need_no_key(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health/live")).json() == {"status": "live"}
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")


async def test_ready_is_503_with_retry_after_when_triton_is_down(client: httpx.AsyncClient) -> None:
    r = await client.get("/health/ready")
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.json()["code"] == "unavailable" and "Triton" in r.json()["error"]


async def test_openapi_documents_routes_and_key_schemes(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    assert doc["paths"]["/v1/models"]["post"]["summary"] == "Publish a package archive"
    assert "multipart/form-data" in doc["paths"]["/v1/models"]["post"]["requestBody"]["content"]
    assert {"/v1/models:from-path", "/v1/models/{model_id}/load", "/health/ready", "/metrics"} <= set(doc["paths"])
    assert set(doc["components"]["securitySchemes"]) == {"APIKeyHeader", "HTTPBearer"}
