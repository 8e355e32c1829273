"""`snoozectl fleet up`: N nodes behind a model-affine fleet gateway on one machine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from controlplane.cli.output import fail
from controlplane.errors import SnoozeError

fleet_app = typer.Typer(help="A fleet of nodes behind one model-affine gateway.", no_args_is_help=True)


@fleet_app.command("up")
def up(
    nodes: Annotated[int, typer.Option(help="How many nodes (each: Triton + control plane + node gateway)")] = 3,
    models: Annotated[Path | None, typer.Option(help="Models folder to publish into the shared store")] = None,
    work_dir: Annotated[Path, typer.Option(help="Fleet folder: the shared store, each node's folder, logs")] = Path(
        ".snooze-fleet"
    ),
    host: Annotated[str | None, typer.Option(help="Fleet gateway and API address [SNOOZE_HOST; 127.0.0.1]")] = None,
    http_port: Annotated[int | None, typer.Option(help="Fleet gateway HTTP port [8000]")] = None,
    grpc_port: Annotated[int | None, typer.Option(help="Fleet gateway gRPC port [8001]")] = None,
    api_port: Annotated[int | None, typer.Option(help="Fleet API port [8080]")] = None,
    no_auth: Annotated[bool, typer.Option("--no-auth", help="Disable API keys (local use only)")] = False,
) -> None:
    """Start NODES nodes over one shared model store and the fleet gateway; stop them together on Ctrl-C.

    Keys come from SNOOZE_API_KEYS / SNOOZE_ADMIN_KEYS (the same on every node and the gateway)."""
    from controlplane.fleet.up import Fleet, run_fleet
    from controlplane.settings import Settings
    from controlplane.stack import prepare_process

    given = {"host": host, "http_port": http_port, "grpc_port": grpc_port, "api_port": api_port}
    overrides: dict[str, object] = {k: v for k, v in given.items() if v is not None}
    if no_auth:
        overrides["auth"] = "off"
    try:
        settings = Settings(**overrides)
        console = prepare_process(settings)
        fleet = Fleet(settings, nodes=nodes, models=models, work_dir=work_dir, console=console)
        code = asyncio.run(run_fleet(fleet))
    except SnoozeError as exc:
        raise fail(exc) from None
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.add_typer(fleet_app, name="fleet")
