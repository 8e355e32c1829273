"""BLS callers for the tests: hand-written Triton python models (config.pbtxt + 1/model.py with a
``TritonPythonModel``) that call another model named in their request, as Triton's own BLS example does.

Each caller carries a copy of the ``python_backend`` runtime beside its model.py and calls
``python_backend.bls_wake.install`` from its ``initialize``: what the wrapper of a Triton model folder does once
that package kind lands (the triton-folders work); until then these folders are written straight into Triton's
repository and loaded there, unpublished.

Callers (``mode``):
- ``sync`` / ``async``: inputs ``x`` (FP32 [-1]), ``target`` (BYTES [1], the callee's name) and the optional
  ``timeout_us`` (INT64 [1], the BLS request's own timeout); calls ``exec()`` / ``await async_exec()`` with ``x``
  as one batch row, answers the callee's ``y`` flattened, or the callee's error unchanged;
- ``stream`` / ``stream-async``: decoupled; the same inputs, calls ``exec(decoupled=True)`` / ``await
  async_exec(decoupled=True)`` on a decoupled callee (``x`` as is) and sends each of its ``y`` on, then the final flag.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import python_backend

CALLER_PY = """
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from python_backend import bls_wake  # noqa: E402

MODE = {mode!r}


def _call(request, rows):
    x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
    target = pb_utils.get_input_tensor_by_name(request, "target").as_numpy().reshape(-1)[0].decode()
    timeout = pb_utils.get_input_tensor_by_name(request, "timeout_us")
    micros = int(timeout.as_numpy().reshape(-1)[0]) if timeout is not None else 0
    return pb_utils.InferenceRequest(
        model_name=target,
        inputs=[pb_utils.Tensor("x", x.reshape(1, -1) if rows else x)],
        requested_output_names=["y"],
        timeout=micros,
    )


def _answer(response):
    if response.has_error():
        return pb_utils.InferenceResponse(error=response.error())
    y = pb_utils.get_output_tensor_by_name(response, "y").as_numpy()
    return pb_utils.InferenceResponse([pb_utils.Tensor("y", y.reshape(-1).astype(np.float32))])


def _relay(responses, sender):
    for response in responses:
        if response.has_error():
            sender.send(pb_utils.InferenceResponse(error=response.error()))
            break
        y = pb_utils.get_output_tensor_by_name(response, "y")
        if y is not None:  # the stream's final flag comes as a response without outputs
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("y", y.as_numpy().astype(np.float32))]))
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class TritonPythonModel:
    def initialize(self, args):
        bls_wake.install(args["model_name"])

    if MODE == "sync":

        def execute(self, requests):
            return [_answer(_call(r, rows=True).exec()) for r in requests]

    elif MODE == "async":

        async def execute(self, requests):
            return [_answer(await _call(r, rows=True).async_exec()) for r in requests]

    elif MODE == "stream":

        def execute(self, requests):
            for r in requests:
                _relay(_call(r, rows=False).exec(decoupled=True), r.get_response_sender())
            return None

    else:

        async def execute(self, requests):
            for r in requests:
                _relay(await _call(r, rows=False).async_exec(decoupled=True), r.get_response_sender())
            return None
"""

MODES = ("sync", "async", "stream", "stream-async")


def caller_config(name: str, mode: str) -> str:
    decoupled = "model_transaction_policy { decoupled: true }" if mode.startswith("stream") else ""
    return textwrap.dedent(
        f"""\
        name: "{name}"
        backend: "python"
        max_batch_size: 0
        {decoupled}
        input [
          {{ name: "x", data_type: TYPE_FP32, dims: [-1] }},
          {{ name: "target", data_type: TYPE_STRING, dims: [1] }},
          {{ name: "timeout_us", data_type: TYPE_INT64, dims: [1], optional: true }}
        ]
        output [{{ name: "y", data_type: TYPE_FP32, dims: [-1] }}]
        instance_group [{{ kind: KIND_CPU, count: 1 }}]
        """
    )


def write_caller(repo: Path, name: str, mode: str) -> Path:
    """A BLS caller folder ``repo/name`` (replacing one left by an earlier run of the module)."""
    assert mode in MODES, mode
    folder = repo / name
    shutil.rmtree(folder, ignore_errors=True)
    version = folder / "1"
    (version / "python_backend").mkdir(parents=True)
    for src in python_backend.runtime_files():
        shutil.copy(src, version / "python_backend")
    (folder / "config.pbtxt").write_text(caller_config(name, mode))
    (version / "model.py").write_text(CALLER_PY.format(mode=mode))
    return folder


SLOW_LOADER_PY = """
import time

import numpy as np


class Model:
    def __init__(self, load_secs=0.0):
        self.load_secs = load_secs

    def load(self, model_dir, device):
        time.sleep(self.load_secs)

    def predict(self, inputs):
        return {"y": (inputs["x"] + 1).astype(np.float32)}
"""
