"""What a load or inference failure says about memory: the one out-of-memory classifier (host and GPU).

The wordings come from the python_backend runtime (``[snooze:oom]``, its kind prefix), Python (``MemoryError``),
PyTorch, the CUDA driver and runtime APIs, cuDNN, cuBLAS, TensorRT, onnxruntime's arena, torch's and CuPy's
OutOfMemoryError classes.
"""

from __future__ import annotations

from typing import Literal

OOM_HINT = (
    "give the machine more memory, lower memory_budget_mb so fewer models stay loaded, or declare the "
    "model's memory_mb so the budget keeps room for it"
)
GPU_OOM_HINT = (
    "lower SNOOZE_GPU_MEMORY_BUDGET_MB below what the GPU really has free so that idle models are unloaded "
    "first, give the model fewer instances, or place it on another GPU (instance_group gpus)"
)

# How a host allocation failure reads: the runtime's kind prefix, Python's exception name, the generic wording.
_HOST_MARKERS = ("[snooze:oom]", "memoryerror", "out of memory")
# Wordings only a GPU allocation failure uses (TensorRT: "Error Code 2: OutOfMemory", "Requested amount of GPU
# memory ... could not be allocated").
_GPU_MARKERS = (
    "cuda out of memory",
    "cuda_error_out_of_memory",
    "cudaerrormemoryallocation",
    "cudnn_status_alloc_failed",
    "cublas_status_alloc_failed",
    "outofmemory",
    "requested amount of gpu memory",
)
# Wordings that say an allocation failed without naming the device: onnxruntime's arena ("Failed to allocate
# memory for requested buffer of size N") serves CPU and CUDA alike; "out of memory" is a host's wording too.
_ANY_DEVICE_MARKERS = ("out of memory", "failed to allocate memory")
# Words that put such a failure on the GPU: "CUDA failure 2: out of memory ; GPU=0", "[TRT] ... Cuda Error ...".
_GPU_CONTEXT = ("cuda", "gpu", "cudnn", "tensorrt", "[trt]")

OomKind = Literal["gpu", "host"]


def classify_oom(text: str, *, on_gpu: bool = False) -> OomKind | None:
    """``gpu`` when the text says a GPU allocation failed (``on_gpu``: the model runs on a GPU, so a failure that
    names no device counts as the GPU's), ``host`` when it says a host allocation failed, else None."""
    lowered = text.lower()
    if any(m in lowered for m in _GPU_MARKERS) or (
        any(m in lowered for m in _ANY_DEVICE_MARKERS) and (on_gpu or any(w in lowered for w in _GPU_CONTEXT))
    ):
        return "gpu"
    if any(m in lowered for m in _HOST_MARKERS):
        return "host"
    return None


def is_cuda_oom(text: str, *, on_gpu: bool = False) -> bool:
    """Whether the text says a GPU allocation failed."""
    return classify_oom(text, on_gpu=on_gpu) == "gpu"


def is_oom_error(text: str) -> bool:
    """Whether the text says an allocation failed (host wording; a GPU failure worded as one counts too)."""
    lowered = text.lower()
    return any(m in lowered for m in _HOST_MARKERS)
