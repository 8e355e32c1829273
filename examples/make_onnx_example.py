"""Write the example ONNX model (a 2-layer MLP with fixed weights) with onnx.helper: no torch needed.

Usage: python examples/make_onnx_example.py examples/models/onnx-mlp/model.onnx
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def weights() -> dict[str, np.ndarray]:
    """Deterministic weights, also used by the tests to compute expected answers."""
    rng = np.random.default_rng(7)
    return {
        "w1": rng.standard_normal((4, 8)).astype(np.float32),
        "b1": rng.standard_normal(8).astype(np.float32),
        "w2": rng.standard_normal((8, 2)).astype(np.float32),
        "b2": rng.standard_normal(2).astype(np.float32),
    }


def reference(x: np.ndarray) -> np.ndarray:
    w = weights()
    return np.maximum(x @ w["w1"] + w["b1"], 0) @ w["w2"] + w["b2"]


def build() -> onnx.ModelProto:
    w = weights()
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
        helper.make_node("Add", ["h3", "b2"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "onnx_mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 2])],
        initializer=[numpy_helper.from_array(v, k) for k, v in w.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by the onnxruntime in Triton 24.10 and by current releases
    onnx.checker.check_model(model)
    return model


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "examples/models/onnx-mlp/model.onnx")
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build(), str(out))
    print(f"wrote {out}")
