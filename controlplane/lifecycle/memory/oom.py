"""What a load or inference failure says about memory: the one out-of-memory classifier (host and GPU), and what
to do about each.

The classifier itself lives in the python_backend runtime (``python_backend.errors``), which classifies its own
failures with it inside Triton's stub, where controlplane cannot be imported; the control plane reads Triton's
load and inference errors with the same function.
"""

from __future__ import annotations

from python_backend.errors import OomKind, classify_oom, is_cuda_oom, is_oom_error

OOM_HINT = (
    "give the machine more memory, lower memory_budget_mb so fewer models stay loaded, or declare the "
    "model's memory_mb so the budget keeps room for it"
)
GPU_OOM_HINT = (
    "lower SNOOZE_GPU_MEMORY_BUDGET_MB below what the GPU really has free so that idle models are unloaded "
    "first, give the model fewer instances, or place it on another GPU (instance_group gpus)"
)

__all__ = ["GPU_OOM_HINT", "OOM_HINT", "OomKind", "classify_oom", "is_cuda_oom", "is_oom_error"]
