"""Triton model folders written here, laid out as Triton users lay them out (config.pbtxt, numbered version folders
with model.py / model.onnx), for the tests of Triton folders as a package kind. Each model uses Triton's python
backend API (``triton_python_backend_utils``) the way Triton's own examples do, and none imports snoozeml.

- ``calc``: a hand-written config; FP32 sum and difference and a BYTES input tagged by a sibling module (1/labels.py);
  a config parameter read in initialize; pb_utils.Logger.
- ``auto_batch`` / ``auto_nobatch``: ``auto_complete_config`` and no config.pbtxt (batching), or a partial one
  (no batching, a parameter the completion must keep).
- ``stream``: decoupled; its responses are sent from a thread of its own after execute returned (as Triton's repeat
  example does); finalize waits for those threads.
- ``counter``: a custom metric (pb_utils.MetricFamily counter) of the rows it saw.
- ``poison``: y = 2x; logs each row's x[0] to a file and its process exits on a row whose x[0] is -1; a row whose
  x[0] is -2 or -3 gets the model's own UNAVAILABLE or NOT_FOUND error.
- ``mlp``: an ONNX model with its own config: max_batch_size 16, two instances, dynamic batching with preferred sizes.
- ``versioned``: versions 1 and 2 (y = x + 1000 * version) served together (version_policy all).
- ``notes``: a folder of notes, no package of any kind.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

CALC_CONFIG = """
name: "calc"
backend: "python"
max_batch_size: 8
input [
  { name: "A" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "B" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "LABEL" data_type: TYPE_STRING dims: [ 1 ] }
]
output [
  { name: "SUM" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "DIFF" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "TAGGED" data_type: TYPE_STRING dims: [ 1 ] }
]
dynamic_batching { max_queue_delay_microseconds: 1000 }
instance_group [ { kind: KIND_CPU count: 1 } ]
parameters { key: "prefix" value { string_value: "calc:" } }
"""

CALC_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from labels import tagged


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        sum_config = pb_utils.get_output_config_by_name(config, "SUM")
        self.sum_type = pb_utils.triton_string_to_numpy(sum_config["data_type"])
        self.prefix = config["parameters"]["prefix"]["string_value"].encode()
        pb_utils.Logger.log_info(f"calc: initialized as {args['model_name']} version {args['model_version']}")

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "A").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "B").as_numpy()
            label = pb_utils.get_input_tensor_by_name(request, "LABEL").as_numpy()
            outputs = [
                pb_utils.Tensor("SUM", (a + b).astype(self.sum_type)),
                pb_utils.Tensor("DIFF", (a - b).astype(np.float32)),
                pb_utils.Tensor("TAGGED", tagged(self.prefix, label)),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses

    def finalize(self):
        pb_utils.Logger.log_info("calc: finalized")
"""

CALC_LABELS = """
import numpy as np


def tagged(prefix, label):
    return np.array([[prefix + value for value in row] for row in label], dtype=np.object_)
"""

AUTO_BATCH_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [3]})
        config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [3]})
        config.set_max_batch_size(4)
        config.set_dynamic_batching()
        return config

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)])
            for r in requests
        ]
"""

AUTO_NOBATCH_CONFIG = """
backend: "python"
parameters { key: "factor" value { string_value: "3" } }
"""

AUTO_NOBATCH_MODEL = """
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        known = {t["name"] for t in config.as_dict()["input"]}
        if "X" not in known:
            config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [3]})
        config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [3]})
        return config

    def initialize(self, args):
        self.factor = float(json.loads(args["model_config"])["parameters"]["factor"]["string_value"])

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * self.factor)]
            )
            for r in requests
        ]
"""

STREAM_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] }
]
instance_group [ { kind: KIND_CPU } ]
"""

STREAM_MODEL = """
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        if not pb_utils.using_decoupled_model_transaction_policy(__import__("json").loads(args["model_config"])):
            raise pb_utils.TritonModelException("stream must be decoupled")
        self.threads = []

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            thread = threading.Thread(target=self.respond, args=(request.get_response_sender(), n), daemon=True)
            self.threads.append(thread)
            thread.start()
        return None

    def respond(self, sender, n):
        for i in range(n):
            outputs = [
                pb_utils.Tensor("OUT", np.array([10 * i], np.int32)),
                pb_utils.Tensor("IDX", np.array([i], np.uint32)),
            ]
            sender.send(pb_utils.InferenceResponse(output_tensors=outputs))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join(timeout=5)
"""

XY_CONFIG = """
backend: "python"
max_batch_size: 8
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 2 ] }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 2 ] }} ]
dynamic_batching {{ }}
{extra}
"""

COUNTER_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        # Kept as long as its metric: Triton refuses a metric whose family was deleted.
        self.family = pb_utils.MetricFamily(
            name="snooze_test_rows_total", description="rows the model saw", kind=pb_utils.MetricFamily.COUNTER
        )
        self.rows = self.family.Metric(labels={"model": args["model_name"], "version": args["model_version"]})

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            self.rows.increment(x.shape[0])
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", x * 2)]))
        return responses
"""

POISON_MODEL = """
import json
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.calls = json.loads(args["model_config"])["parameters"]["calls"]["string_value"]

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            with open(self.calls, "a") as f:
                f.write("".join(f"{v:g}\\n" for v in x[:, 0]))
            if (x[:, 0] == -1).any():
                os._exit(1)  # the process dies in the middle of a request
            if (x[:, 0] == -2).any():  # the model's own errors, with the statuses Triton uses for a missing model
                error = pb_utils.TritonError("the feature store is busy", pb_utils.TritonError.UNAVAILABLE)
                responses.append(pb_utils.InferenceResponse(error=error))
            elif (x[:, 0] == -3).any():
                error = pb_utils.TritonError("no features for this user", pb_utils.TritonError.NOT_FOUND)
                responses.append(pb_utils.InferenceResponse(error=error))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", x * 2)]))
        return responses
"""

VERSIONED_MODEL = """
import triton_python_backend_utils as pb_utils

VERSION = {version}


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", x + 1000 * VERSION)]))
        return responses
"""

MLP_CONFIG = """
name: "mlp"
platform: "onnxruntime_onnx"
max_batch_size: 16
input [ { name: "input" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "output" data_type: TYPE_FP32 dims: [ 2 ] } ]
instance_group [ { kind: KIND_CPU count: 2 } ]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 500 }
"""

MLP_WEIGHTS = np.arange(8, dtype=np.float32).reshape(4, 2)


# An ensemble of two models of the repository: a step that names a version ("versioned" 1: x + 1000), then the
# latest of "counter" (y * 2). Triton runs both inside the ensemble's request.
PIPE_CONFIG = """
name: "pipe"
platform: "ensemble"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "versioned"
      model_version: 1
      input_map { key: "x" value: "x" }
      output_map { key: "y" value: "plus_1000" }
    },
    {
      model_name: "counter"
      model_version: -1
      input_map { key: "x" value: "plus_1000" }
      output_map { key: "y" value: "y" }
    }
  ]
}
"""


def _write(folder: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return folder


def write_calc(folder: Path) -> Path:
    return _write(folder, {"config.pbtxt": CALC_CONFIG, "1/model.py": CALC_MODEL, "1/labels.py": CALC_LABELS})


def write_auto_batch(folder: Path) -> Path:
    return _write(folder, {"1/model.py": AUTO_BATCH_MODEL})


def write_auto_nobatch(folder: Path) -> Path:
    return _write(folder, {"config.pbtxt": AUTO_NOBATCH_CONFIG, "1/model.py": AUTO_NOBATCH_MODEL})


def write_stream(folder: Path) -> Path:
    return _write(folder, {"config.pbtxt": STREAM_CONFIG, "1/model.py": STREAM_MODEL})


def write_counter(folder: Path) -> Path:
    return _write(folder, {"config.pbtxt": XY_CONFIG.format(extra=""), "1/model.py": COUNTER_MODEL})


def write_poison(folder: Path, calls: Path) -> Path:
    extra = f'parameters {{ key: "calls" value {{ string_value: "{calls}" }} }}'
    return _write(folder, {"config.pbtxt": XY_CONFIG.format(extra=extra), "1/model.py": POISON_MODEL})


def write_versioned(folder: Path) -> Path:
    return _write(
        folder,
        {
            "config.pbtxt": XY_CONFIG.format(extra="version_policy { all { } }"),
            "1/model.py": VERSIONED_MODEL.format(version=1),
            "2/model.py": VERSIONED_MODEL.format(version=2),
        },
    )


def write_mlp(folder: Path) -> Path:
    """output = input @ MLP_WEIGHTS, input [batch, 4] -> output [batch, 2]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = numpy_helper.from_array(MLP_WEIGHTS, name="W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "W"], ["output"])],
        "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 2])],
        initializer=[weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (folder / "1").mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(folder / "1" / "model.onnx"))
    return _write(folder, {"config.pbtxt": MLP_CONFIG})


def write_pipe(folder: Path) -> Path:
    (folder / "1").mkdir(parents=True, exist_ok=True)  # an ensemble's version folder is empty
    return _write(folder, {"config.pbtxt": PIPE_CONFIG})


def write_notes(folder: Path) -> Path:
    return _write(folder, {"README.md": "Notes about the models; no model here.\n"})


def write_repository(root: Path, calls: Path) -> Path:
    """A Triton repository of every model above (and the notes folder)."""
    write_calc(root / "calc")
    write_auto_batch(root / "auto_batch")
    write_auto_nobatch(root / "auto_nobatch")
    write_stream(root / "stream")
    write_counter(root / "counter")
    write_poison(root / "poison", calls)
    write_versioned(root / "versioned")
    write_mlp(root / "mlp")
    write_pipe(root / "pipe")
    write_notes(root / "notes")
    return root
