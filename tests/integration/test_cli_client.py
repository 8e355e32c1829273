"""snoozectl publish/status/load/unload/delete against a real control API: uvicorn on a free port,
the real LifecycleManager, and an embedded tritonserver of this module's own."""

from __future__ import annotations

import asyncio
import contextlib
import json
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import typer
import uvicorn
from typer.testing import CliRunner

from controlplane.api.app import create_app
from controlplane.api.services import ControlPlaneServices
from controlplane.cli.client_commands import register
from controlplane.lifecycle.manager import LifecycleManager
from controlplane.metrics import SnoozeMetrics
from controlplane.render import embedded_target
from controlplane.settings import Settings
from controlplane.store import ModelStore
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.launcher import EmbeddedTriton, free_port
from harness.probes import until

pytestmark = pytest.mark.integration

KEY = "cli-admin-key"
MODEL_PY = """
import numpy as np


class Model:
    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        return {"y": (inputs["x"] * 2).astype(np.float32)}
"""
MANIFEST = {
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [2]}],
    "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
    "metadata": {"task": "doubling"},
}


class _ApiServer:
    """The control API served by uvicorn in a thread, on an event loop that owns the lifecycle."""

    def __init__(self, settings: Settings, triton: EmbeddedTriton) -> None:
        self.settings, self.triton = settings, triton
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: uvicorn.Server | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        store = ModelStore(self.settings.repository, embedded_target())
        metrics = SnoozeMetrics()
        async with TritonAdminClient(self.triton.http_url, self.triton.metrics_url) as admin:
            lifecycle = LifecycleManager(self.settings, store, admin, triton_process=self.triton, metrics=metrics)
            await lifecycle.start()
            app = create_app(self.settings, ControlPlaneServices(store, lifecycle, metrics, self.settings, admin))
            config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
            self.server = uvicorn.Server(config)
            try:
                await self.server.serve()
            finally:
                await lifecycle.stop()

    def __enter__(self) -> _ApiServer:
        self.thread.start()
        until(self._ready, f"the control API at {self.url} to become ready", timeout=30)
        return self

    def _ready(self) -> bool:
        with contextlib.suppress(httpx.TransportError):
            return httpx.get(f"{self.url}/health/ready", timeout=1).status_code == 200
        return False

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def api_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("cli_client")
    settings = Settings(work_dir=root / "work", admin_keys=[KEY], sweep_interval_secs=0.5)
    settings.repository.mkdir(parents=True)
    triton = EmbeddedTriton(settings.repository, root / "triton")
    try:
        triton.start()
        with _ApiServer(settings, triton) as server:
            yield server.url
    finally:
        triton.stop()


@pytest.fixture
def package(tmp_path: Path) -> Path:
    folder = tmp_path / "doubler"
    folder.mkdir()
    (folder / "snooze_model.py").write_text(textwrap.dedent(MODEL_PY))
    (folder / "snooze_model.json").write_text(json.dumps(MANIFEST))
    (folder / "__pycache__").mkdir()  # left out of the upload
    (folder / "__pycache__" / "junk.pyc").write_bytes(b"\0")
    return folder


@pytest.fixture
def snoozectl(api_url: str) -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def run(app: typer.Typer, api_url: str, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, [*args, "--url", api_url, "--api-key", KEY])
    return result.exit_code, result.stdout, result.stderr


def test_publish_load_status_unload_delete(snoozectl: typer.Typer, api_url: str, package: Path) -> None:
    code, out, err = run(snoozectl, api_url, "publish", str(package), "--max-batch-size", "4", "--json")
    assert code == 0, err
    published = json.loads(out)
    assert published["id"] == "doubler" and published["metadata"] == {"task": "doubling"}
    assert published["status"]["state"] == "unloaded"

    code, out, err = run(snoozectl, api_url, "load", "doubler", "--json")
    assert code == 0, err
    loaded = json.loads(out)
    assert loaded["state"] == "ready" and loaded["instances"] == 1 and loaded["last_cold_start_secs"] > 0

    detail = httpx.get(f"{api_url}/v1/models/doubler", headers={"X-API-Key": KEY}).json()
    assert detail["stats"]["name"] == "doubler"  # Triton's statistics while loaded
    assert "max_batch_size: 4" in detail["config"]

    code, out, err = run(snoozectl, api_url, "status")
    assert code == 0, err
    assert "doubler" in out and "ready" in out

    code, out, err = run(snoozectl, api_url, "unload", "doubler", "--json")
    assert code == 0, err
    assert json.loads(out)["state"] == "unloaded"

    code, out, err = run(snoozectl, api_url, "delete", "doubler", "--yes")
    assert code == 0, err
    code, out, _ = run(snoozectl, api_url, "list", "--json")
    assert code == 0 and json.loads(out) == []


def test_publish_and_load_in_one_command(snoozectl: typer.Typer, api_url: str, package: Path) -> None:
    code, out, err = run(snoozectl, api_url, "publish", str(package), "--id", "doubler-2", "--load")
    assert code == 0, err
    assert "published doubler-2" in out and "ready" in out
    assert run(snoozectl, api_url, "delete", "doubler-2", "--yes")[0] == 0


def test_bad_package_prints_error_and_fix(snoozectl: typer.Typer, api_url: str, package: Path) -> None:
    (package / "snooze_model.py").write_text("import not_installed_anywhere\n")
    code, out, err = run(snoozectl, api_url, "publish", str(package), "--id", "broken")
    assert code == 1
    assert "error: model 'broken': importing snooze_model.py failed" in err
    assert "No module named 'not_installed_anywhere'" in err
    assert "fix: " in err


def test_errors_as_json_for_scripts(snoozectl: typer.Typer, api_url: str) -> None:
    code, out, _ = run(snoozectl, api_url, "load", "ghost", "--json")
    assert code == 1
    assert json.loads(out)["code"] == "not_found"


def test_wrong_key_and_unreachable_server(snoozectl: typer.Typer, api_url: str) -> None:
    result = CliRunner().invoke(snoozectl, ["status", "--url", api_url, "--api-key", "wrong"])
    assert result.exit_code == 1 and "error: invalid API key" in result.stderr
    result = CliRunner().invoke(snoozectl, ["status", "--url", f"http://127.0.0.1:{free_port()}"])
    assert result.exit_code == 1
    assert "cannot reach the control API" in result.stderr and "SNOOZE_API_URL" in result.stderr


def test_publish_load_of_a_model_that_fails_to_load_leaves_nothing_published(
    snoozectl: typer.Typer, api_url: str, package: Path
) -> None:
    (package / "snooze_model.py").write_text(
        "class Model:\n    def load(self, model_dir, device):\n        raise RuntimeError('weights.bin is missing')\n\n"
        "    def predict(self, inputs):\n        return inputs\n"
    )
    code, out, err = run(snoozectl, api_url, "publish", str(package), "--id", "never-loads", "--load")
    assert code == 1, out
    assert "error: " in err and "weights.bin is missing" in err, err
    assert "model 'never-loads' was not kept: publish --load keeps only a model that loads" in " ".join(err.split())
    code, out, _ = run(snoozectl, api_url, "status", "--json")
    assert code == 0 and "never-loads" not in [m["id"] for m in json.loads(out)]
