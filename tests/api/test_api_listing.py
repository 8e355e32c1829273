"""`GET /v1/models` at scale: filters, pages after a cursor, the summary, and another writer's publish."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from controlplane.render import embedded_target
from controlplane.spec import DeploymentSpec, resolve
from controlplane.store import ModelStore
from harness.api import ADMIN, RecordingLifecycle

IDS = ["a-1", "a-2", "a-3", "b-1", "b-2"]


@pytest.fixture
def published(store: ModelStore, make_package: Callable[..., Path]) -> list[str]:
    package = make_package()
    for model_id in IDS:
        store.publish(resolve(DeploymentSpec(id=model_id, path=package)))
    return IDS


async def _pages(client: httpx.AsyncClient, **params: str | int) -> tuple[list[list[str]], list[str]]:
    pages: list[list[str]] = []
    totals: list[str] = []
    after = ""
    while True:
        r = await client.get("/v1/models", headers=ADMIN, params={**params, "after": after})
        assert r.status_code == 200, r.text
        pages.append([m["id"] for m in r.json()])
        totals.append(r.headers["X-Total-Count"])
        if "X-Next-After" not in r.headers:
            return pages, totals
        after = r.headers["X-Next-After"]


@pytest.mark.usefixtures("published")
async def test_pages_follow_the_cursor_in_id_order_and_cover_every_model_once(client: httpx.AsyncClient) -> None:
    pages, totals = await _pages(client, limit=2)
    assert pages == [["a-1", "a-2"], ["a-3", "b-1"], ["b-2"]]
    assert set(totals) == {"5"}


@pytest.mark.usefixtures("published")
async def test_prefix_and_kind_filter(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models", headers=ADMIN, params={"prefix": "b-"})
    assert [m["id"] for m in r.json()] == ["b-1", "b-2"] and r.headers["X-Total-Count"] == "2"
    r = await client.get("/v1/models", headers=ADMIN, params={"kind": "onnx"})
    assert r.json() == [] and r.headers["X-Total-Count"] == "0"
    r = await client.get("/v1/models", headers=ADMIN, params={"kind": "custom", "prefix": "a-", "limit": 1})
    assert [m["id"] for m in r.json()] == ["a-1"] and r.headers["X-Next-After"] == "a-1"


@pytest.mark.usefixtures("published")
async def test_state_filter_uses_the_lifecycle_state(client: httpx.AsyncClient, lifecycle: RecordingLifecycle) -> None:
    await client.post("/v1/models/b-1/load", headers=ADMIN)
    r = await client.get("/v1/models", headers=ADMIN, params={"state": "ready"})
    assert [m["id"] for m in r.json()] == ["b-1"]
    assert r.json()[0]["status"]["state"] == "ready"
    r = await client.get("/v1/models", headers=ADMIN, params={"state": "unloaded", "limit": 10})
    assert [m["id"] for m in r.json()] == ["a-1", "a-2", "a-3", "b-2"]
    lifecycle.calls.clear()
    r = await client.get("/v1/models", headers=ADMIN, params={"state": "unloaded", "limit": 2})
    assert [m["id"] for m in r.json()] == ["a-1", "a-2"] and r.headers["X-Total-Count"] == "4"
    assert [c for c in lifecycle.calls if c[0] == "statuses"] == [("statuses", "2")]  # the page's only


async def test_an_unknown_filter_value_is_refused_naming_the_field(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models", headers=ADMIN, params={"state": "sleepy"})
    assert r.status_code == 422 and "state" in r.text


@pytest.mark.usefixtures("published")
async def test_a_page_reads_only_its_own_statuses(client: httpx.AsyncClient, lifecycle: RecordingLifecycle) -> None:
    await client.get("/v1/models", headers=ADMIN, params={"limit": 2})
    assert ("statuses", "2") in lifecycle.calls
    assert not [c for c in lifecycle.calls if c[0] == "statuses" and c[1] == "5"]


@pytest.mark.usefixtures("published")
async def test_summary_counts_states_kinds_and_lists_the_largest(
    client: httpx.AsyncClient, lifecycle: RecordingLifecycle
) -> None:
    await client.post("/v1/models/a-2/load", headers=ADMIN)
    lifecycle.states["a-2"] = replace(lifecycle.states["a-2"], memory_bytes=5 << 20, last_access=1000.0)
    r = await client.get("/v1/models:summary", headers=ADMIN)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["total"] == 5 and body["states"] == {"unloaded": 4, "ready": 1} and body["kinds"] == {"custom": 5}
    assert body["memory_bytes"] == 5 << 20
    assert [m["id"] for m in body["largest"]] == ["a-2"] and [m["id"] for m in body["recent"]] == ["a-2"]
    assert body["publishing"] is None


@pytest.mark.usefixtures("published")
async def test_another_writers_publish_shows_after_the_next_scan(
    client: httpx.AsyncClient, store: ModelStore, make_package: Callable[..., Path]
) -> None:
    other = ModelStore(store.repository, embedded_target())  # a fleet's other node on the same repository
    other.publish(resolve(DeploymentSpec(id="c-1", path=make_package("other"))))
    assert "c-1" in store.ids()  # a listing that may not be stale scans again
    other.delete("a-1")
    assert [m.id for m in store.list()] == ["a-2", "a-3", "b-1", "b-2", "c-1"]


@pytest.mark.usefixtures("published")
async def test_a_listing_from_the_kept_summaries_is_the_same_json_and_follows_a_change(
    client: httpx.AsyncClient, store: ModelStore, lifecycle: RecordingLifecycle, make_package: Callable[..., Path]
) -> None:
    """A model at rest keeps its status object, and its listed JSON is kept from the second listing on
    (``ModelOperations._listed_json``): the answer is byte for byte a fresh one's, and a new status (a load) or a
    new publish (a republish, its status unchanged) is listed as it is now."""
    first = (await client.get("/v1/models", headers=ADMIN)).content
    for _ in range(2):  # the second listing keeps each model's JSON, the third answers from it
        assert (await client.get("/v1/models", headers=ADMIN)).content == first
    await client.post("/v1/models/b-1/load", headers=ADMIN)
    unchanged = lifecycle.states["a-1"]
    store.publish(resolve(DeploymentSpec(id="a-1", path=make_package("again"), max_batch_size=3)))
    listed = {m["id"]: m for m in (await client.get("/v1/models", headers=ADMIN)).json()}
    assert lifecycle.states["a-1"] is unchanged  # the same status object: only the publish tells the change
    assert listed["b-1"]["status"]["state"] == "ready" and listed["b-2"]["status"]["state"] == "unloaded"
    assert listed["a-1"]["max_batch_size"] == 3 and listed["a-2"]["max_batch_size"] == 8
