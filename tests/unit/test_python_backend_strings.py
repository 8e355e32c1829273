"""String tensors in the python-backend runtime: BYTES decoded for an ONNX model's tensor(string) inputs, text
returned as bytes, without Triton. Runs on Python 3.10 too (make test-runtime-py310): the onnxruntime tests
skip there, naming why, where onnx or onnxruntime is not installed."""

from __future__ import annotations

import numpy as np
import pytest

from python_backend.batching import BatchPlan
from python_backend.errors import BadModelOutput, Failure, InvalidInput
from python_backend.runners import OnnxRunner
from python_backend.spec import parse_spec
from python_backend.strings import decode_text, encode_text

CITIES = np.array([["zürich".encode(), b"oslo"], ["straße".encode(), b"rome"]], dtype=object)


def test_bytes_are_decoded_as_utf8_text_of_the_same_shape():
    text = decode_text(CITIES, "city")
    assert text.dtype == object and text.shape == (2, 2)
    assert text.tolist() == [["zürich", "oslo"], ["straße", "rome"]]
    assert all(type(v) is str for v in text.ravel())


def test_text_already_decoded_is_returned_as_it_is():
    text = decode_text(CITIES, "city")
    assert decode_text(text, "city") is text


def test_an_input_that_is_not_utf8_is_refused_naming_the_input_and_element():
    bad = np.array([[b"ok", b"fine"], [b"\xffbad", b"x"]], dtype=object)
    with pytest.raises(InvalidInput) as e:
        decode_text(bad, "city")
    message = str(e.value)
    assert message.startswith("input 'city' element [1, 0] is not UTF-8 (invalid start byte at byte 0); ")
    assert message.endswith("send UTF-8 encoded strings")


@pytest.mark.parametrize(
    "value",
    [
        np.array([["é", "a"]], dtype=object),  # str objects
        np.array([["é", "a"]]),  # fixed-width unicode (<U1)
        np.array([["é".encode(), b"a"]]),  # fixed-width bytes (S2)
        np.array([[np.bytes_("é".encode()), np.bytes_(b"a")]], dtype=object),  # numpy bytes scalars
        np.array([[bytearray("é".encode()), b"a"]], dtype=object),
    ],
    ids=["str", "unicode", "fixed-bytes", "numpy-bytes", "bytearray"],
)
def test_text_and_bytes_like_outputs_become_plain_bytes(value):
    out = encode_text(value, "output 'y'")
    assert out.dtype == object and out.shape == (1, 2)
    assert [type(v) for v in out.ravel()] == [bytes, bytes]
    assert out.tolist() == [["é".encode(), b"a"]]


def test_an_object_array_of_bytes_is_returned_as_it_is():
    assert encode_text(CITIES, "output 'y'") is CITIES


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (np.array([[b"a", 5]], dtype=object), "element [0, 1] is a int"),
        (np.array([None, b"a"], dtype=object), "element [0] is a NoneType"),
        (np.array(["\ud800"], dtype=object), "element [0] is a str that UTF-8 cannot encode (surrogates not allowed)"),
    ],
)
def test_an_output_element_that_is_not_text_is_refused_naming_it(value, problem):
    with pytest.raises(BadModelOutput) as e:
        encode_text(value, "output 'y'")
    assert str(e.value) == (
        f"output 'y' {problem}, but the output is declared BYTES; return bytes or str elements (str is sent as UTF-8)"
    )


# ---------------------------------------------------------------------------------------------
# OnnxRunner with a real onnxruntime session


def _runner(tmp_path, graph_nodes, inputs, outputs, ml_opset=None):
    onnx = pytest.importorskip("onnx", reason="building the test model needs onnx")
    pytest.importorskip("onnxruntime", reason="OnnxRunner needs onnxruntime")
    from onnx import helper

    graph = helper.make_graph(graph_nodes, "strings", inputs, outputs)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("ai.onnx.ml", ml_opset)] if ml_opset else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "model.onnx"))
    runner = OnnxRunner("model.onnx", [o.name for o in outputs], intra_op_num_threads=1)
    runner.load(str(tmp_path), "cpu")
    return runner


def _label_encoder(tmp_path):
    """words [n, 2] (string) -> ids (int64) and upper (string): both LabelEncoders, non-ASCII keys and values."""
    pytest.importorskip("onnx", reason="building the test model needs onnx")
    from onnx import TensorProto, helper

    keys = ["zürich", "straße", "oslo"]
    nodes = [
        helper.make_node("LabelEncoder", ["words"], ["ids"], domain="ai.onnx.ml", keys_strings=keys,
                         values_int64s=[1, 2, 3], default_int64=-1),
        helper.make_node("LabelEncoder", ["words"], ["upper"], domain="ai.onnx.ml", keys_strings=keys,
                         values_strings=["ZÜRICH", "STRASSE", "OSLO"], default_string="?"),
    ]  # fmt: skip
    return _runner(
        tmp_path, nodes,
        [helper.make_tensor_value_info("words", TensorProto.STRING, ["n", 2])],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 2]),
         helper.make_tensor_value_info("upper", TensorProto.STRING, ["n", 2])],
        ml_opset=2,
    )  # fmt: skip


def test_the_onnx_runner_answers_triton_bytes_as_onnxruntime_answers_text(tmp_path):
    runner = _label_encoder(tmp_path)
    assert runner.text_inputs == ("words",) and runner.prepare_inputs is not None
    got = runner.predict({"words": CITIES})  # as Triton hands BYTES over: object arrays of bytes
    want = runner.session.run(None, {"words": decode_text(CITIES, "words")})
    assert got["ids"].tolist() == want[0].tolist() == [[1, 3], [2, -1]]
    assert [type(v) for v in got["upper"].ravel()] == [bytes] * 4
    assert got["upper"].tolist() == [[s.encode() for s in row] for row in want[1].tolist()]
    assert got["upper"].tolist() == [["ZÜRICH".encode(), b"OSLO"], [b"STRASSE", b"?"]]


def test_a_string_normalizer_with_an_explicit_locale_answers_as_onnxruntime(tmp_path):
    """onnxruntime's StringNormalizer defaults to the locale en_US.UTF-8; a machine without it (C, C.utf8 and
    POSIX only) cannot build the session unless the model names a locale it has."""
    pytest.importorskip("onnx", reason="building the test model needs onnx")
    from onnx import TensorProto, helper

    node = helper.make_node("StringNormalizer", ["x"], ["y"], case_change_action="UPPER", is_case_sensitive=0,
                            stopwords=["monday", "the"], locale="C.UTF-8")  # fmt: skip
    runner = _runner(
        tmp_path, [node],
        [helper.make_tensor_value_info("x", TensorProto.STRING, [1, "c"])],
        [helper.make_tensor_value_info("y", TensorProto.STRING, [1, "d"])],
    )  # fmt: skip
    words = np.array([[b"Monday", b"tuesday", b"THE", b"Wednesday"]], dtype=object)
    got = runner.predict({"x": words})
    assert got["y"].tolist() == [[b"TUESDAY", b"WEDNESDAY"]]


def test_a_model_without_string_tensors_runs_the_session_as_it_is(tmp_path):
    pytest.importorskip("onnx", reason="building the test model needs onnx")
    from onnx import TensorProto, helper

    runner = _runner(
        tmp_path, [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
    )  # fmt: skip
    # Decided at load: no conversion step for any request.
    assert runner.prepare_inputs is None and runner.predict == runner._run
    x = np.array([[-1.0, 0.5, 2.0]], np.float32)
    np.testing.assert_array_equal(runner.predict({"x": x})["y"], np.maximum(x, 0))


def test_a_request_that_is_not_utf8_fails_alone_in_a_shared_batch(tmp_path):
    runner = _label_encoder(tmp_path)
    spec = parse_spec({
        "format": 1, "model_id": "cities", "kind": "onnx", "onnx_file": "model.onnx", "max_batch_size": 4,
        "inputs": [{"name": "words", "datatype": "BYTES", "dims": [2]}],
        "outputs": [{"name": "ids", "datatype": "INT64", "dims": [2]},
                    {"name": "upper", "datatype": "BYTES", "dims": [2]}],
    })  # fmt: skip
    calls = []

    def predict(inputs):
        calls.append(inputs["words"].shape[0])
        return runner.predict(inputs)

    bad = {"words": np.array([[b"oslo", b"\xc3("]], dtype=object)}
    first, refused, second = BatchPlan(spec, runner.prepare_inputs).run(
        [{"words": CITIES[:1]}, bad, {"words": CITIES[1:]}], predict
    )
    assert calls == [2]  # the two good requests shared one predict call
    assert isinstance(refused, Failure) and refused.kind == "invalid_input"
    assert refused.message.startswith(
        "[snooze:invalid_input] model 'cities': input 'words' element [0, 1] is not UTF-8 (invalid continuation byte"
    )
    assert first["ids"].tolist() == [[1, 3]] and second["ids"].tolist() == [[2, -1]]
    assert first["upper"].tolist() == [["ZÜRICH".encode(), b"OSLO"]]
