"""The control plane's side of BLS wake-ups (controlplane/gateway/bls_wake.py): the wake route, its unix socket with
the stub's own client on the other end, the declared ``wakes`` of a deployment.

The lifecycle is a stand-in that records its wake-ups (the real one, with a real Triton, is in
tests/integration/gateway/test_gateway_bls.py and tests/reliability/test_bls_wake.py); the store is real.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from controlplane.errors import UnavailableError
from controlplane.gateway.bls_wake import (
    MAX_DOZE_ROOM_SECS,
    MAX_WAKE_SECS,
    BlsWakeServer,
    DeclaredWakes,
    create_wake_app,
)
from controlplane.lifecycle.state import ModelState
from controlplane.render import embedded_target
from controlplane.spec import DeploymentSpec, resolve
from controlplane.store import ModelStore
from harness.api import MANIFEST, MODEL_PY
from python_backend import bls_wake, doze


class WakingLifecycle:
    """Records each wake-up (``serving``) with its bound; ``refuse`` makes the next ones fail as a load that cannot
    start in time does."""

    def __init__(self) -> None:
        self.woken: list[tuple[str, float | None]] = []
        self.refuse: UnavailableError | None = None

        self.asked: list[tuple[str, tuple[int, int] | None, float]] = []  # dozing stubs' asks for room

    @contextlib.asynccontextmanager
    async def serving(self, model_id: str, *, timeout: float | None = None) -> AsyncIterator[None]:
        self.woken.append((model_id, timeout))
        if self.refuse is not None:
            raise self.refuse
        yield

    async def admit_doze_wake(self, model_id: str, stub: tuple[int, int] | None, *, timeout: float) -> dict:
        self.asked.append((model_id, stub, timeout))
        return {"admitted": False, "why": "320 of 300 MiB are held by models in use"}


@pytest.fixture
def store(tmp_path: Path) -> ModelStore:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "snooze_model.py").write_text(MODEL_PY)
    (package / "snooze_model.json").write_text(json.dumps(MANIFEST))
    store = ModelStore(tmp_path / "repo", embedded_target())
    for name, wakes in (("back", []), ("front", ["back", "ghost"])):
        store.publish(resolve(DeploymentSpec(id=name, path=package, wakes=wakes)))
    return store


async def post(app: object, callee: str, body: object) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://wake") as client:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await client.post(bls_wake.WAKE_PATH + callee, content=content)


async def test_the_route_wakes_a_published_callee_within_the_call_s_bound(store: ModelStore) -> None:
    lifecycle = WakingLifecycle()
    r = await post(create_wake_app(lifecycle, store), "back", {"caller": "front", "timeout_secs": 4.5})
    assert r.status_code == 200 and r.json()["state"] == "ready"
    assert lifecycle.woken == [("back", 4.5)]


async def test_a_callee_that_is_not_published_is_named_with_its_caller(store: ModelStore) -> None:
    lifecycle = WakingLifecycle()
    r = await post(create_wake_app(lifecycle, store), "ghost", {"caller": "front", "timeout_secs": 4.5})
    assert r.status_code == 404 and lifecycle.woken == []
    assert "model 'ghost' is not published" in r.json()["error"]
    assert "the model name 'front' passes to its BLS call" in r.json()["error"]


async def test_a_callee_that_cannot_wake_in_time_is_503_with_retry_after(store: ModelStore) -> None:
    lifecycle = WakingLifecycle()
    lifecycle.refuse = UnavailableError("model 'back' is not ready after 4.5s (it is loading)", retry_after=3)
    r = await post(create_wake_app(lifecycle, store), "back", {"caller": "front", "timeout_secs": 4.5})
    assert r.status_code == 503 and r.headers["Retry-After"] == "3"
    assert "not ready after 4.5s" in r.json()["error"]


@pytest.mark.parametrize(
    ("body", "bound"),
    [(b"", MAX_WAKE_SECS), (b"not json", MAX_WAKE_SECS), ({"timeout_secs": "NaN"}, MAX_WAKE_SECS),
     ({"timeout_secs": 1e9}, MAX_WAKE_SECS), ({"timeout_secs": -3}, 0.0), ({"timeout_secs": 2}, 2.0)],
)  # fmt: skip
async def test_a_missing_or_wrong_bound_is_held_to_the_route_s_own(
    store: ModelStore, body: object, bound: float
) -> None:
    lifecycle = WakingLifecycle()
    await post(create_wake_app(lifecycle, store), "back", body)
    assert lifecycle.woken == [("back", bound)]


async def test_the_stub_s_client_wakes_through_the_socket_only_its_uid_may_use(
    store: ModelStore, tmp_path: Path
) -> None:
    lifecycle = WakingLifecycle()
    server = BlsWakeServer(lifecycle, store, tmp_path / "journal" / bls_wake.WAKE_SOCKET)
    await server.start()
    try:
        assert stat.S_IMODE(server.path.stat().st_mode) == 0o600
        await asyncio.to_thread(bls_wake.wake, "back", "front", 5.0, str(server.path))
        assert lifecycle.woken[0][0] == "back" and 0 < (lifecycle.woken[0][1] or 0) <= 5.0
        with pytest.raises(bls_wake.WakeFailed, match="model 'ghost' is not published"):
            await asyncio.to_thread(bls_wake.wake, "ghost", "front", 5.0, str(server.path))
    finally:
        await server.stop()
    assert not server.path.exists()
    with pytest.raises(bls_wake.WakeFailed, match="no snoozeml control plane listens at"):
        bls_wake.wake("back", "front", 5.0, str(server.path))


@pytest.mark.parametrize(
    ("body", "stub", "bound"),
    [({"stub": [41, 7], "timeout_secs": 2}, (41, 7), 2.0), (b"", None, MAX_DOZE_ROOM_SECS),
     (b"not json", None, MAX_DOZE_ROOM_SECS), ({"stub": "41", "timeout_secs": "NaN"}, None, MAX_DOZE_ROOM_SECS),
     ({"stub": [41, 7, 3], "timeout_secs": 1e9}, None, MAX_DOZE_ROOM_SECS), ({"timeout_secs": -3}, None, 0.0)],
)  # fmt: skip
async def test_a_dozing_stub_s_ask_for_room_reaches_the_lifecycle_and_is_never_refused(
    store: ModelStore, body: object, stub: tuple[int, int] | None, bound: float
) -> None:
    lifecycle = WakingLifecycle()
    transport = httpx.ASGITransport(app=create_wake_app(lifecycle, store))
    async with httpx.AsyncClient(transport=transport, base_url="http://wake") as client:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await client.post(doze.ADMIT_PATH + "back", content=content)
    assert r.status_code == 200 and r.json()["admitted"] is False and "held by models in use" in r.json()["why"]
    assert lifecycle.asked == [("back", stub, bound)]


async def test_the_stub_s_ask_for_room_goes_through_the_socket(store: ModelStore, tmp_path: Path) -> None:
    lifecycle = WakingLifecycle()
    server = BlsWakeServer(lifecycle, store, tmp_path / "journal" / bls_wake.WAKE_SOCKET)
    await server.start()
    try:
        answer = await asyncio.to_thread(doze.ask_room, "back", (41, 7), 5.0, str(server.path))
        odd = await asyncio.to_thread(doze.ask_room, "a b.ü", (41, 7), 5.0, str(server.path))  # quoted in the path
    finally:
        await server.stop()
    assert answer["admitted"] is False and odd["model"] == "a b.ü"
    assert lifecycle.asked == [("back", (41, 7), 4.5), ("a b.ü", (41, 7), 4.5)]
    with pytest.raises(doze.AskFailed, match="no snoozeml control plane listens at"):
        doze.ask_room("back", (41, 7), 5.0, str(server.path))


async def test_a_socket_left_by_an_earlier_run_is_replaced(store: ModelStore, tmp_path: Path) -> None:
    path = tmp_path / bls_wake.WAKE_SOCKET
    path.write_text("left behind")
    server = BlsWakeServer(WakingLifecycle(), store, path)
    await server.start()
    try:
        assert stat.S_ISSOCK(path.stat().st_mode)
    finally:
        await server.stop()


async def test_declared_wakes_start_when_their_model_s_load_starts_from_sleep(store: ModelStore) -> None:
    lifecycle = WakingLifecycle()
    wakes = DeclaredWakes(lifecycle, store)
    wakes.on_state("front", ModelState.UNLOADED)
    wakes.on_state("front", ModelState.LOADING)
    await asyncio.sleep(0)  # the wake-ups are tasks: they run once the transition has gone on
    await wakes.aclose()
    assert lifecycle.woken == [("back", None)]  # 'ghost' is not published: logged, not woken

    lifecycle.woken.clear()
    wakes.on_state("front", ModelState.READY)
    wakes.on_state("front", ModelState.LOADING)  # a reload of a loaded model (a rescale): not a wake
    wakes.on_state("back", ModelState.LOADING)  # a model that declares nothing
    await asyncio.sleep(0)
    await wakes.aclose()
    assert lifecycle.woken == []


def test_wakes_are_model_ids_other_than_the_model_itself(tmp_path: Path) -> None:
    spec = DeploymentSpec(id="front", path=tmp_path, wakes=["back", "side", "back"])
    assert spec.wakes == ["back", "side"]
    with pytest.raises(ValidationError, match="'no/such' is not a model id"):
        DeploymentSpec(id="front", path=tmp_path, wakes=["no/such"])
    with pytest.raises(ValidationError, match="wakes lists the model itself"):
        DeploymentSpec(id="front", path=tmp_path, wakes=["front"])
