"""`snoozectl`: a thin Typer CLI. Commands parse flags, build Settings, and call library code;
heavy imports happen inside the commands so `snoozectl --help` stays fast."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from controlplane.cli import client_commands, validate_command
from controlplane.cli.output import fail, out_console
from controlplane.errors import SnoozeError

app = typer.Typer(
    name="snoozectl",
    help="""Serve many models on Triton and let each of them sleep.

    \b
    Examples:
      snoozectl serve --models examples/models --no-auth   # a local stack on :8000 (HTTP), :8001 (gRPC), :8080 (API)
      snoozectl check examples/models/numpy-linear --input x:2x4
      snoozectl publish ./my-net --id my-net --load
      snoozectl status
      snoozectl validate .snooze/model_repository --load
    """,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: rich's would read "[env ...]" in a help text as markup and show "<bool>" for flags.
    rich_markup_mode=None,
)
console = out_console
TARGETS = "embedded|full"


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"snoozectl {version('snoozeml')}")
        except PackageNotFoundError:  # run from a source tree that is not installed
            typer.echo("snoozectl (snoozeml not installed)")
        raise typer.Exit()


@app.callback()
def _main(
    _show_version: Annotated[
        bool | None,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit"),
    ] = None,
) -> None:
    """Serve many models on Triton and let each of them sleep."""


@app.command()
def serve(
    models: Annotated[
        Path | None,
        typer.Option(help="Models folder (packages and/or models.toml) to publish [default: none, publish later]"),
    ] = None,
    work_dir: Annotated[Path | None, typer.Option(help="Runtime folder [SNOOZE_WORK_DIR; default: .snooze]")] = None,
    host: Annotated[str | None, typer.Option(help="Gateway and API address [SNOOZE_HOST; 127.0.0.1]")] = None,
    http_port: Annotated[int | None, typer.Option(help="Gateway HTTP port [SNOOZE_HTTP_PORT; 8000]")] = None,
    grpc_port: Annotated[int | None, typer.Option(help="Gateway gRPC port [SNOOZE_GRPC_PORT; 8001]")] = None,
    api_port: Annotated[int | None, typer.Option(help="Control API port [SNOOZE_API_PORT; 8080]")] = None,
    triton_url: Annotated[str | None, typer.Option(help="Use this Triton (HTTP URL) instead of starting one")] = None,
    triton_grpc_url: Annotated[str | None, typer.Option(help="gRPC host:port of that Triton")] = None,
    triton_metrics_url: Annotated[str | None, typer.Option(help="Metrics URL of that Triton")] = None,
    model_repository: Annotated[
        Path | None, typer.Option(help="Model repository (shared with that Triton) [<work-dir>/model_repository]")
    ] = None,
    journal_dir: Annotated[
        Path | None, typer.Option(help="Triton's request journal folder [SNOOZE_JOURNAL_DIR; found from Triton]")
    ] = None,
    target: Annotated[
        str | None,
        typer.Option(metavar=TARGETS, help="Triton's backends [SNOOZE_TARGET; default: embedded]"),
    ] = None,
    no_auth: Annotated[bool, typer.Option("--no-auth", help="Disable API keys (local use only)")] = False,
    no_gateway: Annotated[bool, typer.Option("--no-gateway", help="No Envoy: clients use Triton's ports")] = False,
) -> None:
    """Start Triton, the control plane and the gateway; publish MODELS; serve until Ctrl-C.

    Flags override the SNOOZE_* environment variables, which override the defaults.

    \b
    Examples:
      snoozectl serve --models examples/models --no-auth
      SNOOZE_API_KEYS='["k1"]' SNOOZE_ADMIN_KEYS='["a1"]' snoozectl serve --models models --host 0.0.0.0
    """
    from controlplane.settings import Settings
    from controlplane.stack import run_stack

    given = {
        "work_dir": work_dir,
        "host": host,
        "http_port": http_port,
        "grpc_port": grpc_port,
        "api_port": api_port,
        "triton_url": triton_url,
        "triton_grpc_url": triton_grpc_url,
        "target": target,
        "triton_metrics_url": triton_metrics_url,
        "model_repository": model_repository,
        "journal_dir": journal_dir,
    }
    overrides: dict[str, object] = {k: v for k, v in given.items() if v is not None}
    if no_gateway:
        overrides["gateway"] = False
    if no_auth:
        overrides["auth"] = "off"
    try:
        settings = Settings(**overrides)
        code = run_stack(settings, models)
    except SnoozeError as exc:
        raise fail(exc) from None
    except ValueError as exc:  # pydantic's ValidationError: a bad SNOOZE_* value or flag
        raise fail(SnoozeError(f"invalid setting: {exc}", hint="see `snoozectl serve --help`")) from None
    raise typer.Exit(code)


@app.command()
def render(
    paths: Annotated[
        list[Path], typer.Argument(metavar="PATH", help="Package folders or models folders (with models.toml)")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Model repository to write")],
    target: Annotated[
        str, typer.Option(metavar=TARGETS, help="embedded (python backend only) | full (official image)")
    ] = "embedded",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Render packages into a Triton model repository (all validated first, each written atomically).

    \b
    Example:
      snoozectl render models/ --out model_repository --target embedded
    """
    from controlplane.render import target_by_name
    from controlplane.spec import DeploymentSpec, discover, is_package_dir, resolve_all
    from controlplane.store import render_repository

    try:
        deployments = []
        for path in paths:
            if is_package_dir(path):
                deployments.append(DeploymentSpec(id=path.resolve().name, path=path.resolve()))
            else:
                deployments.extend(discover(path))
        specs = resolve_all(deployments)
        written = render_repository(specs, out, target_by_name(target))
    except SnoozeError as exc:
        raise fail(exc) from None
    if as_json:
        print(json.dumps({"repository": str(out), "models": [p.name for p in written]}))
    else:
        for spec, folder in zip(specs, written, strict=True):
            console.print(f"rendered [bold]{spec.id}[/] ({spec.package.kind.value}) -> {folder}")


@app.command()
def check(
    path: Annotated[Path, typer.Argument(metavar="PATH", help="Package folder")],
    inputs: Annotated[
        list[str] | None,
        typer.Option(
            "--input", "-i", metavar="NAME:SHAPE|NAME=FILE.npy", help="Batch first, e.g. x:4x3 (repeat per input)"
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda:N")] = "cpu",
    max_batch_size: Annotated[int, typer.Option(help="0 if the model does not batch")] = 8,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Load a package in a child process, run one predict, print the outputs.

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
    console.print(f"OK: model loaded on '{result.device}'", highlight=False)
    for name, array in result.outputs.items():
        first = ", ".join(_short(v) for v in array.ravel()[:6])
        more = ", ..." if array.size > 6 else ""
        # markup off: a BYTES value in brackets ([b'hello w42']) would read as a Rich tag and vanish
        console.print(
            f"  {name}: shape {tuple(array.shape)} {array.dtype}  [{first}{more}]", highlight=False, markup=False
        )
        if name in result.notes:  # what predict really returned, when the runtime narrowed it
            console.print(f"    note: {result.notes[name]}", highlight=False, markup=False, soft_wrap=True)


def _short(value: object) -> str:
    if isinstance(value, bytes):
        return repr(value)
    if isinstance(value, float):
        return f"{value:.5g}"
    return f"{value:.5g}" if hasattr(value, "dtype") and value.dtype.kind == "f" else str(value)


def _jsonable(value: object) -> object:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


client_commands.register(app)  # publish, status/list, load, unload, delete: the control API's client
validate_command.register(app)  # validate: the CI gate for a generated model repository
from controlplane.cli import convert_command  # noqa: E402

convert_command.register(app)  # convert torch | onnx-to-trt
from controlplane.cli import snapshot_command  # noqa: E402

snapshot_command.register(app)  # snapshot-entrypoint: the checkpoint/restore container entrypoint
from controlplane.cli import triton_command  # noqa: E402

triton_command.register(app)  # triton: the embedded tritonserver alone (the two-process topology)
from controlplane.cli import fleet_command  # noqa: E402

fleet_command.register(app)  # fleet up: N nodes behind a model-affine gateway


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
