"""Triton's ``model_warmup`` for a rendered model: the load runs one inference per instance.

The first inference of a fresh python-backend stub costs tens of milliseconds (Triton's own batch
path, the runtime's first collation, the framework's first kernels); with a warm-up sample in the
config Triton pays it inside the load, so a woken or pre-warmed model's first request costs what a
warm one does. A warm-up that fails fails the load with the model's error (Triton 2.51:
"failed to run warmup sample '<name>': <error>").

Triton's semantics (core ``TritonModelInstance::GenerateWarmupData`` / ``WarmUp``, r24.10): each
sample is ``batch_size`` requests of batch 1 (dims exclude the batch axis) run ``count`` times on
every instance before it is ready; ``zero_data`` fills the tensor with zero bytes (an empty string
per element for TYPE_STRING); ``input_data_file`` is read from ``<model>/warmup/<file>``, raw
little-endian bytes, or for TYPE_STRING the serialized elements (4-byte length prefix each).

Inputs come from the signature (declared shapes, -1 takes 1; numbers and bools zero, BYTES a short
string) or from the samples a package ships (manifest ``"warmup": {"<input>": "<file>.npy"}``);
``"warmup": false`` turns it off (a ``predict`` with side effects).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from controlplane.dtypes import parse_dtype
from controlplane.errors import InvalidPackageError

WARMUP_DIR = "warmup"  # Triton reads input_data_file from <model folder>/warmup/
SAMPLE_NAME = "snooze_warmup"
SHORT_STRING = b"snooze"


@dataclass(frozen=True)
class WarmupInput:
    name: str
    triton_type: str
    dims: list[int]
    data_file: str | None  # under warmup/; None: zero_data


@dataclass(frozen=True)
class WarmupPlan:
    inputs: list[WarmupInput]
    files: dict[str, bytes]  # relative to the model folder


def serialize_bytes(values: np.ndarray) -> bytes:
    """BYTES elements as Triton reads them: a 4-byte little-endian length, then the bytes, in C order."""
    out = bytearray()
    for item in np.asarray(values, dtype=object).reshape(-1):
        raw = item.encode() if isinstance(item, str) else bytes(item)
        out += struct.pack("<I", len(raw)) + raw
    return bytes(out)


def warmup_plan(spec: Any, input_views: list[dict[str, Any]]) -> WarmupPlan | None:
    """The warm-up of ``spec`` (a ModelSpec) given its rendered inputs (name, triton_type, dims), or
    None when the package turned it off. Raises InvalidPackageError for a sample that does not fit."""
    setting = spec.package.manifest.warmup
    if setting is False:
        return None
    samples = setting if isinstance(setting, dict) else {}
    known = {v["name"] for v in input_views}
    unknown = sorted(set(samples) - known)
    if unknown:
        raise InvalidPackageError(
            f"model '{spec.id}': warmup names input(s) {unknown} the model does not have (it has {sorted(known)})",
            hint="key 'warmup' by the names in 'inputs', or remove the entry",
        )
    inputs, files = [], {}
    for index, view in enumerate(input_views):
        name, triton_type = view["name"], view["triton_type"]
        declared = list(view["dims"])
        data_file = f"input_{index}.bin"
        if name in samples:
            array = _read_sample(spec, name, samples[name], declared, triton_type)
            dims = [1] if (declared == [1] and array.ndim == 0) else list(array.shape)
            files[f"{WARMUP_DIR}/{data_file}"] = _sample_bytes(array, triton_type)
            inputs.append(WarmupInput(name, triton_type, dims, data_file))
            continue
        dims = [1 if d == -1 else d for d in declared]
        if triton_type == "TYPE_STRING":
            count = int(np.prod(dims)) if dims else 1
            files[f"{WARMUP_DIR}/{data_file}"] = serialize_bytes(np.full(count, SHORT_STRING, dtype=object))
            inputs.append(WarmupInput(name, triton_type, dims, data_file))
        else:
            inputs.append(WarmupInput(name, triton_type, dims, None))
    return WarmupPlan(inputs, files)


def _read_sample(spec: Any, name: str, rel: str, declared: list[int], triton_type: str) -> np.ndarray:
    path = Path(spec.package.path) / rel
    where = f"model '{spec.id}': warmup sample for input '{name}' ({rel})"
    if rel not in spec.package.files:
        raise InvalidPackageError(f"{where}: no such file in the package", hint="add the .npy file or fix the path")
    try:
        array = np.load(path, allow_pickle=False)  # never a pickle: no package code runs in the control plane
    except (OSError, ValueError) as exc:
        raise InvalidPackageError(
            f"{where}: not a readable .npy file without pickles ({exc})",
            hint="save it with numpy.save; BYTES samples as a bytes array (dtype 'S'), not dtype=object",
        ) from exc
    dtype = parse_dtype(triton_type)
    if dtype.wire == "BYTES":
        if array.dtype.kind not in "SU":
            raise InvalidPackageError(f"{where}: dtype {array.dtype} for a BYTES input", hint="save a bytes array")
    elif dtype.wire == "BF16":
        raise InvalidPackageError(f"{where}: BF16 inputs take the generated warm-up", hint="remove the entry")
    elif array.dtype != np.dtype(dtype.numpy):
        raise InvalidPackageError(
            f"{where}: dtype {array.dtype}, the input is {dtype.wire} ({dtype.numpy})",
            hint=f"save the sample as {dtype.numpy}",
        )
    shape = list(array.shape)
    fits = len(shape) == len(declared) and all(d in (-1, s) for d, s in zip(declared, shape, strict=True))
    if not fits and not (declared == [1] and shape == []):
        raise InvalidPackageError(
            f"{where}: shape {shape}, the input's dims are {declared} (without the batch axis, -1 any size)",
            hint="save one request's tensor without the batch axis",
        )
    return array


def _sample_bytes(array: np.ndarray, triton_type: str) -> bytes:
    if triton_type == "TYPE_STRING":
        return serialize_bytes(np.vectorize(lambda v: v if isinstance(v, bytes) else str(v).encode(),
                                            otypes=[object])(array))
    return np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()


def warmup_view(plan: WarmupPlan | None) -> list[dict[str, Any]]:
    """What the config template renders (empty: no warm-up)."""
    if plan is None:
        return []
    return [{"name": SAMPLE_NAME, "inputs": [vars(i) for i in plan.inputs]}]
