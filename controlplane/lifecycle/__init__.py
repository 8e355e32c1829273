"""The model lifecycle: wake on request, idle unload, memory budget and eviction, autoscaling, recovery.

One module per policy: ``state`` (states and the single flight of transitions), ``memory`` (budget, estimates,
reservations), ``eviction`` (which idle model goes first: GDSF or LRU), ``gpu`` (GPU memory and its budget),
``autoscale`` (the scaling rule), ``recovery`` (dead model processes and the requests they took),
``processes`` (seeing Triton's processes), ``workers`` (preforked workers and their preloaded parents),
``journal`` (which requests a model process was running), ``loading`` (Triton loads), ``warmth`` (keep-alive
and pre-warm), ``triton_sync`` (Triton's health and index) and ``manager`` (``LifecycleManager``, which runs
them).
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
