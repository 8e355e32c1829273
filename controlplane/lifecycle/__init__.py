"""The model lifecycle: wake on request, idle unload, memory budget and eviction, autoscaling, recovery.

``manager.LifecycleManager`` builds the parts; ``port.LifecyclePort`` is what the rest of the control plane calls.
Which module owns which job is in docs/internals.md ("The lifecycle's parts").
"""
