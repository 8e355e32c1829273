"""The load's warm-up sample (config ``model_warmup``), read back as the request the model will get.

The instance runs it through ``predict`` itself at the end of ``initialize``, before Triton runs the same
sample. Triton 2.51's own path for a failing warm-up sample of a python-backend model brought tritonserver
down (signal 11, about one load in five here), so Triton's run is always answered by the runtime without a
second ``predict``: with the instance's own result, or with zero outputs of the declared shapes. Triton's run
is kept: it warms Triton's side of the first inference (tens of milliseconds for a fresh stub).

The sample's name says where its inputs came from (``snooze_warmup_<source>``): ``samples`` (the package
shipped them: a failure fails the load with the model's error) or ``signature`` (generated: a failure is
said once and the model loads). Inputs learned from the model's traffic (``learned_warmup.json`` in the
model folder, written by the control plane before the model's next load from unloaded, never while Triton
holds it) replace generated ones; the runtime notes the first real request's shapes (``ShapeNote``) so that
the control plane can learn them.

Reads what ``controlplane/warmup_samples.py`` renders (and what Triton reads): per input ``zero_data``, or
``input_data_file`` under ``<model>/warmup/`` holding raw little-endian values, or for strings 4-byte
length-prefixed elements. Standard library + numpy, Python 3.10 syntax.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np

from .journal import JOURNAL_ENV, WARMUP_SUFFIX, own_file
from .spec import WIRE_TO_NUMPY, RuntimeSpec

WARMUP_DIR = "warmup"
SAMPLE_PREFIX = "snooze_warmup_"
SAMPLES, SIGNATURE, LEARNED = "samples", "signature", "learned"
LEARNED_FILE = "learned_warmup.json"  # in the model folder: {"format": 1, "inputs": {name: {shape, datatype}}}


def _strings(raw: bytes, count: int) -> np.ndarray:
    out, at = [], 0
    for _ in range(count):
        (size,) = struct.unpack_from("<I", raw, at)
        out.append(raw[at + 4 : at + 4 + size])
        at += 4 + size
    array = np.empty(count, dtype=object)
    array[:] = out
    return array


def sample_arrays(sample: dict[str, Any], model_dir: str, batching: bool) -> dict[str, np.ndarray]:
    """One warm-up sample of a model config (Triton's JSON form) as the arrays of one request."""
    arrays: dict[str, np.ndarray] = {}
    for name, spec in (sample.get("inputs") or {}).items():
        wire = str(spec.get("data_type", "")).removeprefix("TYPE_")
        wire = "BYTES" if wire == "STRING" else wire
        dtype = WIRE_TO_NUMPY.get(wire)
        if dtype is None:  # BF16: no numpy type to hand it over in; Triton's own run still warms it
            return {}
        dims = [int(d) for d in spec.get("dims") or []]
        count = int(np.prod(dims)) if dims else 1
        data_file = spec.get("input_data_file")
        if data_file:
            with open(os.path.join(model_dir, WARMUP_DIR, data_file), "rb") as f:
                raw = f.read()
            flat = _strings(raw, count) if wire == "BYTES" else np.frombuffer(raw, dtype.newbyteorder("<"), count)
        elif wire == "BYTES":
            flat = np.full(count, b"", dtype=object)
        else:
            flat = np.zeros(count, dtype)
        array = flat.astype(dtype).reshape(dims)
        arrays[name] = array[np.newaxis, ...] if batching else array
    return arrays


def sample_source(name: str) -> str:
    """``samples`` or ``signature`` from a sample's name (a config without the suffix: strict, as shipped)."""
    source = name.removeprefix(SAMPLE_PREFIX) if name.startswith(SAMPLE_PREFIX) else SAMPLES
    return source if source in (SAMPLES, SIGNATURE) else SAMPLES


def read_learned(model_dir: str) -> dict[str, dict[str, Any]] | None:
    """The input shapes learned from the model's traffic (``learned_warmup.json``), or None."""
    try:
        with open(os.path.join(model_dir, LEARNED_FILE), encoding="utf-8") as f:
            raw = json.load(f)
        inputs = raw["inputs"]
        return {
            str(k): {"shape": [int(d) for d in v["shape"]], "datatype": str(v["datatype"])} for k, v in inputs.items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def learned_arrays(spec: RuntimeSpec, learned: dict[str, dict[str, Any]]) -> dict[str, np.ndarray] | None:
    """Zero tensors (BYTES: empty strings) of the learned shapes, batch axis 1 when batching; None when
    they no longer fit the signature (a stale file)."""
    arrays: dict[str, np.ndarray] = {}
    for tensor in spec.inputs:
        seen = learned.get(tensor.name)
        if seen is None or seen["datatype"] != tensor.datatype:
            return None
        shape = seen["shape"]
        if len(shape) != len(tensor.dims) or any(d not in (-1, s) for d, s in zip(tensor.dims, shape, strict=True)):
            if not (tensor.dims == () and shape == [1]):
                return None
        full = ([1] if spec.batched else []) + shape
        if tensor.datatype == "BYTES":
            array = np.full(int(np.prod(full)) if full else 1, b"", dtype=object).reshape(full)
        else:
            array = np.zeros(full, tensor.dtype)
        arrays[tensor.name] = array
    return arrays


def declared_outputs(spec: RuntimeSpec) -> dict[str, np.ndarray]:
    """Zero outputs of the declared shapes (-1 as 1; batch axis 1): the answer to Triton's warm-up request
    when the instance's own run was of other inputs or failed."""
    out: dict[str, np.ndarray] = {}
    for tensor in spec.outputs:
        shape = ([1] if spec.batched else []) + [1 if d == -1 else d for d in tensor.dims]
        if tensor.datatype == "BYTES":
            out[tensor.name] = np.full(int(np.prod(shape)) if shape else 1, b"", dtype=object).reshape(shape)
        else:
            out[tensor.name] = np.zeros(shape, tensor.dtype)
    return out


def shapes_of(spec: RuntimeSpec, arrays: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """A request's input shapes (without the batch axis) and datatypes: what a warm-up learns, never data."""
    wire = {t.name: t.datatype for t in spec.inputs}
    return {
        name: {"shape": [int(d) for d in (a.shape[1:] if spec.batched else a.shape)], "datatype": wire.get(name, "")}
        for name, a in arrays.items()
    }


class WarmupNote:
    """``<journal dir>/<pid>-<start ticks>.warmup``, JSON ``{"model", "source", "skipped", "learned"}``: the
    warm-up this process ran (its source; why a generated one was skipped) and the shapes of its first real
    request, for the control plane (``controlplane/warmup_samples.py`` reads it). Written twice at most."""

    def __init__(self, path: str, model_id: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {"model": model_id, "source": None, "skipped": None, "learned": None}

    @classmethod
    def from_environment(cls, model_id: str) -> WarmupNote | None:
        directory = os.environ.get(JOURNAL_ENV)
        if not directory:
            return None
        try:
            return cls(own_file(directory, WARMUP_SUFFIX), model_id)
        except OSError:
            return None

    def write(self, **fields: Any) -> None:
        self.data.update(fields)
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.data, f)
            os.replace(tmp, self.path)
        except OSError:
            pass

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass


def warmup_samples(model_config: dict[str, Any], model_dir: str) -> list[tuple[str, dict[str, np.ndarray]]]:
    """(name, request arrays) per warm-up sample of the config; a sample it cannot build is left to Triton."""
    batching = int(model_config.get("max_batch_size") or 0) > 0
    out = []
    for sample in model_config.get("model_warmup") or []:
        arrays = sample_arrays(sample, model_dir, batching)
        if arrays:
            out.append((str(sample.get("name") or "warmup"), arrays))
    return out
