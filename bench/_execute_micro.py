"""`execute()` of the two models of bench/runtime_cost.py called in-process, with stand-ins for the stub's
`triton_python_backend_utils` objects: the runtime's own Python cost per execute, without Triton, gRPC
or the machine's scheduling noise (best of short rounds), and what enforcing request_timeout_secs costs
(the same rendering without a limit has no watchdog).

    python -m bench._execute_micro REPO RUNTIME HANDWRITTEN RUNTIME_NO_LIMIT   # prints one JSON line
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
import types
from typing import Any

import numpy as np


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceResponse:
    def __init__(self, output_tensors: list | None = None, error: Any = None) -> None:
        self.output_tensors, self.error = output_tensors, error


class TritonError:
    INVALID_ARG, INTERNAL = 3, 13

    def __init__(self, message: str, code: int | None = None) -> None:
        self.message, self.code = message, code


class Request:
    def __init__(self, x: np.ndarray, request_id: str) -> None:
        self._inputs = [Tensor("x", x)]
        self._parameters = json.dumps({"x-request-id": request_id}, separators=(",", ":"))

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def parameters(self) -> str:
        return self._parameters


def get_input_tensor_by_name(request: Request, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def install_stand_in() -> None:
    pb = types.ModuleType("triton_python_backend_utils")
    vars(pb).update(
        Tensor=Tensor,
        InferenceResponse=InferenceResponse,
        TritonError=TritonError,
        get_input_tensor_by_name=get_input_tensor_by_name,
    )
    sys.modules["triton_python_backend_utils"] = pb


def load_model(repo: str, name: str) -> Any:
    path = os.path.join(repo, name, "1", "model.py")
    spec = importlib.util.spec_from_file_location(f"bench_model_{name.replace('-', '_')}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize(
        {
            "model_repository": os.path.join(repo, name),
            "model_version": "1",
            "model_name": name,
            "model_instance_name": f"{name}_0",
            "model_instance_kind": "CPU",
            "model_instance_device_id": "0",
        }
    )
    return model


def best_us(fn: Any, arg: Any, calls: int, rounds: int = 15) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn(arg)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main(repo: str, runtime_name: str, handwritten_name: str, no_limit_name: str) -> dict[str, Any]:
    install_stand_in()
    stdout = sys.stdout
    with tempfile.TemporaryDirectory() as journal_dir:
        os.environ["SNOOZE_JOURNAL_DIR"] = journal_dir  # journaled, as under the embedded Triton
        runtime = load_model(repo, runtime_name)
        no_limit = load_model(repo, no_limit_name)
        sys.stdout = stdout  # the runtime points stdout at stderr for user prints
        handwritten = load_model(repo, handwritten_name)
        try:
            out: dict[str, Any] = {}
            for batch in (1, 32):
                requests = [Request(np.ones((1, 4), np.float32), f"bench-{i:04d}") for i in range(batch)]
                calls = max(50, 2000 // batch)
                hand_us = best_us(handwritten.execute, requests, calls)
                runtime_us = best_us(runtime.execute, requests, calls)
                no_limit_us = best_us(no_limit.execute, requests, calls)
                out[f"batch_{batch}"] = {
                    "handwritten_us": round(hand_us, 2),
                    "runtime_us": round(runtime_us, 2),
                    "runtime_no_limit_us": round(no_limit_us, 2),
                    "added_us_per_request": round((runtime_us - hand_us) / batch, 2),
                }
            out["watchdog_us"] = round(out["batch_1"]["runtime_us"] - out["batch_1"]["runtime_no_limit_us"], 2)
            return out
        finally:
            runtime.finalize()
            no_limit.finalize()


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:5])))
