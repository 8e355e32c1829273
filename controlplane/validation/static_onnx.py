"""`snoozectl validate`'s static checks of an ONNX graph: it loads, and its inputs and outputs agree with the
model's config (names, datatypes, dims). For onnxruntime models, and for ONNX packages the python backend runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controlplane.dtypes import from_triton
from controlplane.validation.model_folder import ModelFolder


def config_tensors(config: Any, kind: str) -> list[tuple[str, str, list[int]]]:
    items = config.input if kind == "input" else config.output
    from tritonclient.grpc import model_config_pb2

    return [(t.name, model_config_pb2.DataType.Name(t.data_type), list(t.dims)) for t in items]


def _dims_agree(model_dims: list[int], config_dims: list[int]) -> bool:
    """A fixed model axis must equal the config's; a dynamic (-1) model axis accepts anything.
    A scalar may be configured as [1] (Triton needs a shape)."""
    if not model_dims and config_dims in ([], [1]):
        return True
    return len(model_dims) == len(config_dims) and all(
        md == -1 or md == cd for md, cd in zip(model_dims, config_dims, strict=True)
    )


def check_onnx(m: ModelFolder, onnx_path: Path) -> None:
    from converters.errors import ConversionError
    from converters.onnx_inspect import inspect_onnx

    rel = m.rel(onnx_path)
    try:
        sig = inspect_onnx(onnx_path)
    except ConversionError as exc:
        text = str(exc)
        if "external-data" in text:
            m.rec.fail(
                "onnx_external_data",
                text,
                file=rel,
                fix="copy the external-data file next to the .onnx file, or re-save the model with "
                "its weights inlined, then re-render",
            )
        else:
            m.rec.fail("onnx_graph", text, file=rel, fix="re-export the ONNX model and re-render")
        return
    if sig.external_data:
        m.rec.ok("onnx_external_data", f"external data present: {', '.join(sig.external_data)}", rel)
    if m.batching and not sig.batch_dynamic:
        fixed = [t.name for t in (*sig.inputs, *sig.outputs) if not t.batch_dynamic]
        m.rec.fail(
            "onnx_batch_axis",
            f"max_batch_size is {m.config.max_batch_size} but tensor(s) {fixed} have no dynamic first (batch) axis",
            file=rel,
            fix="re-export with a dynamic batch axis on every input and output (torch.onnx.export "
            "dynamic_axes / dynamic_shapes), or render the model with max_batch_size 0",
        )
        return
    problems = _onnx_signature_problems(m, sig)
    if problems:
        m.rec.fail(
            "onnx_signature",
            "config.pbtxt does not agree with the ONNX graph: " + "; ".join(problems),
            file=rel,
            fix="re-render the model from its package (the signature is read from the ONNX "
            "file), or correct the inputs/outputs in config.pbtxt",
        )
    else:
        m.rec.ok("onnx_signature", "config inputs/outputs, dtypes and dims agree with the ONNX graph", rel)


def _onnx_signature_problems(m: ModelFolder, sig: Any) -> list[str]:
    problems: list[str] = []
    for kind, graph_tensors in (("input", sig.inputs), ("output", sig.outputs)):
        graph = {t.name: t for t in graph_tensors}
        configured = config_tensors(m.config, kind)
        for name, triton_type, dims in configured:
            t = graph.get(name)
            if t is None:
                problems.append(f"{kind} '{name}' is not in the graph (graph {kind}s: {sorted(graph)})")
                continue
            want = from_triton(triton_type).numpy
            if t.dtype != want:
                problems.append(f"{kind} '{name}' is {t.dtype} in the graph, {triton_type} in the config")
            model_dims = t.dims[1:] if m.batching else t.dims
            if not _dims_agree(model_dims, dims):
                problems.append(
                    f"{kind} '{name}' has dims {model_dims} in the graph"
                    f"{' (batch axis dropped)' if m.batching else ''}, {dims} in the config"
                )
        if kind == "input":
            missing = sorted(set(graph) - {name for name, _, _ in configured})
            if missing:
                problems.append(f"graph input(s) {missing} are not in the config")
    return problems
