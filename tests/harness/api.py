"""Helpers of the API tests: a lifecycle stand-in, package archives."""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from controlplane.errors import NotFoundError
from controlplane.lifecycle.state import ModelState, ModelStatus
from controlplane.store import ModelStore

ADMIN_KEY = "admin-key-for-tests"
INFERENCE_KEY = "inference-key-for-tests"
ADMIN = {"X-API-Key": ADMIN_KEY}

MODEL_PY = """
import numpy as np


class Model:
    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        return {"y": (inputs["x"] * self.scale).astype(np.float32)}
"""

MANIFEST = {
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [3]}],
    "outputs": [{"name": "y", "datatype": "FP32", "dims": [3]}],
    "params_schema": {"scale": {"type": "float", "default": 1.0}},
    "metadata": {"task": "scaling", "interface": {"x": "three floats"}},
}


def fresh_status(model_id: str) -> ModelStatus:
    """What the lifecycle says of a published model it never loaded (the real type, so the API's schema
    is checked against what the lifecycle really returns)."""
    return ModelStatus(model_id, ModelState.UNLOADED, None, 0, None, 300, None, None, None, 0, None, None)


@dataclass
class RecordingLifecycle:
    """Stands in for LifecycleManager (which has its own integration tests against a real Triton):
    records what the API asks of it and answers with plausible statuses."""

    store: ModelStore
    calls: list[tuple[str, ...]] = field(default_factory=list)
    states: dict[str, ModelStatus] = field(default_factory=dict)

    def status(self, model_id: str) -> ModelStatus:
        if not self.store.exists(model_id):
            raise NotFoundError(f"model '{model_id}' is not published")
        return self.states.setdefault(model_id, fresh_status(model_id))

    def statuses(self, model_ids: list[str]) -> list[ModelStatus]:
        self.calls.append(("statuses", str(len(model_ids))))
        return [self.status(m) for m in model_ids]

    def states_of(self, model_ids: list[str]) -> list[ModelState]:
        return [self.status(m).state for m in model_ids]

    async def load(self, model_id: str, *, instances: int | None = None) -> ModelStatus:
        self.calls.append(("load", model_id, str(instances)))
        status = self.status(model_id)
        status = replace(status, state=ModelState.READY, instances=instances or 1, load_count=status.load_count + 1)
        self.states[model_id] = status
        return status

    async def unload(self, model_id: str, *, reason: str = "api") -> ModelStatus:
        self.calls.append(("unload", model_id, reason))
        self.states[model_id] = status = replace(self.status(model_id), state=ModelState.UNLOADED, instances=0)
        return status

    async def published(self, model_id: str) -> None:
        self.calls.append(("published", model_id))

    def runtime(self) -> dict[str, Any]:
        return {
            "preloaded_parents": [],
            "overhead_bytes": 0,
            "eviction_policy": {"name": "gdsf"},
            "wake_queue": {
                "length": 1,
                "oldest_wait_secs": 0.5,
                "wait_bound_secs": 10.0,
                "waiting": [{"model": "m", "waiting_for": "a load slot", "wait_secs": 0.5}],
            },
        }

    async def forget(self, model_id: str) -> None:
        self.calls.append(("forget", model_id))
        self.states.pop(model_id, None)


def tar_gz(folder: Path, *, top: str | None = None) -> bytes:
    """The folder as a .tar.gz, its files at the root (or under ``top``)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            tar.add(
                path,
                arcname=f"{top}/{path.relative_to(folder)}" if top else str(path.relative_to(folder)),
                recursive=False,
            )
    return buf.getvalue()


async def upload(
    client: httpx.AsyncClient,
    archive: bytes,
    *,
    model_id: str | None = "m1",
    deployment: dict[str, Any] | None = None,
    filename: str = "pkg.tar.gz",
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    data = {"deployment": json.dumps(deployment)} if deployment is not None else {}
    params = {"id": model_id} if model_id else {}
    return await client.post(
        "/v1/models",
        params=params,
        data=data,
        files={"package": (filename, archive, "application/gzip")},
        headers=ADMIN if headers is None else headers,
    )
