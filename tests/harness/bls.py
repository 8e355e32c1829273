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

import json
import shutil
import textwrap
from pathlib import Path

import python_backend

CALLER_PY = """
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

MODE = {mode!r}
INSTALL = {install!r}


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
        if INSTALL:  # what the wrapper of a published Triton model folder does for it
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from python_backend import bls_wake

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


def write_caller(repo: Path, name: str, mode: str, *, install: bool = True) -> Path:
    """A BLS caller folder ``repo/name`` (replacing one left by an earlier run of the module). ``install``: it
    carries the runtime and installs the wake itself; without, it is the folder as a Triton user has it."""
    assert mode in MODES, mode
    folder = repo / name
    shutil.rmtree(folder, ignore_errors=True)
    version = folder / "1"
    version.mkdir(parents=True)
    if install:
        (version / "python_backend").mkdir()
        for src in python_backend.runtime_files():
            shutil.copy(src, version / "python_backend")
    (folder / "config.pbtxt").write_text(caller_config(name, mode))
    (version / "model.py").write_text(CALLER_PY.format(mode=mode, install=install))
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


# A stand-in for the triton-folders wrapper, until that lands: a snoozeml package whose code runs in its
# python-backend stub (worker "in-stub") calls ``bls_wake.install`` from its load (inside the stub's initialize, as
# the wrapper will) and makes its BLS call from predict (inside execute). serve publishes it, so the serve-level
# tests run every topology with a published caller today; Triton folders then replace it.
STANDIN_CALLER_PY = """
import sys

import numpy as np


class Model:
    def __init__(self, caller_id="", stream=False):
        self.caller_id, self.stream = caller_id, stream

    def load(self, model_dir, device):
        from python_backend import bls_wake  # the runtime every rendered python model carries

        bls_wake.install(self.caller_id)

    def _call(self, inputs):
        pb_utils = sys.modules["triton_python_backend_utils"]  # the stub this runs in imported it before the model

        target = inputs["target"].reshape(-1)[0]
        target = target.decode() if isinstance(target, bytes) else str(target)
        x = np.asarray(inputs["x"], dtype=np.float32)
        return pb_utils, pb_utils.InferenceRequest(
            model_name=target,
            inputs=[pb_utils.Tensor("x", x if self.stream else x.reshape(1, -1))],
            requested_output_names=["y"],
        )

    def predict(self, inputs):
        pb_utils, request = self._call(inputs)
        if not self.stream:
            response = request.exec()
            if response.has_error():
                raise RuntimeError(response.error().message())
            return {"y": pb_utils.get_output_tensor_by_name(response, "y").as_numpy().reshape(-1)}
        return self._relay(pb_utils, request)

    def _relay(self, pb_utils, request):
        for response in request.exec(decoupled=True):
            if response.has_error():
                raise RuntimeError(response.error().message())
            y = pb_utils.get_output_tensor_by_name(response, "y")
            if y is not None:
                yield {"y": y.as_numpy()}
"""


def write_standin_caller(folder: Path, *, stream: bool) -> Path:
    """The stand-in caller package (x FP32 [2], target BYTES [1] -> y FP32 [2]; decoupled with ``stream``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "snooze_model.py").write_text(STANDIN_CALLER_PY)
    manifest = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "dims": [2]},
            {"name": "target", "datatype": "BYTES", "dims": [1]},
        ],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
        "params_schema": {"caller_id": {"type": "str", "default": ""}, "stream": {"type": "bool", "default": False}},
        "decoupled": stream,
        "warmup": False,  # its predict calls another model
    }
    (folder / "snooze_model.json").write_text(json.dumps(manifest))
    return folder
