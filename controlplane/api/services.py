"""What the control API needs from the rest of the control plane, passed in (no globals)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from controlplane.metrics import SnoozeMetrics
from controlplane.settings import Settings
from controlplane.store import ModelStore
from controlplane.triton.client import TritonAdminClient


class StatusView(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


class Lifecycle(Protocol):
    """The part of ``LifecycleManager`` (docs/internals.md) the API calls."""

    async def load(self, model_id: str, *, instances: int | None = None) -> StatusView: ...
    async def unload(self, model_id: str, *, reason: str = "api") -> StatusView: ...
    async def published(self, model_id: str) -> None: ...
    async def forget(self, model_id: str) -> None: ...
    def status(self, model_id: str) -> StatusView: ...
    def runtime(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ControlPlaneServices:
    store: ModelStore
    lifecycle: Lifecycle
    metrics: SnoozeMetrics
    settings: Settings
    triton: TritonAdminClient  # readiness and per-model statistics
