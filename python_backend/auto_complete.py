"""Run a Triton python model's ``auto_complete_config`` once, outside Triton, at publish.

snoozeml's Triton runs with auto-complete off (an extra stub per load), so a model that completes its config
in ``auto_complete_config`` has it run here instead, in a child process of the control plane
(``controlplane/auto_complete.py``): the user's module is imported as the stub imports it (``<version>.model``,
its version and model folders on ``sys.path``), with a stand-in ``triton_python_backend_utils`` whose
``ModelConfig`` has the API the stub's has (``as_dict``, ``set_max_batch_size``, ``set_dynamic_batching``,
``add_input``, ``add_output``, ``set_model_transaction_policy``). The completed config is written as JSON.

Usage: ``python -m python_backend.auto_complete JOB.json`` with ``{"entry", "model_dir", "version", "config",
"result"}``. Exit status 0: done; 1: the model failed (its traceback on stderr). Not part of the runtime that
travels with models (Python 3.10 syntax all the same: the control plane's interpreter may be any).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
import types
from typing import Any

import numpy as np

STANDIN_NAME = "triton_python_backend_utils"
# Triton's TYPE_* names and their numpy types, as the stub's module maps them.
_NUMPY_BY_TRITON: dict[str, Any] = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}

# model_config.proto's DataType numbers of the TYPE_* names above.
_ENUM = {
    "TYPE_BOOL": 1,
    "TYPE_UINT8": 2,
    "TYPE_UINT16": 3,
    "TYPE_UINT32": 4,
    "TYPE_UINT64": 5,
    "TYPE_INT8": 6,
    "TYPE_INT16": 7,
    "TYPE_INT32": 8,
    "TYPE_INT64": 9,
    "TYPE_FP16": 10,
    "TYPE_FP32": 11,
    "TYPE_FP64": 12,
    "TYPE_STRING": 13,
}


class AutoCompleteError(ValueError):
    """What the stub's ModelConfig raises for a change it refuses (ValueError, as there)."""


class ModelConfig:
    """The config ``auto_complete_config`` receives and returns: ``max_batch_size``, tensors, dynamic batching and
    the transaction policy may be set; a conflict with what the config already says raises ValueError."""

    def __init__(self, model_config: str) -> None:
        self._model_config: dict[str, Any] = json.loads(model_config)
        self._model_config.setdefault("input", [])
        self._model_config.setdefault("output", [])
        self._model_config.setdefault("max_batch_size", 0)

    @property
    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def as_dict(self) -> dict[str, Any]:
        return self._model_config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        configured = int(self._model_config.get("max_batch_size") or 0)
        if configured > max_batch_size:
            raise AutoCompleteError(
                f"model '{self._name}': config.pbtxt sets max_batch_size {configured}, above the {max_batch_size} "
                "auto_complete_config sets"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise AutoCompleteError(
                    f"model '{self._name}': the config schedules with '{other}'; auto_complete_config sets "
                    "dynamic_batching"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict[str, Any]) -> None:  # noqa: A002 - the stub's parameter name
        self._add("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: dict[str, Any]) -> None:
        self._add("output", output, ("name", "data_type", "dims"))

    def _add(self, which: str, tensor: dict[str, Any], allowed: tuple[str, ...]) -> None:
        extra = sorted(set(tensor) - set(allowed))
        if extra:
            raise AutoCompleteError(
                f"model '{self._name}': {which} {tensor.get('name')!r} has properties {extra}; allowed: {list(allowed)}"
            )
        for required in ("name", "data_type", "dims"):
            if required not in tensor:
                raise AutoCompleteError(f"model '{self._name}': an {which} lacks '{required}' ({tensor})")
        for current in self._model_config[which]:
            if current.get("name") != tensor["name"]:
                continue
            kind = current.get("data_type", "TYPE_INVALID")
            if kind != "TYPE_INVALID" and kind != tensor["data_type"]:
                raise AutoCompleteError(
                    f"model '{self._name}': {which} '{tensor['name']}' is {kind} in config.pbtxt, "
                    f"{tensor['data_type']} in auto_complete_config"
                )
            if current.get("dims") and list(current["dims"]) != list(tensor["dims"]):
                raise AutoCompleteError(
                    f"model '{self._name}': {which} '{tensor['name']}' has dims {current['dims']} in config.pbtxt, "
                    f"{tensor['dims']} in auto_complete_config"
                )
            if which == "input" and "optional" in current and "optional" in tensor:
                if current["optional"] != tensor["optional"]:
                    raise AutoCompleteError(
                        f"model '{self._name}': input '{tensor['name']}' is optional={current['optional']} in "
                        f"config.pbtxt, optional={tensor['optional']} in auto_complete_config"
                    )
            current.update(tensor)
            return
        self._model_config[which].append(dict(tensor))

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        extra = sorted(set(transaction_policy_dict) - {"decoupled"})
        if extra:
            raise AutoCompleteError(f"model '{self._name}': transaction policy properties {extra}; allowed: decoupled")
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = transaction_policy_dict["decoupled"]
            if "decoupled" in policy and policy["decoupled"] != wanted:
                raise AutoCompleteError(
                    f"model '{self._name}': config.pbtxt sets decoupled {policy['decoupled']}, "
                    f"auto_complete_config {wanted}"
                )
            policy["decoupled"] = wanted


class _Unavailable:
    """A name of the stub's module that has no meaning outside a running Triton: using it says so."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"pb_utils.{self._name} is not available while snoozeml runs auto_complete_config at publish (outside "
            "Triton); use it in initialize or execute"
        )

    def __getattr__(self, attr: str) -> Any:
        return _Unavailable(f"{self._name}.{attr}")


class _Logger:
    """pb_utils.Logger: its messages go to stderr here (the publish shows them when auto-complete fails)."""

    @staticmethod
    def log(message: str, level: Any = None) -> None:
        print(message, file=sys.stderr)

    log_info = log_warn = log_error = log_verbose = log


def _config_by_name(model_config: dict[str, Any], which: str, name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get(which, []) if t.get("name") == name), None)


def standin_module(model_dir: str) -> types.ModuleType:
    """``triton_python_backend_utils`` as far as it means anything before the model is loaded."""
    module = types.ModuleType(STANDIN_NAME, "snoozeml's stand-in for auto_complete_config at publish")

    class TritonError(Exception):
        UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

        def __init__(self, message: str = "", code: int = 1) -> None:
            super().__init__(message)
            self._message, self._code = message, code

        def message(self) -> str:
            return self._message

        def code(self) -> int:
            return self._code

    class TritonModelException(Exception):
        pass

    def triton_string_to_numpy(name: str) -> Any:
        return _NUMPY_BY_TRITON[name]

    def numpy_to_triton_type(data_type: Any) -> int | None:
        for name, np_type in _NUMPY_BY_TRITON.items():
            if data_type == np_type:
                return _ENUM[name]
        return _ENUM["TYPE_STRING"] if data_type == np.bytes_ else None

    def triton_to_numpy_type(data_type: int) -> Any:
        for name, number in _ENUM.items():
            if number == data_type:
                return _NUMPY_BY_TRITON[name]
        return None

    names: dict[str, Any] = {
        "ModelConfig": ModelConfig,
        "TritonError": TritonError,
        "TritonModelException": TritonModelException,
        "Logger": _Logger,
        "triton_string_to_numpy": triton_string_to_numpy,
        "numpy_to_triton_type": numpy_to_triton_type,
        "triton_to_numpy_type": triton_to_numpy_type,
        "get_input_config_by_name": lambda config, name: _config_by_name(config, "input", name),
        "get_output_config_by_name": lambda config, name: _config_by_name(config, "output", name),
        "using_decoupled_model_transaction_policy": lambda config: bool(
            config.get("model_transaction_policy", {}).get("decoupled")
        ),
        "get_model_dir": lambda: model_dir,
        "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START": 1,
        "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END": 2,
        "TRITONSERVER_RESPONSE_COMPLETE_FINAL": 1,
        "TRITONSERVER_REQUEST_RELEASE_ALL": 1,
        "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE": 2,
    }
    vars(module).update(names)

    def missing(name: str) -> Any:
        # Tensor, InferenceResponse, MetricFamily, ...: defined in the stub; usable once the model runs there.
        if name.startswith("__"):  # what importers look up on any module (__file__, __path__)
            raise AttributeError(name)
        return _Unavailable(name)

    vars(module)["__getattr__"] = missing
    return module


def complete(job: dict[str, Any]) -> dict[str, Any]:
    """Import the model as the stub does and return what its ``auto_complete_config`` made of ``job['config']``."""
    entry, model_dir, version = job["entry"], job["model_dir"], str(job["version"])
    sys.modules[STANDIN_NAME] = standin_module(model_dir)
    sys.path.append(os.path.dirname(entry))
    sys.path.append(model_dir)
    stem = os.path.splitext(os.path.basename(entry))[0]
    module = importlib.import_module(f"{version}.{stem}")
    cls = getattr(module, "TritonPythonModel", None)
    if cls is None:
        raise AutoCompleteError(f"{entry} defines no class TritonPythonModel")
    config = ModelConfig(json.dumps(job["config"]))
    result = cls.auto_complete_config(config)
    if not isinstance(result, ModelConfig):
        raise AutoCompleteError(
            f"auto_complete_config returned {type(result).__name__}, not the pb_utils.ModelConfig it was given"
        )
    return result.as_dict()


def main(argv: list[str]) -> int:
    with open(argv[1], encoding="utf-8") as f:
        job = json.load(f)
    try:
        completed = complete(job)
    except BaseException as exc:  # the user's code: any failure is reported, with its traceback
        # The model's frames only: this module's and importlib's say nothing to its author.
        here = os.path.abspath(__file__)
        frames = [
            f
            for f in traceback.extract_tb(exc.__traceback__)
            if os.path.abspath(f.filename) != here and "importlib" not in f.filename
        ]
        print("Traceback (most recent call last):", file=sys.stderr)
        print("".join(traceback.format_list(frames)), end="", file=sys.stderr)
        print("".join(traceback.format_exception_only(type(exc), exc)), end="", file=sys.stderr)
        return 1
    with open(job["result"], "w", encoding="utf-8") as f:
        json.dump(completed, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
