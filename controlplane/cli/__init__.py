"""`snoozectl`: a thin Typer CLI. Commands parse flags, build Settings, and call library code;
heavy imports happen inside the commands so `snoozectl --help` stays fast."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from controlplane.cli import (
    check_command,
    client_commands,
    convert_command,
    fleet_command,
    render_command,
    serve_command,
    snapshot_command,
    triton_command,
    validate_command,
)

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


# In the order `snoozectl --help` lists them.
serve_command.register(app)  # serve: the embedded stack until Ctrl-C
render_command.register(app)  # render: packages into a model repository, no server
check_command.register(app)  # check: one predict of a package in a child process
client_commands.register(app)  # publish, status/list, load, unload, delete: the control API's client
validate_command.register(app)  # validate: the CI gate for a generated model repository
convert_command.register(app)  # convert torch | onnx-to-trt
snapshot_command.register(app)  # snapshot-entrypoint: the checkpoint/restore container entrypoint
triton_command.register(app)  # triton: the embedded tritonserver alone (the two-process topology)
fleet_command.register(app)  # fleet up: N nodes behind a model-affine gateway


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
