"""Reading `snooze_runtime.json`, the file the renderer writes next to the model (see docs/internals.md).

Runs inside Triton's python-backend stub: standard library + numpy only, Python 3.10 syntax.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from .errors import DescribedError

SPEC_FILE = "snooze_runtime.json"
SUPPORTED_FORMAT = 1

# KServe v2 wire name -> numpy dtype. The runtime cannot import controlplane/dtypes.py (it travels
# without snoozeml), so it keeps the subset the python backend can hand over as numpy arrays
# (no BF16: numpy has no such type).
WIRE_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}

TENSOR_FORMATS = ("numpy", "raw")
# Where the user's code runs: in the stub itself, or in a worker forked from a preloaded parent.
WORKERS = ("in-stub", "preforked")
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class RuntimeKind(str, Enum):
    """What the runtime serves: the package's own ``Model`` (custom) or an ONNX file run by onnxruntime."""

    CUSTOM = "custom"
    ONNX = "onnx"

    def __str__(self) -> str:  # the value, as StrEnum's str() (Python 3.11) gives; this runtime runs on 3.10 too
        return self.value


KINDS = tuple(kind.value for kind in RuntimeKind)


class SpecError(DescribedError, ValueError):
    """The model folder does not fit the runtime contract (spec file, entrypoint, class, params)."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # wire name, e.g. "FP32"
    dims: tuple[int, ...]  # without the batch axis; -1 = any size

    @property
    def dtype(self) -> np.dtype:
        return WIRE_TO_NUMPY[self.datatype]


@dataclass(frozen=True)
class RuntimeSpec:
    model_id: str
    kind: RuntimeKind
    tensor_format: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    entrypoint: str | None = None
    class_name: str = "Model"
    onnx_file: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    request_timeout_secs: float | None = None  # None or 0: no limit
    load_timeout_secs: float = 300.0  # bounds a wake from doze (the control plane bounds Triton's loads itself)
    worker: str = "in-stub"  # one of WORKERS
    preload: tuple[str, ...] = ()  # modules a preforked model's parent imports (numpy always)
    decoupled: bool = False  # predict is a generator: one response per yielded dict, then the final flag
    sequence: bool = False  # Triton's sequence batcher: predict may take a second argument (a Sequence)

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0


def load_spec(path: str) -> RuntimeSpec:
    """Read and check the runtime spec; every problem names the file and the field to fix."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise SpecError(f"{path} does not exist: re-render the model (snoozectl publish)") from None
    except json.JSONDecodeError as e:
        raise SpecError(f"{path} is not valid JSON ({e}): re-render the model") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path} must hold a JSON object")
    return parse_spec(raw, source=path)


def parse_spec(raw: dict[str, Any], source: str = SPEC_FILE) -> RuntimeSpec:
    def fail(msg: str) -> SpecError:
        return SpecError(f"{source}: {msg}")

    if raw.get("format") != SUPPORTED_FORMAT:
        raise fail(
            f"format {raw.get('format')!r} is not supported by this runtime (expects {SUPPORTED_FORMAT}); "
            "re-render the model with the same snoozeml version as its python_backend copy"
        )
    model_id = raw.get("model_id")
    if not isinstance(model_id, str) or not model_id:
        raise fail("'model_id' must be a non-empty string")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise fail(f"'kind' is {kind!r}; expected one of {list(KINDS)}")
    tensor_format = raw.get("tensor_format", "numpy")
    if tensor_format not in TENSOR_FORMATS:
        raise fail(f"'tensor_format' is {tensor_format!r}; expected one of {list(TENSOR_FORMATS)}")
    max_batch_size = raw.get("max_batch_size", 0)
    if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 0:
        raise fail(f"'max_batch_size' must be an integer >= 0, got {max_batch_size!r}")

    entrypoint = raw.get("entrypoint")
    onnx_file = raw.get("onnx_file")
    if kind == RuntimeKind.CUSTOM and not (isinstance(entrypoint, str) and entrypoint.endswith(".py")):
        raise fail(f"kind 'custom' needs 'entrypoint' naming a .py file inside package/, got {entrypoint!r}")
    if kind == RuntimeKind.ONNX and not (isinstance(onnx_file, str) and onnx_file):
        raise fail("kind 'onnx' needs 'onnx_file' naming the .onnx file inside package/")

    env = raw.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise fail("'env' must map names to string values")
    params = raw.get("params") or {}
    if not isinstance(params, dict):
        raise fail("'params' must be a JSON object (passed as Model(**params))")
    timeout, load_timeout = _parse_timeouts(raw, fail)

    worker, preload = _parse_worker(raw, fail)
    decoupled, sequence = raw.get("decoupled", False), raw.get("sequence", False)
    if not isinstance(decoupled, bool) or not isinstance(sequence, bool):
        raise fail(f"'decoupled' and 'sequence' must be true or false, got {decoupled!r}, {sequence!r}")

    inputs = _parse_tensors(raw.get("inputs"), "inputs", fail)
    outputs = _parse_tensors(raw.get("outputs"), "outputs", fail)
    if not inputs or not outputs:
        raise fail("'inputs' and 'outputs' must each declare at least one tensor")

    return RuntimeSpec(
        model_id=model_id,
        kind=RuntimeKind(kind),
        tensor_format=tensor_format,
        max_batch_size=max_batch_size,
        inputs=inputs,
        outputs=outputs,
        entrypoint=entrypoint,
        class_name=raw.get("class_name") or "Model",
        onnx_file=onnx_file,
        env=dict(env),
        params=dict(params),
        request_timeout_secs=float(timeout) if timeout else None,
        load_timeout_secs=float(load_timeout),
        worker=worker,
        preload=tuple(preload),
        decoupled=decoupled,
        sequence=sequence,
    )


def _parse_timeouts(raw: dict[str, Any], fail) -> tuple[float | None, float]:
    timeout = raw.get("request_timeout_secs")
    bad_timeout = isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0
    if timeout is not None and bad_timeout:
        raise fail(f"'request_timeout_secs' must be a number >= 0 or null, got {timeout!r}")
    load_timeout = raw.get("load_timeout_secs", 300.0)
    if isinstance(load_timeout, bool) or not isinstance(load_timeout, (int, float)) or load_timeout <= 0:
        raise fail(f"'load_timeout_secs' must be a number > 0, got {load_timeout!r}")
    return timeout, load_timeout


def _parse_worker(raw: dict[str, Any], fail) -> tuple[str, list[str]]:
    worker = raw.get("worker") or "in-stub"
    if worker not in WORKERS:
        raise fail(f"'worker' is {worker!r}; expected one of {list(WORKERS)}")
    preload = raw.get("preload") or []
    if not isinstance(preload, list) or not all(isinstance(m, str) and _MODULE_NAME.match(m) for m in preload):
        raise fail(f"'preload' must be a list of module names (e.g. [\"torch\"]), got {preload!r}")
    return worker, preload


def _parse_tensors(items: Any, key: str, fail) -> tuple[TensorSpec, ...]:
    if not isinstance(items, list):
        raise fail(f"'{key}' must be a list of {{name, datatype, dims}}")
    tensors = []
    seen = set()
    for i, item in enumerate(items):
        where = f"{key}[{i}]"
        if not isinstance(item, dict):
            raise fail(f"{where} must be an object with name, datatype, dims")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise fail(f"{where}.name must be a non-empty string")
        if name in seen:
            raise fail(f"{where}: tensor name {name!r} appears twice")
        seen.add(name)
        datatype = item.get("datatype")
        if datatype not in WIRE_TO_NUMPY:
            raise fail(
                f"{where} ({name}): datatype {datatype!r} is not supported by the python backend runtime; "
                f"use one of {sorted(WIRE_TO_NUMPY)}"
            )
        dims = item.get("dims")
        if not isinstance(dims, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and (d == -1 or d >= 0) for d in dims
        ):
            raise fail(f"{where} ({name}): dims must be a list of integers >= 0 or -1, got {dims!r}")
        tensors.append(TensorSpec(name=name, datatype=datatype, dims=tuple(dims)))
    return tuple(tensors)


def spec_path(model_repository: str, model_version: str) -> str:
    """Where the renderer puts the spec: `<model folder>/<version>/snooze_runtime.json`."""
    return os.path.join(model_repository, str(model_version), SPEC_FILE)
