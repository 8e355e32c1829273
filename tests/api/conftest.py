"""Fixtures of the in-process API tests: a real ModelStore in tmp, the app over httpx's ASGI
transport, and a builder of package folders."""

from __future__ import annotations

import json
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.api.app import create_app
from controlplane.api.services import ControlPlaneServices
from controlplane.metrics import SnoozeMetrics
from controlplane.render import embedded_target
from controlplane.settings import Settings
from controlplane.store import ModelStore
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.launcher import free_port
from harness.api import ADMIN_KEY, INFERENCE_KEY, MANIFEST, MODEL_PY, RecordingLifecycle


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        work_dir=tmp_path / "work",
        admin_keys=[ADMIN_KEY],
        api_keys=[INFERENCE_KEY],
        max_upload_mb=1,
        allow_local_paths=True,
    )


@pytest.fixture
def store(settings: Settings) -> ModelStore:
    return ModelStore(settings.repository, embedded_target())


@pytest.fixture
def lifecycle(store: ModelStore) -> RecordingLifecycle:
    return RecordingLifecycle(store)


@pytest.fixture
async def services(
    settings: Settings, store: ModelStore, lifecycle: RecordingLifecycle
) -> AsyncIterator[ControlPlaneServices]:
    # No Triton in these tests: a port nobody listens on makes it "not ready".
    triton = TritonAdminClient(f"http://127.0.0.1:{free_port()}", timeout=2)
    yield ControlPlaneServices(store, lifecycle, SnoozeMetrics(), settings, triton)
    await triton.aclose()


@pytest.fixture
async def client(settings: Settings, services: ControlPlaneServices) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings, services)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as c:
        yield c


@pytest.fixture
def make_package(tmp_path: Path) -> Callable[..., Path]:
    """A custom numpy package folder; ``model_py``/``manifest`` replace the good defaults."""

    def make(name: str = "pkg", *, model_py: str = MODEL_PY, manifest: dict[str, Any] | str | None = None) -> Path:
        folder = tmp_path / "packages" / name
        folder.mkdir(parents=True)
        (folder / "snooze_model.py").write_text(textwrap.dedent(model_py))
        text = manifest if isinstance(manifest, str) else json.dumps(manifest or MANIFEST)
        (folder / "snooze_model.json").write_text(text)
        return folder

    return make
