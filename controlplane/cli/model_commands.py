"""`snoozectl load | unload | delete MODEL_ID`: one control-API call each, on a published model."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from controlplane.cli.control_client import DEFAULT_URL, ApiKey, Url, open_client, waiting
from controlplane.cli.output import AsJson, out_console
from controlplane.cli.status_command import state_text


def load(
    model_id: Annotated[str, typer.Argument(metavar="MODEL_ID", help="Model id")],
    instances: Annotated[int | None, typer.Option(help="Instances (default: the deployment's)")] = None,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    as_json: AsJson = False,
) -> None:
    """Load (wake) a model and wait until it is ready."""
    with open_client(url, api_key, as_json) as client:
        result = waiting(f"loading {model_id} (cold start)", as_json, lambda: client.load(model_id, instances))
    if as_json:
        print(json.dumps(result))
        return
    cold = result.get("last_cold_start_secs")
    took = f" in {cold:.2f}s" if cold is not None else ""
    out_console.print(f"[bold]{model_id}[/] is {state_text(result)}{took} ({result.get('instances', 0)} instance(s))")


def unload(
    model_id: Annotated[str, typer.Argument(metavar="MODEL_ID", help="Model id")],
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    as_json: AsJson = False,
) -> None:
    """Unload a model now; it wakes again on its next request."""
    with open_client(url, api_key, as_json) as client:
        result = waiting(f"unloading {model_id}", as_json, lambda: client.unload(model_id))
    if as_json:
        print(json.dumps(result))
    else:
        out_console.print(f"[bold]{model_id}[/] is {state_text(result)}")


def delete(
    model_id: Annotated[str, typer.Argument(metavar="MODEL_ID", help="Model id")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation")] = False,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    as_json: AsJson = False,
) -> None:
    """Unload a model and remove it from the repository."""
    if not yes and not typer.confirm(f"delete model '{model_id}'?"):
        raise typer.Exit(1)
    with open_client(url, api_key, as_json) as client:
        client.delete(model_id)
    if as_json:
        print(json.dumps({"deleted": model_id}))
    else:
        out_console.print(f"deleted [bold]{model_id}[/]")
