"""`snoozectl fleet up`: N nodes behind a model-affine fleet gateway on one machine; `snoozectl fleet
gateway`: the fleet gateway and the fleet API alone, in front of nodes that run elsewhere."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controlplane.cli.output import fail
from controlplane.errors import SnoozeError

if TYPE_CHECKING:
    from controlplane.settings import Settings

fleet_app = typer.Typer(
    help="A fleet of nodes behind one model-affine gateway.", no_args_is_help=True, rich_markup_mode=None
)


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
    from controlplane.fleet.frontend import run_until_signal
    from controlplane.fleet.up import Fleet
    from controlplane.stack import prepare_process

    try:
        settings = _settings(host=host, http_port=http_port, grpc_port=grpc_port, api_port=api_port, no_auth=no_auth)
        console = prepare_process(settings)
        fleet = Fleet(settings, nodes=nodes, models=models, work_dir=work_dir, console=console)
        code = asyncio.run(run_until_signal(fleet, console))
    except SnoozeError as exc:
        raise fail(exc) from None
    raise typer.Exit(code)


@fleet_app.command("gateway")
def gateway(
    node: Annotated[
        list[str] | None,
        typer.Option(
            metavar="NAME=HOST", help="A node: NAME=HOST, or NAME=HOST:HTTP_PORT:GRPC_PORT:API_PORT (repeat it)"
        ),
    ] = None,
    statefulset: Annotated[
        str | None, typer.Option(help="The nodes are this StatefulSet's pods (with --service, --replicas)")
    ] = None,
    service: Annotated[str | None, typer.Option(help="The StatefulSet's headless Service (its serviceName)")] = None,
    replicas: Annotated[int | None, typer.Option(help="The StatefulSet's replicas: pods 0 .. N-1")] = None,
    namespace: Annotated[
        str | None, typer.Option(help="The pods' namespace: <pod>.<service>.<namespace>.svc (default: <pod>.<service>)")
    ] = None,
    node_http_port: Annotated[int, typer.Option(help="Nodes' gateway HTTP port (default for every node)")] = 8000,
    node_grpc_port: Annotated[int, typer.Option(help="Nodes' gateway gRPC port")] = 8001,
    node_api_port: Annotated[int, typer.Option(help="Nodes' control API port")] = 8080,
    work_dir: Annotated[Path, typer.Option(help="Folder for the gateway's Envoy bootstrap and log")] = Path(
        ".snooze-fleet-gateway"
    ),
    host: Annotated[str | None, typer.Option(help="Fleet gateway and API address [SNOOZE_HOST; 127.0.0.1]")] = None,
    http_port: Annotated[int | None, typer.Option(help="Fleet gateway HTTP port [8000]")] = None,
    grpc_port: Annotated[int | None, typer.Option(help="Fleet gateway gRPC port [8001]")] = None,
    api_port: Annotated[int | None, typer.Option(help="Fleet API port [8080]")] = None,
    no_auth: Annotated[bool, typer.Option("--no-auth", help="Disable API keys (local use only)")] = False,
) -> None:
    """Run the fleet gateway (model-affine routing) and the fleet API in front of running nodes.

    Nodes: --node NAME=HOST (repeat it), or a StatefulSet's pods by DNS name (--statefulset --service --replicas).

    A node's NAME is its place on the ring: keep it when the node's address changes.

    Keys come from SNOOZE_API_KEYS / SNOOZE_ADMIN_KEYS, the same as the nodes'. Exits 1 if its Envoy dies."""
    from controlplane.fleet.frontend import FleetFrontend, run_until_signal
    from controlplane.fleet.nodes import fleet_nodes, needs_dns
    from controlplane.stack import prepare_process

    try:
        nodes = fleet_nodes(
            node or [], statefulset=statefulset, service=service, replicas=replicas, namespace=namespace,
            http_port=node_http_port, grpc_port=node_grpc_port, api_port=node_api_port,
        )  # fmt: skip
        settings = _settings(host=host, http_port=http_port, grpc_port=grpc_port, api_port=api_port, no_auth=no_auth)
        console = prepare_process(settings)
        frontend = FleetFrontend(settings, nodes, work_dir.resolve(), dns=needs_dns(nodes))
        code = asyncio.run(run_until_signal(frontend, console))
    except SnoozeError as exc:
        raise fail(exc) from None
    raise typer.Exit(code)


def _settings(*, no_auth: bool, **given: object) -> Settings:
    """The fleet front's Settings: the flags that were given over the SNOOZE_* environment."""
    from controlplane.settings import Settings

    # Flag values of several types, each checked and converted by Settings.
    overrides: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    if no_auth:
        overrides["auth"] = "off"
    return Settings(**overrides)


def register(app: typer.Typer) -> None:
    app.add_typer(fleet_app, name="fleet")
