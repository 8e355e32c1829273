"""`snoozectl publish | status | list | load | unload | delete`: talk to a running control API over HTTP.

``register(app)`` adds the commands to the snoozectl Typer app; each lives in its own module. Progress
and spinners go to stderr, so ``--json`` output on stdout stays parseable."""

from __future__ import annotations

import typer

from controlplane.cli.model_commands import delete, load, unload
from controlplane.cli.publish_command import publish
from controlplane.cli.status_command import status


def register(app: typer.Typer) -> None:
    """Add the control-API commands to the snoozectl app."""
    app.command()(publish)
    app.command()(status)
    app.command("list", hidden=True)(status)  # an old name of status, kept for scripts
    app.command()(load)
    app.command()(unload)
    app.command()(delete)
