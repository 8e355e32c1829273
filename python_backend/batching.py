"""Validate requests, collate the dynamic batch, call predict, split results: pure numpy, no Triton.

`run_batch` holds the whole per-execute policy so it can be tested without a tritonserver; the
Triton adapter (triton_model.py) only turns `pb_utils` requests into dicts of numpy arrays and the
results back into responses.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np

from .errors import BadModelOutput, Failure, InvalidInput, describe_failure
from .spec import WIRE_TO_NUMPY, RuntimeSpec, TensorSpec
from .strings import encode_text

Arrays = dict[str, np.ndarray]
Prepare = Callable[[Arrays], Arrays]

_NUMPY_TO_WIRE = {dtype: wire for wire, dtype in WIRE_TO_NUMPY.items()}


def wire_name(dtype: np.dtype) -> str:
    return _NUMPY_TO_WIRE.get(np.dtype(dtype), str(dtype))


def _dims_match(expected: Sequence[int], actual: Sequence[int]) -> bool:
    if len(expected) != len(actual):
        return False
    return all(e == -1 or e == a for e, a in zip(expected, actual, strict=True))


def _shape_text(dims: Sequence[int], batched: bool) -> str:
    parts = (["batch"] if batched else []) + [str(d) for d in dims]
    return "[" + ", ".join(parts) + "]"


def check_request(spec: RuntimeSpec, arrays: Arrays) -> int | None:
    """Check one request's inputs against the declared signature; return its batch size.

    Returns None for a model without a batch axis (max_batch_size 0). Raises InvalidInput naming the
    input and what the client must send instead. Triton checks the same things against config.pbtxt,
    but that config can be overridden at load time, and the model's code relies on this signature.
    """
    declared = {t.name: t for t in spec.inputs}
    unknown = sorted(set(arrays) - set(declared))
    if unknown:
        raise InvalidInput(f"unknown input(s) {unknown}; the model's inputs are {sorted(declared)}")
    missing = [name for name in declared if name not in arrays]
    if missing:
        raise InvalidInput(f"missing input(s) {missing}; send every declared input: {sorted(declared)}")

    batch_size = None
    for tensor in spec.inputs:
        array = arrays[tensor.name]
        if array.dtype != tensor.dtype:
            raise InvalidInput(
                f"input '{tensor.name}' is {wire_name(array.dtype)} but the model expects {tensor.datatype}; "
                f"send {tensor.datatype}"
            )
        sample_shape = array.shape[1:] if spec.batched else array.shape
        if (spec.batched and array.ndim == 0) or not _dims_match(tensor.dims, sample_shape):
            wildcard = " (-1 = any size)" if -1 in tensor.dims else ""
            raise InvalidInput(
                f"input '{tensor.name}' has shape {list(array.shape)} but the model expects "
                f"{_shape_text(tensor.dims, spec.batched)}{wildcard}; reshape the input"
            )
        if spec.batched:
            rows = array.shape[0]
            if batch_size is not None and rows != batch_size:
                raise InvalidInput(
                    f"input '{tensor.name}' has {rows} rows but the other inputs have {batch_size}; "
                    "every input of a request needs the same batch size (axis 0)"
                )
            batch_size = rows
    if spec.batched and batch_size is not None and not 1 <= batch_size <= spec.max_batch_size:
        raise InvalidInput(
            f"batch size {batch_size} is outside 1..{spec.max_batch_size} (the model's max_batch_size); "
            "split the request"
        )
    return batch_size


def group_for_collation(spec: RuntimeSpec, requests: Sequence[Arrays]) -> list[list[int]]:
    """Indices of the requests that can share one predict call, in arrival order.

    Requests concatenate along axis 0 only when every input has the same per-sample shape (inputs
    with -1 dims may differ between requests); a model without a batch axis takes one request at a
    time.
    """
    if not spec.batched:
        return [[i] for i in range(len(requests))]
    groups: dict[tuple, list[int]] = {}
    for i, arrays in enumerate(requests):
        key = tuple(arrays[t.name].shape[1:] for t in spec.inputs)
        groups.setdefault(key, []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def collate(spec: RuntimeSpec, requests: Sequence[Arrays]) -> Arrays:
    if len(requests) == 1:
        return dict(requests[0])  # the common case at low load: no copy
    return {t.name: np.concatenate([r[t.name] for r in requests], axis=0) for t in spec.inputs}


# (model, output, returned dtype) already warned about in this process: one line per model instance.
_NARROWED: set[tuple[str, str, str]] = set()


def narrowing_note(returned: np.dtype, tensor: TensorSpec) -> str | None:
    """The output policy, for a returned dtype that differs from the declared one: a safe cast (int32 for
    INT64, float32 for FP64) needs no word; a narrowing one within the kind (float64 for FP32, int64 for
    INT32) is done, but said, because it can lose precision or range; other kinds are refused."""
    if returned == tensor.dtype or np.can_cast(returned, tensor.dtype, casting="safe"):
        return None
    return (
        f"predict returned {returned}, served as {tensor.datatype} by a narrowing cast (precision or range may "
        f"be lost); return {tensor.dtype} or declare {tensor.name!r} as {returned} in snooze_model.json"
    )


def _warn_narrowing(model_id: str, tensor: TensorSpec, returned: np.dtype) -> None:
    key = (model_id, tensor.name, str(returned))
    if key in _NARROWED:
        return
    _NARROWED.add(key)
    note = narrowing_note(returned, tensor)
    print(f"snooze model '{model_id}': output '{tensor.name}': {note} (said once per instance)",
          file=sys.stderr, flush=True)  # fmt: skip


def _conform(tensor: TensorSpec, value: Any, rows: int | None, batched: bool, what: str,
             model_id: str = "") -> np.ndarray:  # fmt: skip
    """Turn one returned value into an array of the declared dtype and dims, or raise BadModelOutput."""
    try:
        array = np.asarray(value)
    except Exception as e:  # e.g. a CUDA tensor: numpy cannot read device memory
        raise BadModelOutput(
            f"{what} is a {type(value).__name__} that numpy cannot read ({e}); return numpy arrays (on CPU)"
        ) from None
    if tensor.datatype == "BYTES":
        if array.dtype.kind not in "OSU":
            raise BadModelOutput(
                f"{what} is {array.dtype} but is declared BYTES; return an object array of bytes or str"
            )
        array = encode_text(array, what)
    elif array.dtype != tensor.dtype:
        if not np.can_cast(array.dtype, tensor.dtype, casting="same_kind"):
            raise BadModelOutput(
                f"{what} is {array.dtype}, which cannot be cast to its declared {tensor.datatype}; "
                f"return {tensor.dtype} (or fix the declared datatype)"
            )
        if not np.can_cast(array.dtype, tensor.dtype, casting="safe"):
            _warn_narrowing(model_id, tensor, array.dtype)
        array = array.astype(tensor.dtype)
    if batched:
        if array.ndim == 0 or array.shape[0] != rows:
            got = "a scalar" if array.ndim == 0 else f"{array.shape[0]} rows"
            raise BadModelOutput(
                f"{what} has {got} but the batch has {rows}; predict must return one row per input row along axis 0"
            )
    sample_shape = array.shape[1:] if batched else array.shape
    if not _dims_match(tensor.dims, sample_shape):
        raise BadModelOutput(
            f"{what} has shape {list(array.shape)} but is declared {_shape_text(tensor.dims, batched)}; "
            "fix predict or the declared output dims"
        )
    # pb_utils.Tensor needs C-contiguous memory; a transposed or strided result would be rejected there.
    return np.ascontiguousarray(array) if tensor.datatype != "BYTES" else array


def _require_dict(outputs: Any) -> dict:
    if not isinstance(outputs, dict):
        raise BadModelOutput(
            f"predict returned {type(outputs).__name__}; it must return a dict of output name -> array"
        )
    return outputs


def check_outputs(spec: RuntimeSpec, outputs: Any, rows: int | None) -> Arrays:
    """Validate a numpy-format predict result for a collated batch of `rows` (None: no batch axis).

    Keys that are not declared outputs are dropped: Triton would reject a response carrying them.
    """
    outputs = _require_dict(outputs)
    missing = [t.name for t in spec.outputs if t.name not in outputs]
    if missing:
        raise BadModelOutput(
            f"predict did not return output(s) {missing} (returned {sorted(map(str, outputs))}); "
            "return every declared output"
        )
    return {
        t.name: _conform(t, outputs[t.name], rows, spec.batched, f"output '{t.name}'", spec.model_id)
        for t in spec.outputs
    }


def split(outputs: Arrays, batch_sizes: Sequence[int]) -> list[Arrays]:
    """Cut collated outputs back into per-request results along axis 0."""
    results = []
    start = 0
    for size in batch_sizes:
        results.append({name: array[start : start + size] for name, array in outputs.items()})
        start += size
    return results


def check_raw_outputs(spec: RuntimeSpec, outputs: Any, batch_sizes: Sequence[int | None]) -> list[Arrays]:
    """Validate a raw-format result (name -> one array per request) and regroup it per request."""
    outputs = _require_dict(outputs)
    per_request: list[Arrays] = [{} for _ in batch_sizes]
    for t in spec.outputs:
        values = outputs.get(t.name)
        if not isinstance(values, (list, tuple)) or len(values) != len(batch_sizes):
            got = "nothing" if values is None else f"{type(values).__name__} of {_length(values)}"
            raise BadModelOutput(
                f"raw output '{t.name}' must be a list with one array per request ({len(batch_sizes)}), got {got}"
            )
        for i, (value, rows) in enumerate(zip(values, batch_sizes, strict=True)):
            what = f"output '{t.name}' of request {i}"
            per_request[i][t.name] = _conform(t, value, rows, spec.batched, what, spec.model_id)
    return per_request


def _length(value: Any) -> str:
    try:
        return f"length {len(value)}"
    except TypeError:
        return "no length"


def run_batch(spec: RuntimeSpec, requests: Sequence[Arrays], predict: Callable[[Any], Any]) -> list[Any]:
    """Answer one Triton execute: a result dict or a Failure per request, in request order.

    A request that fails validation gets its own Failure and is left out of predict, so it never
    fails its neighbours. A failure inside predict (or of its outputs) fails the requests that shared
    that predict call: which request caused it cannot be known.
    """
    return BatchPlan(spec).run(requests, predict)


def _compiled(tensors: Sequence[TensorSpec]) -> tuple[tuple[str, np.dtype, tuple[int, ...], bool], ...]:
    return tuple((t.name, t.dtype, t.dims, -1 in t.dims) for t in tensors)


class BatchPlan:
    """`run_batch` for one model, its signature compiled once (an instance keeps one for its life).

    The checks of the request path accept a well-formed request or result in a few comparisons; anything
    they do not accept at once goes through check_request / check_outputs, which accept what is valid
    (wildcard dims, castable dtypes) and word every error, so both paths answer alike.
    """

    def __init__(self, spec: RuntimeSpec, prepare: Prepare | None = None) -> None:
        self.spec = spec
        # The model's own per-request conversion (OnnxRunner: text decoded), run on each valid request before
        # collation; its InvalidInput fails that request alone, as a failed check does.
        self.prepare = prepare
        self.model_id = spec.model_id
        self.batched = spec.batched
        self.max_batch_size = spec.max_batch_size
        self.raw = spec.tensor_format == "raw"
        self.inputs = _compiled(spec.inputs)
        self.outputs = _compiled(spec.outputs)
        self.text_outputs = frozenset(t.name for t in spec.outputs if t.datatype == "BYTES")
        # Without -1 dims every valid request has the same per-sample shapes: one collation group.
        self.one_group = not any(wildcard for *_, wildcard in self.inputs)

    def batch_size(self, arrays: Arrays) -> int | None:
        """check_request's answer for a request; raises its InvalidInput for one it rejects."""
        if len(arrays) == len(self.inputs):
            rows = -1
            for name, dtype, dims, wildcard in self.inputs:
                array = arrays.get(name)
                if array is None or array.dtype != dtype:
                    break
                shape = array.shape
                if not self.batched:
                    if shape != dims and (not wildcard or not _dims_match(dims, shape)):
                        break
                    continue
                if not shape or (shape[0] != rows and rows != -1):
                    break
                rows = shape[0]
                if shape[1:] != dims and (not wildcard or not _dims_match(dims, shape[1:])):
                    break
            else:
                if not self.batched:
                    return None
                if 1 <= rows <= self.max_batch_size:
                    return rows
        return check_request(self.spec, arrays)

    def checked_outputs(self, outputs: Any, rows: int | None) -> Arrays:
        """check_outputs' answer for a numpy-format result: arrays that already conform pass as they are."""
        if type(outputs) is dict:
            checked = {}
            for name, dtype, dims, wildcard in self.outputs:
                array = outputs.get(name)
                if type(array) is not np.ndarray or array.dtype != dtype or not array.flags.c_contiguous:
                    break
                shape = array.shape
                if self.batched:
                    if not shape or shape[0] != rows:
                        break
                    shape = shape[1:]
                if shape != dims and (not wildcard or not _dims_match(dims, shape)):
                    break
                checked[name] = encode_text(array, f"output '{name}'") if name in self.text_outputs else array
            else:
                return checked
        return check_outputs(self.spec, outputs, rows)

    def run(self, requests: Sequence[Arrays], predict: Callable[[Any], Any]) -> list[Any]:
        if len(requests) == 1:  # the common case at low load: no grouping, collation or split
            return [self._run_one(requests[0], predict)]
        results: list[Any] = [None] * len(requests)
        valid: list[int] = []
        batch_sizes: dict[int, int | None] = {}
        prepare = self.prepare
        if prepare is not None:  # a copy: the caller's list keeps the requests as they came
            requests = prepared = list(requests)
        for i, arrays in enumerate(requests):
            try:
                batch_sizes[i] = self.batch_size(arrays)
                if prepare is not None:
                    prepared[i] = prepare(arrays)
                valid.append(i)
            except InvalidInput as e:
                results[i] = self._failure(e, None)

        if self.raw or (self.one_group and self.batched):
            groups = [valid] if valid else []
        else:
            groups = [[valid[j] for j in g] for g in group_for_collation(self.spec, [requests[i] for i in valid])]

        for group in groups:
            sizes = [batch_sizes[i] for i in group]
            counts = [n for n in sizes if n is not None]  # all of sizes when the model is batched
            rows = sum(counts) if self.batched else None
            answers: Sequence[Arrays | Failure]
            try:
                if self.raw:
                    raw_inputs = {name: [requests[i][name] for i in group] for name, *_ in self.inputs}
                    answers = check_raw_outputs(self.spec, predict(raw_inputs), sizes)
                else:
                    outputs = self.checked_outputs(predict(collate(self.spec, [requests[i] for i in group])), rows)
                    answers = split(outputs, counts) if self.batched else [outputs]
            except Exception as e:  # user code can raise anything; each becomes a per-request error
                answers = [self._failure(e, rows)] * len(group)
            for i, answer in zip(group, answers, strict=True):
                results[i] = answer
        return results

    def _run_one(self, arrays: Arrays, predict: Callable[[Any], Any]) -> Any:
        try:
            rows = self.batch_size(arrays)
            if self.prepare is not None:
                arrays = self.prepare(arrays)
        except InvalidInput as e:
            return self._failure(e, None)
        try:
            if self.raw:
                raw_inputs = {name: [arrays[name]] for name, *_ in self.inputs}
                return check_raw_outputs(self.spec, predict(raw_inputs), [rows])[0]
            return self.checked_outputs(predict(dict(arrays)), rows)
        except Exception as e:  # user code can raise anything; it becomes this request's error
            return self._failure(e, rows)

    def stream(self, arrays: Arrays, predict: Callable[[Any], Any]) -> Generator[Any, None, None]:
        """A decoupled model's request: each result ``predict`` yields, checked like a unary result; a
        ``Failure`` (last) when the request is invalid, predict raises or a result does not conform.
        Closing this generator (a cancelled request) closes predict's."""
        try:
            rows = self.batch_size(arrays)
            if self.prepare is not None:
                arrays = self.prepare(arrays)
        except InvalidInput as e:
            yield self._failure(e, None)
            return
        inputs = {name: [arrays[name]] for name, *_ in self.inputs} if self.raw else dict(arrays)
        results = None
        try:
            results = iter(predict(inputs))
            for outputs in results:
                if self.raw:
                    yield check_raw_outputs(self.spec, outputs, [rows])[0]
                else:
                    yield self.checked_outputs(outputs, rows)
        except Exception as e:  # user code can raise anything; it ends this request's stream
            yield self._failure(e, rows)
        finally:
            close = getattr(results, "close", None)
            if close is not None:
                close()

    def _failure(self, exc: BaseException, rows: int | None) -> Failure:
        return Failure(*describe_failure(exc, self.model_id, "predict", rows))
