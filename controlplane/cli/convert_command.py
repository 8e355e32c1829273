"""`snoozectl convert torch | onnx-to-trt`: conversions, run in a child process (`converters.worker`).

``register(app)`` adds the `convert` group to the snoozectl Typer app. Stages are shown with a spinner
on stderr, so ``--json`` output on stdout stays parseable."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from controlplane.cli.output import AsJson, err_console, fail, out_console
from controlplane.errors import InvalidPackageError, SnoozeError

convert_app = typer.Typer(
    name="convert",
    help="Convert models: torch package -> ONNX package (with parity check), ONNX -> TensorRT plan.",
    no_args_is_help=True,
    rich_markup_mode=None,
)

_out = out_console
_err = err_console
_INPUT = re.compile(r"^(?P<name>[^=]+)=(?P<file>.+\.npy)$")


@contextmanager
def _stages(title: str, as_json: bool) -> Iterator[Callable[[str], None]]:
    """A spinner showing the current stage; each finished stage stays printed with its duration."""
    if as_json:
        yield lambda _stage: None
        return
    import time

    current: dict[str, Any] = {"stage": None, "since": time.perf_counter()}
    with _err.status(f"{title}...", spinner="dots") as status:

        def finish(outcome: str) -> None:
            if current["stage"] is not None:
                secs = time.perf_counter() - current["since"]
                _err.print(f"  {outcome} {escape(current['stage'])} ({secs:.1f} s)", highlight=False, soft_wrap=True)
            current["stage"] = None

        def update(stage: str) -> None:
            if stage == "done":  # the worker's last word; the parent still has stages of its own
                return
            finish("[green]done[/]")
            current.update(stage=stage, since=time.perf_counter())
            status.update(f"{escape(title)}: {escape(stage)}")

        try:
            yield update
        except BaseException:
            finish("[red]failed[/]")
            raise
        finish("[green]done[/]")


def _parse_inputs(items: list[str]) -> list[dict[str, str]]:
    batch: dict[str, str] = {}
    for item in items:
        match = _INPUT.match(item)
        if not match:
            raise InvalidPackageError(f"--input {item!r}: expected NAME=FILE.npy (a batch, batch axis first)")
        name, file = match.group("name"), match.group("file")
        if name in batch:
            raise InvalidPackageError(f"--input {item!r}: input '{name}' is given twice")
        if not Path(file).is_file():
            raise InvalidPackageError(f"--input {item!r}: {file} not found")
        batch[name] = file
    return [batch] if batch else []


def _parity_table(report: dict[str, Any], title: str) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(title=escape(title), box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("case", "output", "dtype", "shape", "max abs", "max rel", "atol/rtol", "result"):
        table.add_column(column, justify="right" if column.startswith("max") else "left", no_wrap=column != "result")
    for c in report.get("comparisons", []):
        result = "[green]ok[/green]" if c["passed"] else f"[red]FAIL[/red] {escape(c.get('detail') or '')}".rstrip()
        fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
        table.add_row(
            c["case"],
            c["output"],
            c["dtype"],
            str(c["shape"]),
            fmt(c["max_abs"]),
            fmt(c["max_rel"]),
            f"{c['atol']:g}/{c['rtol']:g}",
            result,
        )
    return table


@convert_app.command("torch")
def torch_command(
    package: Annotated[
        Path,
        typer.Argument(metavar="PACKAGE", help="Custom package folder whose snooze_model.py has an export_module hook"),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="New folder for the ONNX package (absent or empty)")],
    max_batch_size: Annotated[int, typer.Option(help="Largest batch the parity check runs (1, 3 and this)")] = 8,
    opset: Annotated[int, typer.Option(help="ONNX opset of the export")] = 18,
    atol: Annotated[float | None, typer.Option(help="Absolute tolerance for float outputs (default per dtype)")] = None,
    rtol: Annotated[float | None, typer.Option(help="Relative tolerance for float outputs (default per dtype)")] = None,
    inputs: Annotated[
        list[str] | None,
        typer.Option("--input", "-i", metavar="NAME=FILE.npy", help="A user batch checked too (repeat per input)"),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds the export + parity check may take")] = 900,
    as_json: AsJson = False,
) -> None:
    """Export a torch package to an ONNX package and check parity; the custom package is kept as provenance."""
    from controlplane.conversion_worker import ConversionFailed
    from controlplane.native import PARITY_FILE, prefer_native, tolerances_from
    from controlplane.spec import PackageKind, load_package

    try:
        user_inputs = _parse_inputs(inputs or [])
        kind = load_package(package).kind
        if kind is not PackageKind.CUSTOM:
            raise InvalidPackageError(
                f"{package}: is already a {kind.value} package; `convert torch` takes a custom package "
                "(snooze_model.py with an export_module hook)",
                hint="publish it as it is, or use `snoozectl convert onnx-to-trt` for a TensorRT plan",
            )
        with _stages(f"converting {package}", as_json) as progress:
            decision = prefer_native(
                package,
                max_batch_size=max_batch_size,
                out_dir=out,
                opset=opset,
                tolerances=tolerances_from(atol, rtol),
                progress=progress,
                timeout=timeout,
                user_inputs=user_inputs,
            )
    except SnoozeError as exc:
        raise fail(exc, as_json) from None
    if decision.report and not as_json:
        where = out / PARITY_FILE if decision.native else decision.artifacts / PARITY_FILE  # type: ignore[operator]
        _err.print(_parity_table(decision.report, f"parity (saved to {where})"))
    if not decision.native:
        reason = decision.reason.removeprefix("serving the custom package (python backend): ")
        raise fail(
            ConversionFailed(f"{package}: {reason}", hint=decision.hint),
            as_json,
            {"stage": decision.stage, "report": decision.report, "artifacts": decision.artifacts},
        )
    if as_json:
        print(json.dumps({"ok": True, **decision.to_dict()}, default=str))
        return
    _out.print(f"[green]ok[/green] {escape(decision.reason)}", highlight=False, soft_wrap=True)
    _out.print(f"ONNX package: {out} (publish it with `snoozectl publish {out}`)", highlight=False, soft_wrap=True)


@convert_app.command("onnx-to-trt")
def onnx_to_trt_command(
    model: Annotated[Path, typer.Argument(metavar="MODEL.onnx", help="ONNX file (model.onnx)")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the TensorRT package (model.plan + manifest)")],
    max_batch_size: Annotated[
        int, typer.Option(help="Batch axis profile: 1 .. this (0: the model does not batch)")
    ] = 8,
    fp16: Annotated[bool, typer.Option("--fp16", help="Allow FP16 kernels")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds the engine build may take")] = 1800,
    as_json: AsJson = False,
) -> None:
    """Build a TensorRT engine (needs an NVIDIA GPU and `tensorrt`); fails fast, with no file, without them."""
    from controlplane.tensorrt_package import build_tensorrt_package

    try:
        with _stages(f"building a TensorRT plan from {model}", as_json) as progress:
            built = build_tensorrt_package(
                model, out, max_batch_size=max_batch_size, fp16=fp16, progress=progress, timeout=timeout
            )
    except SnoozeError as exc:
        raise fail(exc, as_json) from None
    if as_json:
        print(
            json.dumps(
                {
                    "ok": True,
                    "package": str(built.path),
                    "plan": str(built.plan_path),
                    "build_secs": built.build_secs,
                    "fp16": built.fp16,
                    "tensorrt": built.tensorrt_version,
                }
            )
        )
        return
    _out.print(
        f"[green]ok[/green] built {built.plan_path} in {built.build_secs:.1f} s (TensorRT {built.tensorrt_version}, "
        f"{'fp16' if built.fp16 else 'fp32'}); it runs only on this GPU model and TensorRT version",
        highlight=False,
        soft_wrap=True,
    )


def register(app: typer.Typer) -> None:
    """Add `snoozectl convert ...` to the app."""
    app.add_typer(convert_app, name="convert")
