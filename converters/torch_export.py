"""torch -> ONNX with a dynamic batch axis, checked and matched against the package signature.

The export hook a package offers (the contract for package authors; docs/ does not describe it yet):

* on the model class: `Model.export_module(self)`, called after `Model(**params).load(model_dir, "cpu")`;
* or at module level in `snooze_model.py`: `export_module()` or `export_module(model_dir)`.

It returns `(module, example_inputs)`: a `torch.nn.Module` and a dict input name -> example batch
(numpy array or torch tensor, batch axis first). Input names are the dict keys; when they are the
names of `forward`'s parameters, the inputs are passed in `forward`'s order, otherwise in the dict's.

torch is imported inside the functions: importing this module does not import torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import io
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from converters.errors import ExportError
from converters.onnx_inspect import OnnxSignature, inspect_onnx
from converters.signature import PackageSignature

DEFAULT_OPSET = 18
# Protobuf cannot serialise a message of 2 GiB or more: above this the weights stay external.
INLINE_LIMIT_BYTES = 2**31 - 1

Progress = Callable[[str], None]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Exporter(StrEnum):
    DYNAMO = "dynamo"
    TORCHSCRIPT = "torchscript"


@dataclass(frozen=True)
class ExportResult:
    onnx_path: Path
    exporter: Exporter
    export_secs: float
    signature: OnnxSignature
    dynamo_error: str | None
    """Why the dynamo exporter failed when the TorchScript one was used; None otherwise."""


@dataclass(frozen=True)
class ExportHook:
    """What a package's export hook produced, plus the loaded model instance (if the package has one)."""

    module: Any  # torch.nn.Module
    example_inputs: dict[str, np.ndarray]
    model: Any | None
    """The package's `Model` instance, loaded on CPU; None when the package has no model class."""


def load_export_hook(
    package_dir: str | os.PathLike[str],
    entrypoint: str = "snooze_model.py",
    class_name: str = "Model",
    params: Mapping[str, Any] | None = None,
) -> ExportHook:
    """Import the package's entry file and call its export hook (see the module docstring)."""
    package_dir = Path(package_dir).resolve()
    entry = package_dir / entrypoint
    if not entry.is_file():
        raise ExportError(f"{entry}: entry file not found; a torch export needs the package's {entrypoint}")
    user_module = _import_entry(entry)
    cls = getattr(user_module, class_name, None)
    model = None
    if cls is not None:
        try:
            model = cls(**dict(params or {}))
            model.load(str(package_dir), "cpu")
        except Exception as exc:
            raise ExportError(f"{entry}: {class_name}(**params).load(model_dir, 'cpu') failed: {exc!r}") from exc

    hook_args: tuple[str, ...]
    if model is not None and callable(getattr(model, "export_module", None)):
        hook, hook_args, where = model.export_module, (), f"{class_name}.export_module()"
    elif callable(getattr(user_module, "export_module", None)):
        hook = user_module.export_module
        takes_dir = len(inspect.signature(hook).parameters) > 0
        hook_args = (str(package_dir),) if takes_dir else ()
        where = "export_module(model_dir)" if takes_dir else "export_module()"
    else:
        raise ExportError(
            f"{entry}: no export hook; define {class_name}.export_module(self) or a module-level "
            "export_module() returning (torch.nn.Module, {input_name: example_batch})"
        )
    try:
        returned = hook(*hook_args)
    except Exception as exc:
        raise ExportError(f"{entry}: {where} raised {exc!r}") from exc
    module, examples = _check_hook_result(returned, entry, where)
    return ExportHook(module=module, example_inputs=examples, model=model)


def _import_entry(entry: Path) -> Any:
    name = f"_snooze_convert_{abs(hash(str(entry)))}"
    spec = importlib.util.spec_from_file_location(name, entry)
    if spec is None or spec.loader is None:
        raise ExportError(f"{entry}: cannot be imported as a Python module")
    user_module = importlib.util.module_from_spec(spec)
    sys.modules[name] = user_module
    sys.path.insert(0, str(entry.parent))  # package-local imports
    try:
        spec.loader.exec_module(user_module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise ExportError(f"{entry}: importing it failed: {exc!r}") from exc
    finally:
        sys.path.remove(str(entry.parent))
    return user_module


def _check_hook_result(returned: Any, entry: Path, where: str) -> tuple[Any, dict[str, np.ndarray]]:
    import torch

    if not (isinstance(returned, tuple) and len(returned) == 2):
        raise ExportError(f"{entry}: {where} must return (torch.nn.Module, dict of example inputs)")
    module, examples = returned
    if not isinstance(module, torch.nn.Module):
        raise ExportError(f"{entry}: {where} returned {type(module).__name__}, not a torch.nn.Module")
    if not isinstance(examples, Mapping) or not examples:
        raise ExportError(f"{entry}: {where} must return a non-empty dict of example inputs by name")
    return module, {name: _to_numpy(value) for name, value in examples.items()}


def _to_numpy(value: Any) -> np.ndarray:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def load_torchscript(path: str | os.PathLike[str]) -> Any:
    """Load a TorchScript file (torch.jit.save) on CPU in eval mode."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path}: TorchScript file not found")
    try:
        module = torch.jit.load(str(path), map_location="cpu")
    except Exception as exc:
        raise ExportError(f"{path}: cannot be loaded with torch.jit.load: {exc}") from exc
    return module.eval()


def ordered_input_names(module: Any, names: Sequence[str]) -> list[str]:
    """The order inputs are passed to `forward`: forward's parameter order when every name is one of
    its parameters, otherwise the given order."""
    try:
        params = [p for p in inspect.signature(module.forward).parameters if p != "self"]
    except (TypeError, ValueError):  # a TorchScript method may have no Python signature
        return list(names)
    if set(names) <= set(params):
        return [p for p in params if p in names]
    return list(names)


def flatten_outputs(outputs: Any, output_names: Sequence[str]) -> dict[str, Any]:
    """Map a module's return value (tensor, tuple/list, or dict) onto the declared output names.

    A dict's keys must be the declared names (any order); a tensor or sequence is named positionally."""
    if isinstance(outputs, Mapping):
        if set(outputs) != set(output_names):
            raise ExportError(
                f"the module returns outputs {sorted(outputs)} but the signature declares {list(output_names)}"
            )
        return dict(outputs)  # the module's own key order: the order the exporters flatten a dict in
    values = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    if len(values) != len(output_names):
        raise ExportError(
            f"the module returns {len(values)} output(s) but the signature declares "
            f"{len(output_names)}: {list(output_names)}"
        )
    return dict(zip(output_names, values, strict=True))


class TorchRunner:
    """Calls a torch module on numpy inputs by name and returns numpy outputs by name (parity reference)."""

    def __init__(self, module: Any, input_names: Sequence[str], output_names: Sequence[str]) -> None:
        self.module = module.eval()
        self.input_order = ordered_input_names(module, input_names)
        self.output_names = list(output_names)

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        args = [torch.from_numpy(np.ascontiguousarray(inputs[name])) for name in self.input_order]
        with torch.no_grad():
            outputs = self.module(*args)
        return {
            name: value.detach().cpu().numpy() for name, value in flatten_outputs(outputs, self.output_names).items()
        }


def export_module_to_onnx(
    module: Any,
    example_inputs: Mapping[str, Any],
    onnx_path: str | os.PathLike[str],
    output_names: Sequence[str],
    *,
    expected: PackageSignature | None = None,
    opset: int = DEFAULT_OPSET,
    exporters: Sequence[Exporter] = (Exporter.DYNAMO, Exporter.TORCHSCRIPT),
    progress: Progress | None = None,
    inline_limit_bytes: int = INLINE_LIMIT_BYTES,
) -> ExportResult:
    """Export `module` to `onnx_path` with a dynamic batch axis on every input and output.

    Tries each exporter in `exporters` in order (dynamo, then the TorchScript-based one). The result
    passes onnx.checker and shape inference; weights are inlined unless they reach `inline_limit_bytes`
    (2 GiB, protobuf's limit), in which case `<onnx_path>.data` is written next to it. With `expected`,
    input/output names, dtypes and dims must match. Nothing is written at `onnx_path` unless everything
    succeeds; the ExportError then gives each exporter's reason.
    """
    import torch

    onnx_path = Path(onnx_path)
    notify = progress or (lambda _stage: None)
    module = module.eval()
    examples = _batched_examples(example_inputs)
    input_names = ordered_input_names(module, list(examples))
    args = tuple(torch.from_numpy(np.ascontiguousarray(examples[name])) for name in input_names)
    with torch.no_grad():
        try:
            reference = module(*args)
        except Exception as exc:
            raise ExportError(f"the module fails on its example inputs: {exc!r}") from exc
    output_names = list(flatten_outputs(reference, output_names))

    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    errors: dict[Exporter, str] = {}
    started = time.perf_counter()  # export time includes exporters that failed before the one that worked
    for exporter in exporters:
        if errors:  # say why the previous exporter is left, in the words its start was announced with
            failed, reason = next(reversed(errors.items()))
            notify(f"the {failed.value} exporter failed ({_shorten(reason)}): trying the {exporter.value} exporter")
        notify(f"exporting to ONNX ({exporter.value} exporter, opset {opset})")
        with tempfile.TemporaryDirectory(dir=onnx_path.parent, prefix=".export-") as stage_dir:
            staged = Path(stage_dir) / "export" / onnx_path.name
            staged.parent.mkdir()
            try:
                _run_exporter(exporter, module, args, staged, input_names, output_names, opset)
            except Exception as exc:
                errors[exporter] = _one_line(exc)
                continue
            notify("checking the ONNX model (onnx.checker, shape inference, signature)")
            final = Path(stage_dir) / onnx_path.name
            try:
                _finalise(staged, final, inline_limit_bytes)
                signature = _check_signature(final, input_names, output_names, expected, opset)
            except ExportError as exc:
                errors[exporter] = str(exc)
                continue
            _move_into_place(final, onnx_path)
            export_secs = time.perf_counter() - started
        return ExportResult(
            onnx_path=onnx_path,
            exporter=exporter,
            export_secs=export_secs,
            signature=dataclasses.replace(signature, path=onnx_path),
            dynamo_error=errors.get(Exporter.DYNAMO),
        )
    reasons = "; ".join(f"{e.value}: {msg}" for e, msg in errors.items())
    raise ExportError(f"{onnx_path}: every exporter failed ({reasons})")


def _shorten(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _batched_examples(example_inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Numpy examples sharing one batch size of at least 2 (torch.export specialises a size-1 axis)."""
    examples = {name: _to_numpy(value) for name, value in example_inputs.items()}
    if not examples:
        raise ExportError("no example inputs: the exporter needs one example batch per input")
    sizes = {name: (a.shape[0] if a.ndim else None) for name, a in examples.items()}
    if None in sizes.values() or len(set(sizes.values())) != 1:
        raise ExportError(
            f"example inputs must share one batch size on their first axis; got shapes "
            f"{ {name: list(a.shape) for name, a in examples.items()} }"
        )
    if next(iter(sizes.values())) == 1:
        examples = {name: np.concatenate([a, a]) for name, a in examples.items()}
    return examples


def _run_exporter(
    exporter: Exporter,
    module: Any,
    args: tuple[Any, ...],
    path: Path,
    input_names: list[str],
    output_names: list[str],
    opset: int,
) -> None:
    import torch

    # The dynamo exporter prints its stages and writes warnings; the caller's progress callback reports.
    with contextlib.redirect_stdout(io.StringIO()):
        if exporter is Exporter.DYNAMO:
            batch = torch.export.Dim("batch")
            torch.onnx.export(
                module,
                args,
                str(path),
                dynamo=True,
                verbose=False,
                opset_version=opset,
                input_names=input_names,
                output_names=output_names,
                dynamic_shapes=tuple({0: batch} for _ in args),
                external_data=True,
            )
        else:
            axes = {name: {0: "batch"} for name in (*input_names, *output_names)}
            torch.onnx.export(
                module,
                args,
                str(path),
                dynamo=False,
                opset_version=opset,
                input_names=input_names,
                output_names=output_names,
                dynamic_axes=axes,
            )


def _finalise(staged: Path, final: Path, inline_limit_bytes: int) -> None:
    """Write the checked, shape-inferred model at `final`: weights inlined when under the limit, else in
    `<final name>.data` next to it."""
    try:
        model = onnx.load(str(staged))  # reads any external data the exporter wrote
        if model.ByteSize() < inline_limit_bytes:
            model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
            onnx.checker.check_model(model, full_check=True)
            onnx.save(model, str(final))
        else:
            onnx.save(
                model,
                str(final),
                save_as_external_data=True,
                all_tensors_to_one_file=True,
                location=final.name + ".data",
                size_threshold=0,
            )
            onnx.shape_inference.infer_shapes_path(str(final), str(final), strict_mode=True)
            onnx.checker.check_model(str(final), full_check=True)
    except Exception as exc:
        raise ExportError(f"the exported model fails onnx.checker / shape inference: {_one_line(exc)}") from exc


def _move_into_place(final: Path, onnx_path: Path) -> None:
    """Move the model (and its data file, if any) to `onnx_path`; a stale data file there is removed."""
    data_name = onnx_path.name + ".data"
    source_data, target_data = final.with_name(data_name), onnx_path.with_name(data_name)
    if source_data.exists():
        os.replace(source_data, target_data)
    else:
        target_data.unlink(missing_ok=True)
    os.replace(final, onnx_path)


def _check_signature(
    final: Path,
    input_names: list[str],
    output_names: list[str],
    expected: PackageSignature | None,
    opset: int,
) -> OnnxSignature:
    signature = inspect_onnx(final)
    problems = []
    if signature.opset != opset:
        problems.append(f"the model has opset {signature.opset}, not the requested {opset}")
    got_in, got_out = [t.name for t in signature.inputs], [t.name for t in signature.outputs]
    if sorted(got_in) != sorted(input_names):
        problems.append(f"inputs are {got_in}, expected {input_names} (an input the module ignores is dropped)")
    if got_out != output_names:
        problems.append(f"outputs are {got_out}, expected {output_names}")
    if expected is not None:
        problems += _compare_with_declared(signature, expected)
    if not signature.batch_dynamic:
        fixed = [t.name for t in (*signature.inputs, *signature.outputs) if not t.batch_dynamic]
        problems.append(
            f"the batch axis is not dynamic on {fixed}: the module probably fixes the batch size "
            "internally (e.g. a reshape/view with a constant first dimension: use -1 or x.shape[0])"
        )
    if problems:
        raise ExportError("exported model does not match the package: " + "; ".join(problems))
    return signature


def _compare_with_declared(signature: OnnxSignature, expected: PackageSignature) -> list[str]:
    problems = []
    for kind, declared, got in (
        ("input", expected.inputs, signature.inputs),
        ("output", expected.outputs, signature.outputs),
    ):
        by_name = {t.name: t for t in got}
        for decl in declared:
            actual = by_name.get(decl.name)
            if actual is None:
                problems.append(f"declared {kind} '{decl.name}' is missing from the export")
                continue
            if actual.dtype != decl.dtype:
                problems.append(
                    f"{kind} '{decl.name}' is {actual.dtype} in the export but declared {decl.dtype}"
                    + (" (cast it in forward)" if kind == "output" else "")
                )
            if decl.dims is not None and not _dims_compatible(actual.dims_without_batch, list(decl.dims)):
                problems.append(
                    f"{kind} '{decl.name}' has dims {actual.dims_without_batch} (without batch) in the export "
                    f"but declared {list(decl.dims)}"
                )
        extra = sorted(set(by_name) - {t.name for t in declared})
        if extra:
            problems.append(f"the export has undeclared {kind}s {extra}")
    return problems


def _dims_compatible(actual: list[int], declared: list[int]) -> bool:
    return len(actual) == len(declared) and all(a == d or -1 in (a, d) for a, d in zip(actual, declared, strict=True))


def _one_line(exc: BaseException) -> str:
    """The exception's first line plus that of its root cause (the exporters wrap the useful error)."""

    def first_line(e: BaseException) -> str:
        lines = _ANSI.sub("", str(e)).strip().splitlines()
        return f"{type(e).__name__}: {lines[0] if lines else ''}".strip()[:300]

    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    text = first_line(exc)
    return text if root is exc else f"{text} <- {first_line(root)}"


def export_torchscript_to_onnx(
    torchscript_path: str | os.PathLike[str],
    example_inputs: Mapping[str, Any],
    onnx_path: str | os.PathLike[str],
    output_names: Sequence[str],
    *,
    expected: PackageSignature | None = None,
    opset: int = DEFAULT_OPSET,
    progress: Progress | None = None,
) -> ExportResult:
    """Export a TorchScript file. Its inputs are passed positionally in `example_inputs`' order."""
    module = load_torchscript(torchscript_path)
    return export_module_to_onnx(
        module, example_inputs, onnx_path, output_names, expected=expected, opset=opset, progress=progress
    )


__all__ = [
    "DEFAULT_OPSET",
    "ExportHook",
    "ExportResult",
    "Exporter",
    "TorchRunner",
    "export_module_to_onnx",
    "export_torchscript_to_onnx",
    "flatten_outputs",
    "load_export_hook",
    "load_torchscript",
    "ordered_input_names",
]
