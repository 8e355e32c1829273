"""`snoozectl snapshot-entrypoint`: the container entrypoint of the checkpoint/restore workload
contract (see controlplane/snapshot.py and docs/deploy.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

import typer

from controlplane.cli.output import fail
from controlplane.errors import SnoozeError


def _model_list(values: list[str]) -> list[str]:
    """``--models-to-load a,b --models-to-load c`` -> ``[a, b, c]``."""
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def snapshot_entrypoint(
    models: Annotated[
        Path | None, typer.Option(help="Models folder (packages and/or models.toml), or a models.toml, to publish")
    ] = None,
    work_dir: Annotated[Path | None, typer.Option(help="Runtime folder [SNOOZE_WORK_DIR; .snooze]")] = None,
    host: Annotated[str | None, typer.Option(help="Gateway and API address [SNOOZE_HOST; 127.0.0.1]")] = None,
    http_port: Annotated[int | None, typer.Option(help="Gateway HTTP port [SNOOZE_HTTP_PORT; 8000]")] = None,
    grpc_port: Annotated[int | None, typer.Option(help="Gateway gRPC port [SNOOZE_GRPC_PORT; 8001]")] = None,
    api_port: Annotated[int | None, typer.Option(help="Control API port [SNOOZE_API_PORT; 8080]")] = None,
    no_auth: Annotated[bool, typer.Option("--no-auth", help="Disable API keys (local use only)")] = False,
    models_to_load: Annotated[
        list[str],
        typer.Option(
            "--models-to-load",
            envvar="SNOOZE_MODELS_TO_LOAD",
            metavar="MODEL_ID",
            help="Model ids to load and warm up before the snapshot, comma-separated or repeated "
            "[SNOOZE_MODELS_TO_LOAD; default: every published model]",
        ),
    ] = [],  # noqa: B006 - typer reads the default, it is never mutated
    quiesce_timeout: Annotated[
        float, typer.Option(help="Longest wait for in-flight requests to finish before the snapshot (seconds)")
    ] = 60.0,
) -> None:
    """Checkpoint/restore entrypoint: start, load, warm up, drain, write ready-for-snapshot; after
    restore-complete check health and one inference per model, write triton-restore-ready, serve.

    Needs SNAPSHOT_CONTROL_DIR; SNAPSHOT_RESTORE_STANDBY=1 (restore placeholder) starts nothing, ever:
    the agent restores the captured process beside it, and it sleeps until SIGTERM (exit 0). Exit status
    1 when the restored process refuses to serve (the reason is in $SNAPSHOT_CONTROL_DIR/restore-failed)."""
    from controlplane.settings import Settings
    from controlplane.snapshot import (
        ControlDir,
        SnapshotEntrypoint,
        control_dir_from_env,
        serve_snapshot,
        standby_from_env,
    )
    from controlplane.stack import prepare_process

    given = {"work_dir": work_dir, "host": host, "http_port": http_port, "grpc_port": grpc_port, "api_port": api_port}
    # Flag values of several types, each checked and converted by Settings.
    overrides: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    if no_auth:
        overrides["auth"] = "off"
    try:
        control = ControlDir(control_dir_from_env())
        standby = standby_from_env()
        settings = Settings(**overrides)
        console = prepare_process(settings)
        entry = SnapshotEntrypoint(
            control,
            lambda: Settings(**overrides),
            models,
            _model_list(models_to_load),
            quiesce_timeout=quiesce_timeout,
            console=console,
        )
        code = asyncio.run(serve_snapshot(entry, standby))
    except SnoozeError as exc:
        raise fail(exc) from None
    except ValueError as exc:  # pydantic's ValidationError: a bad SNOOZE_* value or flag
        raise fail(SnoozeError(f"invalid setting: {exc}", hint="see `snoozectl snapshot-entrypoint --help`")) from None
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("snapshot-entrypoint")(snapshot_entrypoint)
