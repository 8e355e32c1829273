"""Listing, describing, deleting, loading and unloading through the API."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from controlplane.store import ModelStore
from harness.api import ADMIN, RecordingLifecycle, tar_gz, upload


@pytest.fixture
async def two_models(client: httpx.AsyncClient, make_package: Callable[..., Path]) -> None:
    archive = tar_gz(make_package())
    for model_id in ("alpha", "beta"):
        r = await upload(client, archive, model_id=model_id, deployment={"idle_timeout_secs": 90})
        assert r.status_code == 201, r.text


@pytest.mark.usefixtures("two_models")
async def test_list_shows_every_model_with_its_status(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models", headers=ADMIN)
    assert r.status_code == 200
    models = r.json()
    assert [m["id"] for m in models] == ["alpha", "beta"]
    assert models[0]["status"]["state"] == "unloaded"
    assert models[0]["kind"] == "custom" and models[0]["device"] == "cpu"


async def test_list_is_empty_without_models(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models", headers=ADMIN)
    assert r.status_code == 200 and r.json() == []


@pytest.mark.usefixtures("two_models")
async def test_get_describes_one_model(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models/alpha", headers=ADMIN)
    assert r.status_code == 200
    body = r.json()
    assert body["deployment"]["idle_timeout_secs"] == 90
    assert body["inputs"] == [{"name": "x", "datatype": "FP32", "dims": [3]}]
    assert body["metadata"]["interface"] == {"x": "three floats"}
    assert body["params"] == {"scale": 1.0}
    assert body["config"].startswith('name: "alpha"')
    assert body["stats"] is None


async def test_unknown_model_is_404_naming_it(client: httpx.AsyncClient) -> None:
    for method, path in (
        ("GET", "/v1/models/ghost"),
        ("DELETE", "/v1/models/ghost"),
        ("POST", "/v1/models/ghost/load"),
        ("POST", "/v1/models/ghost/unload"),
    ):
        r = await client.request(method, path, headers=ADMIN)
        assert r.status_code == 404, (method, path)
        assert r.json()["code"] == "not_found" and "'ghost'" in r.json()["error"]


async def test_invalid_model_id_in_path_is_refused(client: httpx.AsyncClient, store: ModelStore) -> None:
    r = await client.delete("/v1/models/%2E%2E", headers=ADMIN)
    assert r.status_code == 422
    assert r.json()["code"] == "invalid_request"
    assert store.repository.is_dir()


@pytest.mark.usefixtures("two_models")
async def test_load_and_unload_go_through_the_lifecycle(
    client: httpx.AsyncClient, lifecycle: RecordingLifecycle
) -> None:
    r = await client.post("/v1/models/alpha/load", json={"instances": 2}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "ready" and r.json()["instances"] == 2
    r = await client.post("/v1/models/beta/load", headers=ADMIN)  # no body: the deployment's instances
    assert r.status_code == 200
    r = await client.post("/v1/models/alpha/unload", headers=ADMIN)
    assert r.json()["state"] == "unloaded"
    assert lifecycle.calls[-3:] == [("load", "alpha", "2"), ("load", "beta", "None"), ("unload", "alpha", "api")]


async def test_load_rejects_bad_instances(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/models/alpha/load", json={"instances": 0}, headers=ADMIN)
    assert r.status_code == 422
    assert "field 'instances'" in r.json()["error"]


@pytest.mark.usefixtures("two_models")
async def test_delete_forgets_then_removes(
    client: httpx.AsyncClient, lifecycle: RecordingLifecycle, store: ModelStore
) -> None:
    r = await client.delete("/v1/models/alpha", headers=ADMIN)
    assert r.status_code == 204
    assert ("forget", "alpha") in lifecycle.calls
    assert store.ids() == ["beta"]
    assert (await client.get("/v1/models/alpha", headers=ADMIN)).status_code == 404


async def test_unknown_route_answers_the_json_error_shape(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/nothing", headers=ADMIN)
    assert r.status_code == 404
    assert set(r.json()) == {"error", "code", "hint"}


async def test_runtime_lists_the_preloaded_parents_the_eviction_policy_and_the_wake_queue_for_admins(
    client: httpx.AsyncClient,
) -> None:
    r = await client.get("/v1/runtime", headers=ADMIN)
    assert r.status_code == 200 and r.json()["preloaded_parents"] == [] and r.json()["overhead_bytes"] == 0
    assert r.json()["eviction_policy"] == {"name": "gdsf"}
    assert r.json()["wake_queue"]["waiting"] == [{"model": "m", "waiting_for": "a load slot", "wait_secs": 0.5}]
    assert (await client.get("/v1/runtime")).status_code == 401


async def test_docs_pages_load_their_assets_from_this_server_not_a_cdn(client: httpx.AsyncClient) -> None:
    import re

    for page in ("/docs", "/redoc"):
        r = await client.get(page)
        assert r.status_code == 200
        urls = re.findall(r"""(?:src|href|url)\s*[:=]\s*['"]([^'"]+)['"]""", r.text)
        assert urls, r.text
        external = [u for u in urls if u.startswith(("http:", "https:", "//"))]
        assert external == [], (page, external)  # an air-gapped machine would show a blank page
        for url in urls:
            if url.startswith("/docs-assets/"):
                asset = await client.get(url)
                assert asset.status_code == 200 and len(asset.content) > 1000, url
    assert (await client.get("/openapi.json")).json()["info"]["title"] == "snoozeml control API"
