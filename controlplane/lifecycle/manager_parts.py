"""What the parts of ``LifecycleManager`` share: the attributes its ``__init__`` wires, and their constants.

The manager is one object split by job into ``supervisor`` (periodic), ``request_path`` (wake, hold, run
once) and ``operations`` (the API's operations and the transitions); each part is a base class of
``LifecycleManager`` and reads the parts it needs through these attributes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controlplane.clock import Clock
    from controlplane.lifecycle.loading import Loader
    from controlplane.lifecycle.memory import MemoryBudget
    from controlplane.lifecycle.memory.gpu import GpuMemory
    from controlplane.lifecycle.sequences import LiveSequences
    from controlplane.lifecycle.state import ModelStates
    from controlplane.lifecycle.triton_sync import TritonSync
    from controlplane.lifecycle.unloading import Unloader
    from controlplane.lifecycle.warmth import Warmth
    from controlplane.metrics import SnoozeMetrics
    from controlplane.settings import Settings
    from controlplane.store import ModelStore
    from controlplane.triton.client import TritonAdminClient
    from controlplane.triton.launcher import EmbeddedTriton
    from controlplane.triton.processes import TritonProcesses

# Where Triton's processes cannot be seen, a dead stub shows only as failing requests: they reach
# recover() just after the first of them reloaded the model, and a model (re)loaded this recently
# is not reloaded again.
RECOVERY_DEDUP_SECS = 2.0
SEQUENCE_POLL_SECS = 0.2  # how often a stop or a quiesce re-reads the live sequences it waits for


class ManagerParts:
    """The attributes ``LifecycleManager.__init__`` sets, which every part reads."""

    settings: Settings
    clock: Clock  # every part reads time through it (controlplane/clock.py)
    store: ModelStore
    triton: TritonAdminClient
    triton_process: EmbeddedTriton | None
    processes: TritonProcesses
    journal_dir: Path | None
    metrics: SnoozeMetrics
    states: ModelStates
    warmth: Warmth
    sequences: LiveSequences
    sync: TritonSync
    budget: MemoryBudget
    gpu: GpuMemory
    loader: Loader
    unloader: Unloader
    _tasks: list[asyncio.Task[None]]
    _passes: dict[str, asyncio.Lock]
    _unpublished: set[str]
