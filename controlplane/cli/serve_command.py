"""`snoozectl serve`: the embedded stack (Triton, the control plane, the gateway) in this process until Ctrl-C."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from controlplane.cli.output import fail
from controlplane.errors import SnoozeError
from controlplane.modes import TargetName


def serve(
    models: Annotated[
        Path | None,
        typer.Option(
            help="Models folder (packages and/or models.toml), or a models.toml, to publish "
            "[default: none, publish later]"
        ),
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
        typer.Option(metavar="|".join(TargetName), help="Triton's backends [SNOOZE_TARGET; default: embedded]"),
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
    # Flag values of several types, each checked and converted by Settings.
    overrides: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
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


def register(app: typer.Typer) -> None:
    """Add `snoozectl serve` to the app."""
    app.command()(serve)
