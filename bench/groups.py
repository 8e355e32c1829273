"""Cold first response of an ensemble and of a BLS pipeline against their steps' own, same run.

A Triton repository written here (Triton model folders, no snoozeml code in them): two python steps
(``step_double``: x * 2, ``step_inc``: x + 1), an ensemble ``pipe`` of the two, and a python model ``bls``
that calls them through BLS (``pb_utils.InferenceRequest(...).exec()``, the callee named in the code). Per cycle,
in a rotating order, every model asleep first: one gRPC request through the gateway to

- ``step``: one step alone (the floor: one python-backend load);
- ``steps``: both steps, one after the other (what a client calling them itself would wait);
- ``pipe``: the ensemble (its steps woken first, then the ensemble);
- ``bls``: the BLS caller (its load, then each call wakes its sleeping callee from inside its execute).

Ratios are against ``steps``, measured in the same cycles.
"""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc.aio as grpcaio

from bench.common import API_KEY, gateway_urls, serving_stack, summary, wait_state

STEP_CONFIG = """
backend: "python"
max_batch_size: 8
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""
STEP_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", {expr})]))
        return out
"""
PIPE_CONFIG = """
platform: "ensemble"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "step_double" model_version: -1 input_map { key: "x" value: "x" } output_map { key: "y" value: "d" } },
  { model_name: "step_inc" model_version: -1 input_map { key: "x" value: "d" } output_map { key: "y" value: "y" } }
] }
"""
BLS_MODEL = """
import triton_python_backend_utils as pb_utils


def call(model, tensor):
    response = pb_utils.InferenceRequest(
        model_name=model, requested_output_names=["y"], inputs=[pb_utils.Tensor("x", tensor)]
    ).exec()
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())
    return pb_utils.get_output_tensor_by_name(response, "y").as_numpy()


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", call("step_inc", call("step_double", x)))]))
        return out
"""
STEPS = ("step_double", "step_inc")
MODELS = (*STEPS, "pipe", "bls")
TARGETS = ("step", "steps", "pipe", "bls")


def _folder(root: Path, name: str, files: dict[str, str]) -> Path:
    folder = root / name
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(textwrap.dedent(text).lstrip())
    (folder / "1").mkdir(parents=True, exist_ok=True)
    return folder


def write_repository(root: Path) -> list[dict[str, Any]]:
    _folder(root, "step_double", {"config.pbtxt": STEP_CONFIG.format(), "1/model.py": STEP_MODEL.format(expr="x * 2")})
    _folder(root, "step_inc", {"config.pbtxt": STEP_CONFIG.format(), "1/model.py": STEP_MODEL.format(expr="x + 1")})
    _folder(root, "pipe", {"config.pbtxt": PIPE_CONFIG})
    _folder(root, "bls", {"config.pbtxt": STEP_CONFIG.format(), "1/model.py": BLS_MODEL})
    return [{"id": m, "path": root / m} for m in MODELS]


async def _infer(client: grpcaio.InferenceServerClient, model: str, x: np.ndarray) -> np.ndarray:
    tensor = grpcaio.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = await client.infer(model, [tensor], headers={"authorization": f"Bearer {API_KEY}"}, client_timeout=120)
    return result.as_numpy("y")


async def _all_asleep(stack: Any) -> None:
    for model in ("pipe", "bls", *STEPS):  # callers first: an ensemble holds its steps
        await stack.lifecycle.unload(model)
    for model in MODELS:
        await wait_state(stack, model, "unloaded", 60)


async def run(root: Path, cycles: int = 10) -> dict[str, Any]:
    entries = write_repository(root / "repository")
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    times: dict[str, list[float]] = {t: [] for t in TARGETS}
    async with serving_stack(root, entries) as stack:
        client = grpcaio.InferenceServerClient(gateway_urls(stack)["grpc"])
        try:
            for cycle in range(cycles):
                for target in TARGETS[cycle % len(TARGETS) :] + TARGETS[: cycle % len(TARGETS)]:
                    await _all_asleep(stack)
                    start = time.perf_counter()
                    if target == "step":
                        got = await _infer(client, "step_double", x)
                        expected = x * 2
                    elif target == "steps":
                        got = await _infer(client, "step_inc", await _infer(client, "step_double", x))
                        expected = x * 2 + 1
                    else:
                        got = await _infer(client, target, x)
                        expected = x * 2 + 1
                    times[target].append(time.perf_counter() - start)
                    np.testing.assert_allclose(got, expected)  # a wrong answer ends the bench
        finally:
            await client.close()
    medians = {t: float(np.median(v)) for t, v in times.items()}
    return {
        "cycles": cycles,
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "cold_first_response": {t: summary(v) for t, v in times.items()},
        "ratio_to_steps": {t: round(medians[t] / medians["steps"], 2) for t in TARGETS},
    }
