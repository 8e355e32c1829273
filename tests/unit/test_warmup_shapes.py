"""Warm-up sources, learned shapes and odd tensor shapes, without a Triton (the render and runtime halves)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from controlplane.errors import InvalidPackageError
from controlplane.render import FULL_TARGET, embedded_target, render_model
from controlplane.spec import DeploymentSpec, resolve
from controlplane.warmup_samples import keep_learned, learned_shapes, plan_source
from python_backend.spec import RuntimeSpec, TensorSpec
from python_backend.warmup import declared_outputs, learned_arrays, sample_source


def _onnx(folder: Path, inputs: list, outputs: list, nodes: list) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(folder / "model.onnx"))
    return folder


def _image_model(folder: Path) -> Path:
    return _onnx(
        folder,
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["b", 3, "h", "w"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", 3, "h", "w"])],
        [helper.make_node("Relu", ["images"], ["out"])],
    )


def test_the_sample_name_says_its_source_and_native_backends_skip_a_variable_generated_one(tmp_path: Path) -> None:
    spec = resolve(DeploymentSpec(id="det", path=_image_model(tmp_path / "det")))
    embedded = render_model(spec, embedded_target()).config_text
    assert plan_source(embedded) == "signature" and "dims: 1\n" in embedded  # -1 taken as 1 (best effort there)
    # Natively Triton runs the sample and a failure fails the load: no generated warm-up with a variable dim.
    assert plan_source(render_model(spec, FULL_TARGET).config_text) is None
    assert sample_source("snooze_warmup_signature") == "signature" and sample_source("snooze_warmup") == "samples"


def test_dims_written_as_zero_question_mark_or_an_expression_are_variable(tmp_path: Path) -> None:
    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    value.type.tensor_type.shape.dim.add().dim_value = 0
    value.type.tensor_type.shape.dim.add().dim_param = "?"
    value.type.tensor_type.shape.dim.add().dim_param = "2*seq"
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 0, "?", "2*seq"])
    spec = resolve(
        DeploymentSpec(id="m", path=_onnx(tmp_path / "m", [value], [out], [helper.make_node("Relu", ["x"], ["y"])]))
    )
    assert spec.package.inputs[0].dims == [4, -1, -1, -1]  # fails without the fix: the 0 stayed a 0


def test_a_batch_axis_that_is_not_first_publishes_without_batching_and_says_why(tmp_path: Path) -> None:
    pkg = _onnx(
        tmp_path / "s",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, "batch", 128])],
        [helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [2, "batch", 128])],
        [helper.make_node("Tanh", ["h"], ["h_out"])],
    )
    spec = resolve(DeploymentSpec(id="s", path=pkg))
    assert spec.deployment.max_batch_size == 0 and spec.package.inputs[0].dims == [2, -1, 128]
    [note] = spec.notes
    assert note.startswith("max_batch_size 0 (no batching): the first (batch) axis must be dynamic")
    assert "input 'h' has dims [2, -1, 128] (first axis is fixed at 2)" in note
    assert json.loads(render_model(spec, embedded_target()).writes["snooze_deployment.json"])["notes"] == [note]
    with pytest.raises(InvalidPackageError, match="first axis is fixed at 2"):  # asked for explicitly: refused
        resolve(DeploymentSpec(id="s", path=pkg, max_batch_size=8))


def test_learned_shapes_are_kept_once_and_read_back(tmp_path: Path) -> None:
    shapes = {"images": {"shape": [3, 320, 320], "datatype": "FP32"}}
    assert learned_shapes(tmp_path) is None
    assert keep_learned(tmp_path, shapes) and not keep_learned(tmp_path, shapes)  # the same shapes: no write
    assert learned_shapes(tmp_path) == shapes
    assert not keep_learned(tmp_path / "gone", shapes)  # republished or deleted meanwhile


def _runtime(**kw: object) -> RuntimeSpec:
    base = dict(
        model_id="m",
        kind="custom",
        tensor_format="numpy",
        max_batch_size=8,
        inputs=(TensorSpec("images", "FP32", (3, -1, -1)), TensorSpec("text", "BYTES", (1,))),
        outputs=(TensorSpec("boxes", "FP32", (-1, 7)), TensorSpec("label", "INT64", ())),
    )
    base.update(kw)
    return RuntimeSpec(**base)  # type: ignore[arg-type]


def test_learned_arrays_are_zeros_of_the_learned_shapes_and_stale_ones_are_ignored() -> None:
    spec = _runtime()
    arrays = learned_arrays(
        spec, {"images": {"shape": [3, 96, 64], "datatype": "FP32"}, "text": {"shape": [1], "datatype": "BYTES"}}
    )
    assert arrays["images"].shape == (1, 3, 96, 64) and not arrays["images"].any()
    assert arrays["text"].tolist() == [[b""]]
    assert (
        learned_arrays(
            spec, {"images": {"shape": [4, 96, 64], "datatype": "FP32"}, "text": {"shape": [1], "datatype": "BYTES"}}
        )
        is None
    )  # no longer fits


def test_triton_s_warmup_request_is_answered_with_outputs_of_the_declared_shapes() -> None:
    out = declared_outputs(_runtime())
    assert out["boxes"].shape == (1, 1, 7) and out["boxes"].dtype == np.float32
    assert out["label"].shape == (1,) and out["label"].dtype == np.int64
    assert declared_outputs(_runtime(max_batch_size=0))["label"].shape == ()


def test_learned_shapes_survive_until_a_republish(tmp_path: Path) -> None:
    from controlplane.store import ModelStore

    store = ModelStore(tmp_path / "repo", embedded_target())
    spec = resolve(DeploymentSpec(id="det", path=_image_model(tmp_path / "det")))
    folder = store.publish(spec).path
    assert keep_learned(folder, {"images": {"shape": [3, 64, 64], "datatype": "FP32"}})
    assert learned_shapes(ModelStore(tmp_path / "repo", embedded_target()).get("det").path)  # a restart: kept
    store.publish(spec)  # a republish replaces the folder: learned from the new model's traffic again
    assert learned_shapes(store.get("det").path) is None


def test_a_scalar_on_the_native_onnx_backend_is_dims_1_without_an_empty_reshape(tmp_path: Path) -> None:
    from harness.corpus_models import scalar_onnx

    spec = resolve(DeploymentSpec(id="vad", path=scalar_onnx(tmp_path / "vad")))
    text = render_model(spec, FULL_TARGET).config_text
    # Triton 2.51 refuses an empty reshape without batching; its ONNX Runtime backend feeds a rank-0 input from [1].
    assert 'platform: "onnxruntime_onnx"' in text and "max_batch_size" not in text  # 0: the proto default
    assert 'name: "sr"\n  data_type: TYPE_INT64\n  dims: 1\n}' in text and "reshape" not in text
