"""What the control API needs from the rest of the control plane, passed in (no globals)."""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.lifecycle.port import LifecyclePort
from controlplane.metrics import SnoozeMetrics
from controlplane.publishing import Publishing
from controlplane.settings import Settings
from controlplane.store import ModelStore
from controlplane.triton.client import TritonAdminClient


@dataclass(frozen=True)
class ControlPlaneServices:
    store: ModelStore
    lifecycle: LifecyclePort
    metrics: SnoozeMetrics
    settings: Settings
    triton: TritonAdminClient  # readiness and per-model statistics
    publishing: Publishing | None = None  # `serve --models`'s background publishing, where one runs
