"""`snoozectl render PATH... --out REPO`: packages into a Triton model repository, without a server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from controlplane.cli.output import fail, out_console
from controlplane.errors import InvalidPackageError, SnoozeError
from controlplane.modes import TargetName


def render(
    paths: Annotated[
        list[Path],
        typer.Argument(
            metavar="PATH",
            help="Package folders, Triton model folders, or models folders (a Triton repository, models.toml)",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Model repository to write")],
    target: Annotated[
        str, typer.Option(metavar="|".join(TargetName), help="embedded (python backend only) | full (official image)")
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
                continue
            found = discover(path)
            if not found:  # nothing to write is a refusal, not a success
                raise InvalidPackageError(
                    f"{path}: not a model package, and no model package in it",
                    hint="pass a package folder (snooze_model.py, model.onnx, model.plan), a Triton model folder "
                    "(config.pbtxt, 1/model.py), or a models folder holding them",
                )
            deployments.extend(found)
        specs = resolve_all(deployments)
        written = render_repository(specs, out, target_by_name(target))
    except SnoozeError as exc:
        raise fail(exc) from None
    if as_json:
        print(json.dumps({"repository": str(out), "models": [p.name for p in written]}))
    else:
        for spec, folder in zip(specs, written, strict=True):
            out_console.print(f"rendered [bold]{spec.id}[/] ({spec.package.kind.value}) -> {folder}")


def register(app: typer.Typer) -> None:
    """Add `snoozectl render` to the app."""
    app.command()(render)
