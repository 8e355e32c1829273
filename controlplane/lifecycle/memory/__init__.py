"""The memory accountant: what the machine holds, what a load needs, and which idle model leaves first.

- ``host``: the host memory budget (``SNOOZE_MEMORY_BUDGET_MB``, else the container's cgroup limit less a headroom);
- ``gpu`` / ``gpu_budget`` / ``gpu_memory``: the per-GPU budget and its NVML measurements;
- ``cgroup``: the container's own count (its limit and working set);
- ``eviction``: the one eviction order (gdsf or lru; a pre-warm nobody used yet first);
- ``oom``: the one out-of-memory classifier;
- ``units``: MIB.

What a process holds is read in ``controlplane.triton.processes.held_bytes`` (Pss).
"""

from controlplane.lifecycle.memory.host import BudgetInUse, MemoryBudget, declared_bytes
from controlplane.lifecycle.memory.oom import GPU_OOM_HINT, OOM_HINT, classify_oom, is_cuda_oom, is_oom_error
from controlplane.lifecycle.memory.units import MIB

__all__ = [
    "GPU_OOM_HINT",
    "MIB",
    "OOM_HINT",
    "BudgetInUse",
    "MemoryBudget",
    "classify_oom",
    "declared_bytes",
    "is_cuda_oom",
    "is_oom_error",
]
