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
``"warmup": false`` turns it off (a ``predict`` with side effects). The sample's name carries its source
(``snooze_warmup_signature`` / ``snooze_warmup_samples``): on the python backend a generated warm-up that
fails is skipped (said once; the model loads), a shipped one fails the load. Native backends run the
sample inside Triton, where a failure fails the load: they get a generated one only for a fully static
signature (zeros of fixed shapes), never one with a variable dim that 1 may not suit (a detector's image).

Learned warm-ups: the runtime notes the first real request's input shapes after a load
(``python_backend/warmup.py``, ``<journal dir>/<pid>-<ticks>.warmup``); the control plane keeps them in the
model folder (``learned_warmup.json``, gone with a republish, which replaces the folder) and the runtime's
next warm-ups run zeros of those shapes instead of the generated inputs.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from controlplane.dtypes import parse_dtype
from controlplane.errors import InvalidPackageError

WARMUP_DIR = "warmup"  # Triton reads input_data_file from <model folder>/warmup/
SAMPLE_PREFIX = "snooze_warmup_"  # + the source: python_backend/warmup.py reads it back
SHORT_STRING = b"snooze"
LEARNED_FILE = "learned_warmup.json"  # in the model folder (python_backend/warmup.py reads it)
NOTE_SUFFIX = ".warmup"  # the runtime's note in the journal folder
SIGNATURE, SAMPLES, LEARNED = "signature", "samples", "learned"


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
    source: str = SIGNATURE  # SAMPLES when the package shipped any: then a failure fails the load


def serialize_bytes(values: np.ndarray) -> bytes:
    """BYTES elements as Triton reads them: a 4-byte little-endian length, then the bytes, in C order."""
    out = bytearray()
    for item in np.asarray(values, dtype=object).reshape(-1):
        raw = item.encode() if isinstance(item, str) else bytes(item)
        out += struct.pack("<I", len(raw)) + raw
    return bytes(out)


def warmup_plan(spec: Any, input_views: list[dict[str, Any]], *, native: bool = False) -> WarmupPlan | None:
    """The warm-up of ``spec`` (a ModelSpec) given its rendered inputs (name, triton_type, dims), or
    None when the package turned it off (or, on a native backend, when a generated one could not be
    trusted: see the module's doc). Raises InvalidPackageError for a sample that does not fit."""
    setting = spec.package.manifest.warmup
    if setting is False:
        return None
    samples = setting if isinstance(setting, dict) else {}
    if native and not samples and any(-1 in v["dims"] for v in input_views):
        return None
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
    return WarmupPlan(inputs, files, SAMPLES if samples else SIGNATURE)


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
        return serialize_bytes(
            np.vectorize(lambda v: v if isinstance(v, bytes) else str(v).encode(), otypes=[object])(array)
        )
    return np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()


def warmup_view(plan: WarmupPlan | None) -> list[dict[str, Any]]:
    """What the config template renders (empty: no warm-up)."""
    if plan is None:
        return []
    return [{"name": SAMPLE_PREFIX + plan.source, "inputs": [vars(i) for i in plan.inputs]}]


def plan_source(config_text: str) -> str | None:
    """The warm-up source a rendered config declares (``signature`` / ``samples``), None without one."""
    at = config_text.find(f'"{SAMPLE_PREFIX}')
    if at < 0:
        return None
    start = at + 1 + len(SAMPLE_PREFIX)
    return config_text[start : config_text.find('"', start)]


# ---------------------------------------------------------------------------------------------
# Learned warm-ups: the runtime's notes, kept with the model


def read_note(journal_dir: Path, pid: int, start_ticks: int) -> dict[str, Any] | None:
    """A model process's warm-up note (python_backend/warmup.py WarmupNote), or None."""
    with contextlib.suppress(OSError, ValueError):
        raw = json.loads((journal_dir / f"{pid}-{start_ticks}{NOTE_SUFFIX}").read_text("utf-8"))
        if isinstance(raw, dict):
            return raw
    return None


def learned_shapes(model_dir: Path) -> dict[str, dict[str, Any]] | None:
    """The input shapes (without the batch axis) and datatypes learned from a published model's traffic,
    ``{input: {"shape": [...], "datatype": "FP32"}}``, or None when none were learned since its publish."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        raw = json.loads((Path(model_dir) / LEARNED_FILE).read_text("utf-8"))
        inputs = raw["inputs"]
        if isinstance(inputs, dict) and inputs:
            return {
                str(k): {"shape": [int(d) for d in v["shape"]], "datatype": str(v["datatype"])}
                for k, v in inputs.items()
            }
    return None


def keep_learned(model_dir: Path, shapes: dict[str, dict[str, Any]]) -> bool:
    """Keep ``shapes`` as the model's learned warm-up (atomically, in its folder); False when they are
    what it holds already, or the folder is gone (deleted or republished meanwhile)."""
    model_dir = Path(model_dir)
    if learned_shapes(model_dir) == shapes or not model_dir.is_dir():
        return False
    tmp = model_dir / f".{LEARNED_FILE}.tmp"
    try:
        tmp.write_text(json.dumps({"format": 1, "inputs": shapes}), encoding="utf-8")
        os.replace(tmp, model_dir / LEARNED_FILE)
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    return True
