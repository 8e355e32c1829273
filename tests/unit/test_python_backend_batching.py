"""Collate / split / validate of the python-backend runtime, without Triton."""

from __future__ import annotations

import numpy as np
import pytest

from python_backend.batching import (
    BatchPlan,
    check_outputs,
    check_raw_outputs,
    check_request,
    collate,
    group_for_collation,
    run_batch,
    split,
)
from python_backend.errors import BadModelOutput, Failure, InvalidInput
from python_backend.spec import parse_spec


def make_spec(**overrides):
    raw = {
        "format": 1,
        "model_id": "m1",
        "kind": "custom",
        "entrypoint": "snooze_model.py",
        "max_batch_size": 4,
        "inputs": [
            {"name": "x", "datatype": "FP32", "dims": [3]},
            {"name": "s", "datatype": "BYTES", "dims": [-1]},
        ],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [3]}],
    }
    raw.update(overrides)
    return parse_spec(raw)


def req(rows, s_len=1, x_dtype=np.float32, start=0.0):
    x = (np.arange(rows * 3, dtype=np.float64) + start).reshape(rows, 3).astype(x_dtype)
    s = np.array([[b"a"] * s_len] * rows, dtype=object)
    return {"x": x, "s": s}


def test_check_request_returns_batch_size():
    assert check_request(make_spec(), req(2)) == 2


@pytest.mark.parametrize(
    ("arrays", "needle"),
    [
        ({"x": np.zeros((1, 3), np.float32)}, "missing input(s) ['s']"),
        ({**req(1), "z": np.zeros((1,), np.float32)}, "unknown input(s) ['z']"),
        (req(1, x_dtype=np.int32), "input 'x' is INT32 but the model expects FP32"),
        ({"x": np.zeros((1, 4), np.float32), "s": req(1)["s"]}, "input 'x' has shape [1, 4]"),
        ({"x": np.zeros((2, 3), np.float32), "s": req(1)["s"]}, "input 's' has 1 rows but the other inputs"),
        (req(5), "batch size 5 is outside 1..4"),
        ({"x": np.zeros((0, 3), np.float32), "s": np.zeros((0, 1), object)}, "batch size 0 is outside 1..4"),
    ],
)
def test_check_request_rejects(arrays, needle):
    with pytest.raises(InvalidInput) as e:
        check_request(make_spec(), arrays)
    assert needle in str(e.value)


def _outcome(check, *args):
    try:
        return "ok", check(*args)
    except (InvalidInput, BadModelOutput) as e:
        return type(e).__name__, str(e)


EXACT_DIMS = [{"name": "x", "datatype": "FP32", "dims": [3]}, {"name": "n", "datatype": "INT64", "dims": [2, 1]}]
REQUESTS_TO_CHECK = [
    req(1),
    req(4, s_len=9),
    {"x": np.zeros((1, 3), np.float32)},
    {**req(1), "z": np.zeros((1,), np.float32)},
    {"x": np.zeros((1, 3), np.float32), "z": req(1)["s"]},
    req(1, x_dtype=np.int32),
    req(1, x_dtype=np.float64),
    {"x": np.zeros((1, 4), np.float32), "s": req(1)["s"]},
    {"x": np.zeros(3, np.float32), "s": req(1)["s"]},
    {"x": np.float32(1), "s": req(1)["s"]},
    {"x": np.zeros((2, 3), np.float32), "s": req(1)["s"]},
    {"x": np.zeros((1, 3), np.float32), "s": np.zeros((1,), object)},
    req(5),
    {"x": np.zeros((0, 3), np.float32), "s": np.zeros((0, 1), object)},
    {"x": np.zeros((2, 3), np.float32), "n": np.zeros((2, 2, 1), np.int64)},
    {"x": np.zeros((2, 3), np.float32), "n": np.zeros((2, 1, 2), np.int64)},
    {"x": np.zeros((2, 3), np.float32), "n": np.zeros((3, 2, 1), np.int64)},
    {"x": np.zeros((3,), np.float32), "n": np.zeros((2, 1), np.int64)},
    {"x": np.zeros((1, 3), np.float32), "n": np.zeros((2, 1), np.int64)},
]


@pytest.mark.parametrize(
    "spec",
    [
        make_spec(),
        make_spec(inputs=EXACT_DIMS),
        make_spec(max_batch_size=0, inputs=EXACT_DIMS),
        make_spec(max_batch_size=0),
    ],
    ids=["wildcard", "exact", "unbatched-exact", "unbatched-wildcard"],
)
@pytest.mark.parametrize("i", range(len(REQUESTS_TO_CHECK)))
def test_compiled_request_check_answers_like_check_request(spec, i):
    """The request path's compiled check accepts, rejects and words its errors exactly as check_request."""
    arrays = REQUESTS_TO_CHECK[i]
    assert _outcome(BatchPlan(spec).batch_size, arrays) == _outcome(check_request, spec, arrays)


OUTPUTS_TO_CHECK = [
    {"y": np.ones((2, 3), np.float32)},
    {"y": np.ones((2, 3), np.float32), "debug": 1},
    {"y": np.ones((2, 3), np.float64)},
    {"y": np.ones((3, 2), np.float32).T},
    {"y": np.ma.masked_array(np.ones((2, 3), np.float32))},
    {"y": [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]},
    [1, 2],
    {},
    {"y": np.ones((3, 3), np.float32)},
    {"y": np.float32(1)},
    {"y": np.ones((2, 4), np.float32)},
    {"y": np.ones((2, 3, 1), np.float32)},
    {"y": np.array([["a"] * 3] * 2, dtype=object)},
]


@pytest.mark.parametrize(
    "spec",
    [make_spec(), make_spec(outputs=[{"name": "y", "datatype": "FP32", "dims": [-1]}]), make_spec(max_batch_size=0)],
    ids=["exact", "wildcard", "unbatched"],
)
@pytest.mark.parametrize("i", range(len(OUTPUTS_TO_CHECK)))
def test_compiled_output_check_answers_like_check_outputs(spec, i):
    """Same arrays (dtype, shape, contiguity) or the same worded error as check_outputs."""
    outputs = OUTPUTS_TO_CHECK[i]
    rows = 2 if spec.batched else None
    fast, slow = _outcome(BatchPlan(spec).checked_outputs, outputs, rows), _outcome(check_outputs, spec, outputs, rows)
    assert fast[0] == slow[0]
    if fast[0] != "ok":
        assert fast[1] == slow[1]
        return
    assert list(fast[1]) == list(slow[1])
    for name, array in fast[1].items():
        assert type(array) is np.ndarray and array.flags.c_contiguous
        assert array.dtype == slow[1][name].dtype and array.shape == slow[1][name].shape
        np.testing.assert_array_equal(array, slow[1][name])


def test_conforming_outputs_pass_through_without_a_copy():
    y = np.ones((2, 3), np.float32)
    assert BatchPlan(make_spec()).checked_outputs({"y": y}, 2)["y"] is y


def test_wildcard_dims_accept_any_size():
    assert check_request(make_spec(), req(1, s_len=7)) == 1


def test_unbatched_model_has_no_batch_axis():
    spec = make_spec(max_batch_size=0, inputs=[{"name": "x", "datatype": "FP32", "dims": [2, 3]}])
    assert check_request(spec, {"x": np.zeros((2, 3), np.float32)}) is None
    with pytest.raises(InvalidInput, match=r"expects \[2, 3\]"):
        check_request(spec, {"x": np.zeros((1, 2, 3), np.float32)})
    assert group_for_collation(spec, [{}, {}]) == [[0], [1]]


def test_group_splits_requests_whose_variable_dims_differ():
    spec = make_spec()
    groups = group_for_collation(spec, [req(1, s_len=1), req(1, s_len=2), req(2, s_len=1)])
    assert groups == [[0, 2], [1]]


def test_collate_and_split_round_trip():
    spec = make_spec()
    parts = [req(1, start=0), req(2, start=100)]
    batch = collate(spec, parts)
    assert batch["x"].shape == (3, 3) and batch["s"].dtype == object
    back = split({"y": batch["x"]}, [1, 2])
    np.testing.assert_array_equal(back[0]["y"], parts[0]["x"])
    np.testing.assert_array_equal(back[1]["y"], parts[1]["x"])


def test_check_outputs_casts_and_drops_undeclared():
    out = check_outputs(make_spec(), {"y": np.ones((2, 3), np.float64), "debug": 1}, rows=2)
    assert list(out) == ["y"] and out["y"].dtype == np.float32


def test_check_outputs_makes_arrays_contiguous():
    out = check_outputs(make_spec(), {"y": np.ones((3, 2), np.float32).T}, rows=2)
    assert out["y"].flags["C_CONTIGUOUS"]


@pytest.mark.parametrize(
    ("outputs", "needle"),
    [
        ([1, 2], "predict returned list"),
        ({}, "did not return output(s) ['y']"),
        ({"y": np.ones((3, 3), np.float32)}, "output 'y' has 3 rows but the batch has 2"),
        ({"y": np.float32(1)}, "output 'y' has a scalar but the batch has 2"),
        ({"y": np.ones((2, 4), np.float32)}, "output 'y' has shape [2, 4] but is declared [batch, 3]"),
        ({"y": np.array([["a"] * 3] * 2, dtype=object)}, "cannot be cast to its declared FP32"),
    ],
)
def test_check_outputs_rejects(outputs, needle):
    with pytest.raises(BadModelOutput) as e:
        check_outputs(make_spec(), outputs, rows=2)
    assert needle in str(e.value)


def test_bytes_outputs_accept_str_and_fixed_width_bytes():
    spec = make_spec(outputs=[{"name": "t", "datatype": "BYTES", "dims": [1]}])
    for value in (np.array([[b"ab"]], dtype="S2"), np.array([["ab"]])):
        assert check_outputs(spec, {"t": value}, rows=1)["t"].dtype == object
    with pytest.raises(BadModelOutput, match="declared BYTES"):
        check_outputs(spec, {"t": np.ones((1, 1), np.float32)}, rows=1)


def test_raw_outputs_are_validated_per_request():
    spec = make_spec(tensor_format="raw")
    per = check_raw_outputs(spec, {"y": [np.ones((1, 3)), np.ones((2, 3))]}, [1, 2])
    assert [r["y"].shape for r in per] == [(1, 3), (2, 3)]
    with pytest.raises(BadModelOutput, match="one array per request"):
        check_raw_outputs(spec, {"y": [np.ones((1, 3))]}, [1, 2])
    with pytest.raises(BadModelOutput, match="output 'y' of request 1 has 1 rows but the batch has 2"):
        check_raw_outputs(spec, {"y": [np.ones((1, 3)), np.ones((1, 3))]}, [1, 2])


def test_run_batch_isolates_invalid_requests_and_collates_the_rest():
    spec = make_spec()
    calls = []

    def predict(inputs):
        calls.append(inputs["x"].shape[0])
        return {"y": inputs["x"] * 2}

    good1, good2 = req(1, start=0), req(2, start=10)
    results = run_batch(spec, [good1, req(1, x_dtype=np.int32), good2], predict)
    assert calls == [3]  # one predict call over both valid requests
    assert isinstance(results[1], Failure) and results[1].kind == "invalid_input"
    assert results[1].message.startswith("[snooze:invalid_input] model 'm1': input 'x' is INT32")
    np.testing.assert_array_equal(results[0]["y"], good1["x"] * 2)
    np.testing.assert_array_equal(results[2]["y"], good2["x"] * 2)


def test_run_batch_predict_failure_fails_its_group_only():
    spec = make_spec()

    def predict(inputs):
        if inputs["s"].shape[1] == 2:
            raise ValueError("bad values")
        return {"y": inputs["x"]}

    results = run_batch(spec, [req(1), req(1, s_len=2)], predict)
    assert isinstance(results[0], dict)
    assert results[1].kind == "model_error"
    assert "predict raised ValueError: bad values at test_python_backend_batching.py:" in results[1].message


def test_run_batch_maps_oom():
    def predict(inputs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    (result,) = run_batch(make_spec(), [req(2)], predict)
    assert result.kind == "oom"
    assert result.message.startswith("[snooze:oom] model 'm1': predict ran out of memory on a batch of 2")


def test_run_batch_raw_passes_lists():
    spec = make_spec(tensor_format="raw")
    seen = {}

    def predict(inputs):
        seen.update(inputs)
        return {"y": [x + 1 for x in inputs["x"]]}

    results = run_batch(spec, [req(1), req(2)], predict)
    assert [a.shape for a in seen["x"]] == [(1, 3), (2, 3)]
    np.testing.assert_array_equal(results[1]["y"], req(2)["x"] + 1)


def test_single_request_path_answers_like_a_shared_batch():
    """A batch of one skips grouping, collation and split; its answers and errors are the same."""
    spec = make_spec()

    def predict(inputs):
        if inputs["x"][0, 0] < 0:
            raise ValueError("negative")
        if inputs["x"][0, 0] > 100:
            return {"y": inputs["x"][:, :2]}
        return {"y": inputs["x"] * 2}

    bad_dtype, bad_value, bad_output = req(1, x_dtype=np.int32), req(1, start=-50.0), req(1, start=500.0)
    for request in (req(2), bad_dtype, bad_value, bad_output):
        (alone,) = run_batch(spec, [request], predict)
        # in a shared batch with an invalid neighbour, the request has its own predict call too
        shared = run_batch(spec, [request, req(1, x_dtype=np.int64)], predict)[0]
        assert type(alone) is type(shared)
        if isinstance(alone, Failure):
            assert (alone.kind, alone.message.split(" at ")[0]) == (shared.kind, shared.message.split(" at ")[0])
        else:
            np.testing.assert_array_equal(alone["y"], shared["y"])
    assert "input 'x' is INT32" in run_batch(spec, [bad_dtype], predict)[0].message
    assert "output 'y' has shape [1, 2]" in run_batch(spec, [bad_output], predict)[0].message


def test_single_request_raw_format_gets_lists_of_one():
    spec = make_spec(tensor_format="raw")
    seen = {}

    def predict(inputs):
        seen.update(inputs)
        return {"y": [inputs["x"][0] + 1]}

    (result,) = run_batch(spec, [req(2)], predict)
    assert [a.shape for a in seen["x"]] == [(2, 3)] and len(seen["s"]) == 1
    np.testing.assert_array_equal(result["y"], req(2)["x"] + 1)


def test_run_batch_unbatched_calls_predict_per_request():
    spec = make_spec(max_batch_size=0, inputs=[{"name": "x", "datatype": "FP32", "dims": [3]}])
    calls = []

    def predict(inputs):
        calls.append(inputs["x"].shape)
        return {"y": inputs["x"]}

    results = run_batch(spec, [{"x": np.zeros(3, np.float32)}, {"x": np.ones(3, np.float32)}], predict)
    assert calls == [(3,), (3,)]
    np.testing.assert_array_equal(results[1]["y"], np.ones(3, np.float32))


def test_a_narrowing_output_cast_is_said_once_and_a_safe_one_not_at_all(capsys):
    from python_backend.batching import _NARROWED

    _NARROWED.clear()
    spec = make_spec(model_id="narrow", outputs=[{"name": "y", "datatype": "FP32", "dims": [3]},
                                                {"name": "n", "datatype": "INT64", "dims": [1]}])  # fmt: skip
    for _ in range(3):
        out = check_outputs(spec, {"y": np.ones((2, 3), np.float64), "n": np.ones((2, 1), np.int32)}, rows=2)
        assert out["y"].dtype == np.float32 and out["n"].dtype == np.int64
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "snooze model 'narrow': output 'y': predict returned float64, served as FP32 by a narrowing cast "
        "(precision or range may be lost); return float32 or declare 'y' as float64 in snooze_model.json "
        "(said once per instance)"
    ]


def test_the_models_per_request_conversion_runs_before_collation_and_fails_its_request_alone():
    """An ONNX model's text decoding: a request it refuses fails alone, on every path, the others are collated."""
    spec = make_spec()

    def prepare(arrays):
        if arrays["x"][0, 0] < 0:
            raise InvalidInput("input 'x' is negative")
        return {**arrays, "x": arrays["x"] + 100}

    calls = []

    def predict(inputs):
        calls.append(inputs["x"].shape[0])
        return {"y": inputs["x"]}

    plan = BatchPlan(spec, prepare)
    good1, bad, good2 = req(1), req(1, start=-50.0), req(2, start=10)
    first, refused, second = plan.run([good1, bad, good2], predict)
    assert calls == [3]
    assert refused == Failure("invalid_input", "[snooze:invalid_input] model 'm1': input 'x' is negative")
    np.testing.assert_array_equal(first["y"], good1["x"] + 100)
    np.testing.assert_array_equal(second["y"], good2["x"] + 100)
    assert plan.run([bad], predict) == [refused]
    assert list(plan.stream(bad, lambda inputs: iter([predict(inputs)]))) == [refused]
    [streamed] = plan.stream(good2, lambda inputs: iter([predict(inputs)]))
    np.testing.assert_array_equal(streamed["y"], good2["x"] + 100)


TEXT_OUTPUTS = [
    np.array([["é"], ["a"]], dtype=object),
    np.array([["é"], ["a"]]),
    np.array([[np.bytes_("é".encode())], [np.bytes_(b"a")]], dtype=object),
]


@pytest.mark.parametrize("value", TEXT_OUTPUTS, ids=["str", "unicode", "numpy-bytes"])
def test_text_outputs_reach_the_stub_as_plain_bytes_on_every_path(value):
    """Triton's stub sends an element as it is only when it is exactly bytes (else its str(): a numpy.bytes_
    would reach the client as "b'...'"): unary (both checks), raw and streamed answers all hand it bytes."""
    outputs = [{"name": "t", "datatype": "BYTES", "dims": [1]}]
    spec, raw_spec = make_spec(outputs=outputs), make_spec(outputs=outputs, tensor_format="raw")
    plan = BatchPlan(spec)
    answers = [
        plan.checked_outputs({"t": value}, 2),
        check_outputs(spec, {"t": value}, 2),
        *plan.run([req(2)], lambda inputs: {"t": value}),
        *BatchPlan(raw_spec).run([req(2)], lambda inputs: {"t": [value]}),
        *plan.stream(req(2), lambda inputs: iter([{"t": value}, {"t": value}])),
    ]
    assert len(answers) == 6
    for answer in answers:
        assert answer["t"].dtype == object and answer["t"].tolist() == [["é".encode()], [b"a"]]
        assert [type(v) for v in answer["t"].ravel()] == [bytes, bytes]


def test_a_bytes_output_holding_something_else_is_the_models_error_on_every_path():
    outputs = [{"name": "t", "datatype": "BYTES", "dims": [1]}]
    spec, raw_spec = make_spec(outputs=outputs), make_spec(outputs=outputs, tensor_format="raw")
    value = np.array([[b"a"], [7]], dtype=object)
    fix = "but the output is declared BYTES; return bytes or str elements (str is sent as UTF-8)"
    unary = Failure("model_error", f"[snooze:model_error] model 'm1': output 't' element [1, 0] is a int, {fix}")
    assert BatchPlan(spec).run([req(2)], lambda inputs: {"t": value}) == [unary]
    assert list(BatchPlan(spec).stream(req(2), lambda inputs: iter([{"t": value}]))) == [unary]
    [raw] = BatchPlan(raw_spec).run([req(2)], lambda inputs: {"t": [value]})
    assert raw.message == f"[snooze:model_error] model 'm1': output 't' of request 0 element [1, 0] is a int, {fix}"
