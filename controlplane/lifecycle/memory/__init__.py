"""The memory accountant: what the machine holds, what a load needs, and which idle model leaves first.

- ``host``: the host memory budget (``SNOOZE_MEMORY_BUDGET_MB``, else the container's cgroup limit less a headroom);
- ``gpu`` / ``gpu_budget`` / ``gpu_memory``: the per-GPU budget and its NVML measurements;
- ``cgroup``: the container's own count (its limit and working set);
- ``eviction``: the one eviction order (gdsf or lru; a pre-warm nobody used yet first);
- ``plan``: what the budgets decide (a plan of idle models to evict) and how it is carried out;
- ``oom``: the one out-of-memory classifier;
- ``units``: MIB.

What a process holds is read in ``controlplane.triton.processes.held_bytes`` (Pss).
"""
