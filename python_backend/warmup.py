"""The load's warm-up sample (config ``model_warmup``), read back as the request the model will get.

The instance runs it through ``predict`` itself at the end of ``initialize``, before Triton runs the same
sample: a sample the model fails then fails the load at ``initialize`` with the model's own error. Triton
2.51's own path for a failing warm-up sample of a python-backend model brought tritonserver down (signal 11,
about one load in five here), so it must only ever see samples that pass. Triton's run is kept: it warms
Triton's side of the first inference (tens of milliseconds for a fresh stub), which this one does not reach.

Reads what ``controlplane/warmup.py`` renders (and what Triton reads): per input ``zero_data``, or
``input_data_file`` under ``<model>/warmup/`` holding raw little-endian values, or for strings 4-byte
length-prefixed elements. Standard library + numpy, Python 3.10 syntax.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np

from .spec import WIRE_TO_NUMPY

WARMUP_DIR = "warmup"


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


def warmup_samples(model_config: dict[str, Any], model_dir: str) -> list[tuple[str, dict[str, np.ndarray]]]:
    """(name, request arrays) per warm-up sample of the config; a sample it cannot build is left to Triton."""
    batching = int(model_config.get("max_batch_size") or 0) > 0
    out = []
    for sample in model_config.get("model_warmup") or []:
        arrays = sample_arrays(sample, model_dir, batching)
        if arrays:
            out.append((str(sample.get("name") or "warmup"), arrays))
    return out
