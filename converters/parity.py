"""Numerical parity between an original model and its ONNX export (run with onnxruntime on CPU).

The original is any callable `dict[str, np.ndarray] -> dict[str, np.ndarray]` (a package's `predict`,
or `torch_export.TorchRunner`). Both run on the same seeded random batches, generated from the ONNX
signature, at several batch sizes, and on optional user-provided batches.

An element passes when `|onnx - reference| <= atol + rtol * |reference|` (numpy's `allclose` rule,
NaNs equal). `max_rel` is reported over elements whose reference magnitude is at least `atol` (relative
error near zero says nothing), and is 0 when there are none.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from converters.errors import ConversionError
from converters.onnx_inspect import TensorSpec, inspect_onnx
from converters.samples import INT_RANGE, sample_array

Reference = Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]]


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


EXACT = Tolerance(0.0, 0.0)
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(1e-6, 1e-5),
    "float32": Tolerance(1e-4, 1e-3),
    "float16": Tolerance(1e-2, 1e-2),
    "bfloat16": Tolerance(5e-2, 2e-2),
}
"""Floating types; every other dtype (integers, bool, strings) must match exactly."""

# Non-batch axes that are dynamic in the signature get this size when no example gives one.
DEFAULT_VARIABLE_DIM = 4


@dataclass(frozen=True)
class Comparison:
    """One output on one input batch."""

    case: str
    batch_size: int
    output: str
    dtype: str
    shape: list[int]
    max_abs: float
    max_rel: float
    atol: float
    rtol: float
    passed: bool
    detail: str | None = None
    """Why it failed beyond the numbers (shape/dtype mismatch, missing output, an exception)."""


@dataclass
class ParityReport:
    artifact: str
    reference: str
    seed: int
    comparisons: list[Comparison] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.comparisons) and all(c.passed for c in self.comparisons)

    @property
    def failures(self) -> list[Comparison]:
        return [c for c in self.comparisons if not c.passed]

    def worst(self) -> dict[str, Comparison]:
        """Per output, the comparison with the largest absolute error."""
        worst: dict[str, Comparison] = {}
        for c in self.comparisons:
            if c.output not in worst or c.max_abs > worst[c.output].max_abs:
                worst[c.output] = c
        return worst

    def summary(self) -> str:
        if self.passed:
            errors = ", ".join(f"{name} max abs {c.max_abs:.3g}" for name, c in self.worst().items())
            return f"parity passed on {len(self.comparisons)} comparisons ({errors})"
        first = self.failures[0] if self.failures else None
        if first is None:
            return "parity not checked: no comparisons were made"
        what = first.detail or (
            f"max abs {first.max_abs:.3g}, max rel {first.max_rel:.3g} > atol {first.atol:g} + rtol {first.rtol:g}"
        )
        return (
            f"parity failed on {len(self.failures)} of {len(self.comparisons)} comparisons; first: output "
            f"'{first.output}' on {first.case}: {what}"
        )

    def to_json(self) -> str:
        """JSON text; an infinite error (a comparison that could not be made) is written as null."""
        body = {"passed": self.passed, **asdict(self)}
        for comparison in body["comparisons"]:
            for key in ("max_abs", "max_rel"):
                if not np.isfinite(comparison[key]):
                    comparison[key] = None
        return json.dumps(body, indent=2, allow_nan=False)

    def save(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        path.write_text(self.to_json() + "\n")
        return path

    def table(self) -> Any:
        """A rich Table of every comparison (rich imported here: the CLI's dependency)."""
        from rich.table import Table

        table = Table(title=f"parity: {self.artifact} vs {self.reference}")
        for column in ("case", "output", "dtype", "shape", "max abs", "max rel", "tolerance", "result"):
            table.add_column(column, justify="right" if column.startswith("max") else "left")
        for c in self.comparisons:
            result = "[green]ok[/green]" if c.passed else f"[red]FAIL[/red] {c.detail or ''}".rstrip()
            table.add_row(
                c.case,
                c.output,
                c.dtype,
                str(c.shape),
                f"{c.max_abs:.3g}",
                f"{c.max_rel:.3g}",
                f"atol {c.atol:g} rtol {c.rtol:g}",
                result,
            )
        return table


def parity_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 3 and the maximum, within the maximum; [0] means 'no batch axis' (max_batch_size 0)."""
    if max_batch_size <= 0:
        return [0]
    return sorted({b for b in (1, 3, max_batch_size) if b <= max_batch_size})


def random_inputs(
    specs: Sequence[TensorSpec],
    batch_size: int,
    rng: np.random.Generator,
    like: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Seeded random inputs for `specs`. `batch_size` 0 means the tensors have no batch axis.

    Variable non-batch axes take their size from `like` (example inputs) when given, else 4. Integer
    inputs are drawn within the example's value range (so indices stay valid), else in [0, 10).
    """
    out = {}
    for spec in specs:
        example = None if like is None else like.get(spec.name)
        out[spec.name] = _random_tensor(spec, batch_size, rng, example)
    return out


def _random_tensor(
    spec: TensorSpec, batch_size: int, rng: np.random.Generator, example: np.ndarray | None
) -> np.ndarray:
    dims = spec.dims_without_batch if batch_size else spec.dims
    if example is not None and example.ndim == len(spec.dims):
        sample_dims = list(example.shape[1:] if batch_size else example.shape)
        dims = [s if d == -1 else d for d, s in zip(dims, sample_dims, strict=True)]
    shape = ([batch_size] if batch_size else []) + [DEFAULT_VARIABLE_DIM if d == -1 else d for d in dims]
    int_range = INT_RANGE
    if example is not None and example.size and spec.dtype not in ("object", "bool", *DEFAULT_TOLERANCES):
        int_range = (int(example.min()), int(example.max()) + 1)  # indices stay valid
    return sample_array(spec.dtype, shape, rng, int_range=int_range)


def compare_outputs(
    case: str,
    batch_size: int,
    reference: Mapping[str, np.ndarray],
    actual: Mapping[str, np.ndarray],
    outputs: Sequence[TensorSpec],
    tolerances: Mapping[str, Tolerance],
) -> list[Comparison]:
    """Compare each declared output of `actual` (the export) with `reference`."""
    return [_compare_one(case, batch_size, spec, reference, actual, tolerances) for spec in outputs]


def _compare_one(
    case: str,
    batch_size: int,
    spec: TensorSpec,
    reference: Mapping[str, np.ndarray],
    actual: Mapping[str, np.ndarray],
    tolerances: Mapping[str, Tolerance],
) -> Comparison:
    tol = tolerances.get(spec.dtype, EXACT)

    def failed(shape: list[int], detail: str) -> Comparison:
        return Comparison(
            case,
            batch_size,
            spec.name,
            spec.dtype,
            shape,
            float("inf"),
            float("inf"),
            tol.atol,
            tol.rtol,
            False,
            detail,
        )

    if spec.name not in reference:
        return failed([], f"the reference returned no output '{spec.name}' (it returned {sorted(reference)})")
    ref, got = np.asarray(reference[spec.name]), np.asarray(actual[spec.name])
    shape = list(got.shape)
    if ref.shape != got.shape:
        return failed(shape, f"shape {shape} from ONNX, {list(ref.shape)} from the reference")
    if ref.dtype != got.dtype:
        return failed(shape, f"dtype {got.dtype} from ONNX, {ref.dtype} from the reference")
    if ref.dtype == object:
        differ = int(np.sum(ref != got))
        error = 0.0 if differ == 0 else float("inf")
        detail = f"{differ} string(s) differ" if differ else None
        return Comparison(case, batch_size, spec.name, spec.dtype, shape, error, error, 0.0, 0.0, not differ, detail)

    ref64, got64 = ref.astype(np.float64), got.astype(np.float64)
    nan_ref, nan_got = np.isnan(ref64), np.isnan(got64)
    both_nan = nan_ref & nan_got
    diff = np.where(both_nan, 0.0, np.abs(got64 - ref64))
    if tol == EXACT:
        within = (ref == got) | both_nan
    else:
        within = (diff <= tol.atol + tol.rtol * np.abs(ref64)) | both_nan
    scale = np.abs(ref64)
    significant = scale >= max(tol.atol, np.finfo(np.float64).tiny)
    max_rel = float(np.max(diff[significant] / scale[significant])) if np.any(significant) else 0.0
    max_abs = float(np.nanmax(diff, initial=0.0)) if diff.size else 0.0
    outside = int(np.sum(~within))
    detail = None
    if outside:
        lone_nans = int(np.sum(nan_ref != nan_got))
        detail = f"{outside} of {within.size} element(s) outside tolerance" + (
            f", {lone_nans} NaN on one side only" if lone_nans else ""
        )
    return Comparison(
        case, batch_size, spec.name, spec.dtype, shape, max_abs, max_rel, tol.atol, tol.rtol, outside == 0, detail
    )


def check_parity(
    reference: Reference,
    onnx_path: str | os.PathLike[str],
    *,
    max_batch_size: int,
    reference_name: str = "reference",
    example_inputs: Mapping[str, np.ndarray] | None = None,
    user_inputs: Sequence[Mapping[str, np.ndarray]] = (),
    batch_sizes: Sequence[int] | None = None,
    tolerances: Mapping[str, Tolerance] | None = None,
    seed: int = 0,
    report_path: str | os.PathLike[str] | None = None,
) -> ParityReport:
    """Compare `reference` and the ONNX model at `onnx_path` on random and user inputs.

    `batch_sizes` defaults to `parity_batch_sizes(max_batch_size)`. `tolerances` override the defaults
    per dtype name. An exception from either side becomes a failed comparison (with the reason), not
    an error, so the report always says what happened. With `report_path`, the report is saved there.
    """
    import onnxruntime as ort

    onnx_path = Path(onnx_path)
    signature = inspect_onnx(onnx_path)
    if max_batch_size > 0:
        signature.require_batchable()
    try:
        session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ConversionError(f"{onnx_path}: onnxruntime cannot load the model: {exc}") from exc
    merged = {**DEFAULT_TOLERANCES, **(tolerances or {})}
    rng = np.random.default_rng(seed)
    report = ParityReport(artifact=str(onnx_path), reference=reference_name, seed=seed)

    cases: list[tuple[str, int, dict[str, np.ndarray]]] = []
    for batch in batch_sizes or parity_batch_sizes(max_batch_size):
        label = f"random, batch {batch}" if batch else "random"
        cases.append((label, batch, random_inputs(signature.inputs, batch, rng, example_inputs)))
    for index, given in enumerate(user_inputs):
        arrays = {name: np.asarray(value) for name, value in given.items()}
        batch = next(iter(arrays.values())).shape[0] if max_batch_size > 0 and arrays else 0
        cases.append((f"user input {index}", batch, arrays))

    for label, batch, inputs in cases:
        report.comparisons += _run_case(label, batch, inputs, reference, session, signature.outputs, merged)
    if report_path is not None:
        report.save(report_path)
    return report


def _run_case(
    label: str,
    batch: int,
    inputs: dict[str, np.ndarray],
    reference: Reference,
    session: Any,
    outputs: Sequence[TensorSpec],
    tolerances: Mapping[str, Tolerance],
) -> list[Comparison]:
    names = [spec.name for spec in outputs]
    try:
        got = dict(zip(names, session.run(names, inputs), strict=True))
    except Exception as exc:
        return _all_failed(label, batch, outputs, tolerances, f"onnxruntime raised {_short(exc)}")
    try:
        # the reference gets copies: a predict that writes into its inputs must not change the other side
        expected = reference({name: value.copy() for name, value in inputs.items()})
    except Exception as exc:
        return _all_failed(label, batch, outputs, tolerances, f"the reference raised {_short(exc)}")
    return compare_outputs(label, batch, expected, got, outputs, tolerances)


def _all_failed(
    label: str, batch: int, outputs: Sequence[TensorSpec], tolerances: Mapping[str, Tolerance], detail: str
) -> list[Comparison]:
    return [
        Comparison(
            label,
            batch,
            spec.name,
            spec.dtype,
            [],
            float("inf"),
            float("inf"),
            tolerances.get(spec.dtype, EXACT).atol,
            tolerances.get(spec.dtype, EXACT).rtol,
            False,
            detail,
        )
        for spec in outputs
    ]


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"
