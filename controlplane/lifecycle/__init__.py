"""The model lifecycle: wake on request, idle unload, memory budget and eviction, autoscaling, recovery.

Which module owns which job is in docs/internals.md ("The map"); a module list here would go stale.
"""

from controlplane.lifecycle.autoscale import LoadWindow, autoscale_step
from controlplane.lifecycle.loading import GENERATION_PARAMETER, config_with_instances, rendered_config
from controlplane.lifecycle.manager import LifecycleManager
from controlplane.lifecycle.memory import is_oom_error
from controlplane.lifecycle.recovery import ModelProcessDiedError, RequestFate
from controlplane.lifecycle.state import ModelState, ModelStatus
from controlplane.triton.processes import TritonProcesses

__all__ = [
    "GENERATION_PARAMETER",
    "LifecycleManager",
    "LoadWindow",
    "ModelProcessDiedError",
    "ModelState",
    "ModelStatus",
    "RequestFate",
    "TritonProcesses",
    "autoscale_step",
    "config_with_instances",
    "is_oom_error",
    "rendered_config",
]
