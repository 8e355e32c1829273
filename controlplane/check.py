"""`snoozectl check`: the local smoke test of a package, without Triton.

The model is loaded in a child process (the control plane never runs user code in its own process)
through the same runtime code a Triton instance uses, so a package that passes here loads there.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from controlplane.dtypes import parse_dtype
from controlplane.errors import InvalidPackageError, SnoozeError
from controlplane.render import runtime_config
from controlplane.spec import DeploymentSpec, ModelSpec, TensorSpec, package_kind, resolve
from converters.samples import sample_array
from python_backend.batching import narrowing_note
from python_backend.local_check import RETURNED_KEY
from python_backend.spec import TensorSpec as RuntimeTensor

_SHAPE = re.compile(r"^(?P<name>[^:=]+):(?P<shape>\d+(?:x\d+)*)$")
_FILE = re.compile(r"^(?P<name>[^:=]+)=(?P<file>.+\.npy)$")


class CheckFailed(SnoozeError):
    status_code = 422
    code = "check_failed"


@dataclass
class CheckResult:
    model_id: str
    device: str
    outputs: dict[str, np.ndarray]  # as served: conformed to the declared datatypes
    returned: dict[str, str] = field(default_factory=dict)  # dtype predict itself returned, per output
    notes: dict[str, str] = field(default_factory=dict)  # per output: a narrowing cast the runtime made


def example_array(tensor: TensorSpec, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Data of the tensor's type for a smoke test (``converters.samples``, the generator validate and parity
    use too). BF16 is refused: the python-backend runtime has no numpy type to hand such a tensor over in."""
    dtype = parse_dtype(tensor.datatype)
    if dtype.wire == "BF16":
        raise InvalidPackageError(
            f"input '{tensor.name}': the python-backend runtime cannot pass BF16 tensors to a model (numpy has no "
            "bfloat16)",
            hint="declare the input FP32 (or FP16) and convert inside predict",
        )
    return sample_array(dtype.numpy, shape, rng)


def parse_input_options(options: list[str], spec: ModelSpec) -> dict[str, np.ndarray | tuple[int, ...]]:
    """`name:4x3` gives a shape (batch axis included), `name=file.npy` gives the data."""
    known = {t.name for t in spec.package.inputs}
    given: dict[str, np.ndarray | tuple[int, ...]] = {}
    for option in options:
        shape_match, file_match = _SHAPE.match(option), _FILE.match(option)
        if not (shape_match or file_match):
            raise InvalidPackageError(
                f"--input {option!r}: expected NAME:SHAPE (e.g. x:4x3, batch axis first) or NAME=FILE.npy"
            )
        name = (shape_match or file_match).group("name")  # type: ignore[union-attr]
        if name not in known:
            raise InvalidPackageError(
                f"--input {option!r}: model '{spec.id}' has no input '{name}' (it has {sorted(known)})"
            )
        if shape_match:
            given[name] = tuple(int(d) for d in shape_match.group("shape").split("x"))
        else:
            given[name] = np.load(file_match.group("file"), allow_pickle=True)  # type: ignore[union-attr]
    return given


def build_inputs(spec: ModelSpec, options: list[str], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    given = parse_input_options(options, spec)
    batched = spec.deployment.max_batch_size > 0
    batch = next((v[0] for v in given.values() if isinstance(v, tuple) and batched), 1)
    arrays = {}
    for tensor in spec.package.inputs:
        value = given.get(tensor.name)
        if isinstance(value, np.ndarray):
            arrays[tensor.name] = value
            continue
        default = ((batch,) if batched else ()) + tuple(1 if d == -1 else d for d in tensor.dims)
        arrays[tensor.name] = example_array(tensor, value or default, rng)
    return arrays


def check_package(
    path: Path, options: list[str], *, device: str = "cpu", max_batch_size: int = 8, timeout: float | None = None
) -> CheckResult:
    """Load the package and run one request. A Triton model folder runs in the embedded tritonserver (its code is
    written against Triton's python backend), with its own config: ``device`` and ``max_batch_size`` are its
    config's there."""
    if package_kind(Path(path)).triton_folder:
        from controlplane.check_triton import check_triton_folder

        spec = resolve(DeploymentSpec(id=_safe_id(path), path=path))
        manifest = spec.package.manifest
        limit = timeout or manifest.load_timeout_secs + manifest.request_timeout_secs
        return check_triton_folder(Path(path), build_inputs(spec, options), spec, limit)
    spec = resolve(DeploymentSpec(id=_safe_id(path), path=path, max_batch_size=max_batch_size))
    inputs = build_inputs(spec, options)
    manifest = spec.package.manifest
    limit = timeout or manifest.load_timeout_secs + manifest.request_timeout_secs
    with tempfile.TemporaryDirectory(prefix="snooze-check-") as tmp:
        work = Path(tmp)
        (work / "runtime.json").write_text(json.dumps(runtime_config(spec)))
        np.savez(work / "inputs.npz", **inputs)
        cmd = [
            sys.executable,
            "-m",
            "python_backend.local_check",
            str(work / "runtime.json"),
            str(spec.package.path.resolve()),
            str(work / "inputs.npz"),
            device,
            str(work / "out.npz"),
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=tmp)
        except subprocess.TimeoutExpired as exc:
            raise CheckFailed(
                f"model at {path}: load + predict did not finish within {limit:.0f} s",
                hint="raise load_timeout_secs/request_timeout_secs in snooze_model.json or find the hang",
            ) from exc
        if proc.returncode != 0:
            raise CheckFailed(f"model at {path} failed:\n{proc.stderr.rstrip()}")
        with np.load(work / "out.npz", allow_pickle=True) as out:
            outputs = {name: out[name] for name in out.files if name != RETURNED_KEY}
            returned = json.loads(str(out[RETURNED_KEY])) if RETURNED_KEY in out.files else {}
    notes = {}
    for tensor in spec.package.outputs:
        if tensor.name in returned and tensor.name in outputs:
            runtime = RuntimeTensor(tensor.name, tensor.datatype, tuple(tensor.dims))
            note = narrowing_note(np.dtype(returned[tensor.name]), runtime)
            if note:
                notes[tensor.name] = note
    return CheckResult(spec.id, device, outputs, returned, notes)


def _safe_id(path: Path) -> str:
    name = re.sub(r"[^A-Za-z0-9_.\-]", "-", Path(path).resolve().name).lstrip("-_.")
    return name or "model"
