"""Error kinds and their messages: `[snooze:<kind>] model '<id>': <what happened>; <what to fix>`.

Kinds: `model_error` (the model's code raised, or returned outputs that do not match its manifest),
`invalid_input` (the request does not fit the signature, or predict raised an exception whose class declares
``snooze_error = "invalid_input"``), `oom`, `timeout`, and `internal` (the runtime itself failed).

The control plane and clients read the kind from the message prefix (see docs/internals.md), so the
prefix is the contract; the Triton error code only steers the HTTP/gRPC status.
"""

from __future__ import annotations

import importlib
import os
import traceback
from dataclasses import dataclass
from typing import Literal

OOM = "oom"
INVALID_INPUT = "invalid_input"
INTERNAL = "internal"  # a failure of the runtime itself (or of Triton's stub), not of the model's code
MODEL_ERROR = "model_error"  # the model's own code raised or returned something wrong
TIMEOUT = "timeout"
REFUSAL_ATTRIBUTE = "snooze_error"  # on a model's exception class: "invalid_input" -> HTTP 400 / INVALID_ARGUMENT

# How many of the innermost frames of the model's traceback an internal error carries: enough to
# point at the failing line in the user's code without flooding the client.
TRACEBACK_FRAMES = 3

# Folders whose frames are left out of tracebacks shown to model authors: this runtime, importlib.
_PLUMBING_DIRS = {os.path.dirname(os.path.abspath(p)) for p in (__file__, importlib.__file__)}

# The one out-of-memory classifier, for the stub (is_oom) and the control plane (controlplane.lifecycle.memory.oom
# imports it from here: this runtime cannot import controlplane). The wordings come from this runtime
# ("[snooze:oom]", its kind prefix), Python (MemoryError), PyTorch, the CUDA driver and runtime APIs, cuDNN,
# cuBLAS, TensorRT, onnxruntime's arena, torch's and CuPy's OutOfMemoryError classes.
#
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


# What to fix when a stage fails with an ordinary exception; other stages: "fix the model's <stage>".
_FIXES = {
    "import": "fix the entrypoint module or install the packages it imports",
    "predict output": "return numpy arrays of the declared output datatypes",
}


class DescribedError(Exception):
    """The root of the runtime's own errors: its kind and wording are decided where it is raised, so
    ``describe_failure`` passes it on as it is. (Not ``controlplane.errors.SnoozeError``: this runtime runs in
    Triton's stub and cannot import the control plane.)"""

    kind = INTERNAL


class InvalidInput(DescribedError):
    kind = INVALID_INPUT


class BadModelOutput(DescribedError):
    """predict returned something that does not match the declared outputs: a bug in the model."""

    kind = MODEL_ERROR


class PredictTimeout(DescribedError):
    kind = TIMEOUT


class RemoteFailure(DescribedError):
    """A failure a preforked worker process already described: its kind and message (without the
    prefix), so that the stub's answer reads exactly as if the model ran in the stub."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def without_prefix(kind: str, model_id: str, message: str) -> str:
    """``message`` as describe_failure wrote it, less its ``[snooze:<kind>] model '<id>':`` prefix."""
    head = prefix(kind, model_id) + " "
    return message[len(head) :] if message.startswith(head) else message


def prefix(kind: str, model_id: str) -> str:
    return f"[snooze:{kind}] model '{model_id}':"


def refuses_input(exc: BaseException) -> bool:
    """The model's own way to say "bad input" without importing snoozeml: its exception's class (or a base)
    sets ``snooze_error = "invalid_input"`` (docs/packages.md). Declared by the package, never read from a
    message."""
    return getattr(type(exc), REFUSAL_ATTRIBUTE, None) == INVALID_INPUT


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


def is_oom(exc: BaseException) -> bool:
    """Whether the exception is an allocation failure, host or GPU (its class name counts: torch's and CuPy's
    OutOfMemoryError)."""
    return isinstance(exc, MemoryError) or classify_oom(f"{type(exc).__name__}: {exc}") is not None


def _is_plumbing(filename: str) -> bool:
    return filename.startswith("<frozen ") or os.path.dirname(os.path.abspath(filename)) in _PLUMBING_DIRS


def traceback_summary(exc: BaseException, frames: int = TRACEBACK_FRAMES) -> str:
    """`file.py:12 in _step <- file.py:30 in predict`, innermost frame first.

    The runtime's own frames (the thread that calls predict) and the import machinery's say nothing
    to the model's author and are left out, unless the error arose in the runtime itself.
    """
    entries: list[traceback.FrameSummary] = traceback.extract_tb(exc.__traceback__)
    entries = [e for e in entries if not _is_plumbing(e.filename)] or entries
    entries = entries[-frames:]
    return " <- ".join(f"{os.path.basename(e.filename)}:{e.lineno} in {e.name}" for e in reversed(entries))


def describe_failure(exc: BaseException, model_id: str, stage: str, batch_size: int | None) -> tuple[str, str]:
    """Map an exception raised by the runtime or by user code to (kind, message).

    `stage` names the user call that failed ("predict"); `batch_size` is the collated batch's size
    when known, because it is the first thing to change on an out-of-memory error.
    """
    if isinstance(exc, DescribedError):
        return exc.kind, f"{prefix(exc.kind, model_id)} {exc}"
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if stage == "predict" and refuses_input(exc):
        return INVALID_INPUT, f"{prefix(INVALID_INPUT, model_id)} predict refused the input: {str(exc) or what}"
    if is_oom(exc):
        batch = f" on a batch of {batch_size}" if batch_size is not None else ""
        fix = (
            "send smaller requests, lower the model's max_batch_size, or give the model more memory"
            if stage == "predict"
            else "free memory (unload other models) or give the model more memory"
        )
        return OOM, f"{prefix(OOM, model_id)} {stage} ran out of memory{batch} ({what}); {fix}"
    where = traceback_summary(exc)
    at = f" at {where}" if where else ""
    fix = _FIXES.get(stage, f"fix the model's {stage}")
    if isinstance(exc, ImportError):
        fix = (
            "install the missing package in the environment Triton's python backend runs the model with "
            "(the one snoozeml is installed in, or the model's execution_env_path; docs/packages.md#dependencies)"
        )
    kind = MODEL_ERROR if _raised_in_model_code(exc) else INTERNAL
    return kind, f"{prefix(kind, model_id)} {stage} raised {what}{at}; {fix}"


def _raised_in_model_code(exc: BaseException) -> bool:
    """True when the traceback passes through a file that is not this runtime's or importlib's: the
    model's code raised (or imported something that did), so the failure is the model's to fix."""
    return any(not _is_plumbing(e.filename) for e in traceback.extract_tb(exc.__traceback__))


@dataclass(frozen=True)
class Failure:
    """The error answer for one request: its kind and the full message (prefix included)."""

    kind: str
    message: str
