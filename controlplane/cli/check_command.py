"""`snoozectl check PATH`: load a package in a child process, run one predict, show what it returned."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from controlplane.cli.output import fail, out_console
from controlplane.errors import SnoozeError


def check(
    path: Annotated[
        Path, typer.Argument(metavar="PATH", help="Package folder, or a Triton model folder (run in tritonserver)")
    ],
    inputs: Annotated[
        list[str] | None,
        typer.Option(
            "--input", "-i", metavar="NAME:SHAPE|NAME=FILE.npy", help="Batch first, e.g. x:4x3 (repeat per input)"
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda:N (a Triton model folder: its config's)")] = "cpu",
    max_batch_size: Annotated[
        int, typer.Option(help="0 if the model does not batch (a Triton model folder: its config's)")
    ] = 8,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Load a package in a child process, run one predict, print the outputs. A Triton model folder is loaded into
    the embedded tritonserver instead (an ensemble with its steps, from the folders beside it).

    \b
    Examples:
      snoozectl check examples/models/numpy-linear --input x:2x4
      snoozectl check ./my-net --input x=batch.npy --json
    """
    from controlplane.check import check_package

    try:
        result = check_package(path, inputs or [], device=device, max_batch_size=max_batch_size)
    except SnoozeError as exc:
        raise fail(exc, as_json) from None
    if as_json:
        outputs = {
            name: {
                "shape": list(a.shape),
                "dtype": str(a.dtype),
                "returned_dtype": result.returned.get(name, str(a.dtype)),
                **({"note": result.notes[name]} if name in result.notes else {}),
                "data": a.ravel()[:8].tolist(),
            }
            for name, a in result.outputs.items()
        }
        report = {"ok": True, "model": result.model_id, "device": device, "outputs": outputs}
        print(json.dumps(report, default=_jsonable))
        return
    out_console.print(f"OK: model loaded on '{result.device}'", highlight=False)
    for name, array in result.outputs.items():
        first = ", ".join(_short(v) for v in array.ravel()[:6])
        more = ", ..." if array.size > 6 else ""
        # markup off: a BYTES value in brackets ([b'hello w42']) would read as a Rich tag and vanish
        out_console.print(
            f"  {name}: shape {tuple(array.shape)} {array.dtype}  [{first}{more}]", highlight=False, markup=False
        )
        if name in result.notes:  # what predict really returned, when the runtime narrowed it
            out_console.print(f"    note: {result.notes[name]}", highlight=False, markup=False, soft_wrap=True)


def _short(value: object) -> str:
    if isinstance(value, bytes):
        return repr(value)
    if isinstance(value, float):
        return f"{value:.5g}"
    return f"{value:.5g}" if hasattr(value, "dtype") and value.dtype.kind == "f" else str(value)


def _jsonable(value: object) -> object:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def register(app: typer.Typer) -> None:
    """Add `snoozectl check` to the app."""
    app.command()(check)
