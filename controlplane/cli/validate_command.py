"""`snoozectl validate REPO`: the CI gate for a generated model repository (see controlplane/validation/__init__.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from controlplane.modes import TargetName


def _parse_headers(values: list[str]) -> dict[str, str]:
    headers = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(
                f"{value!r}: expected NAME=VALUE, e.g. snooze-admin=$KEY", param_hint="--triton-header"
            )
        headers[key.strip()] = val
    return headers


def validate(
    repo: Annotated[Path, typer.Argument(metavar="REPO", help="The generated Triton model repository")],
    load: Annotated[bool, typer.Option("--load", help="Load every model, run one warm-up inference, unload")] = False,
    triton_url: Annotated[
        str | None,
        typer.Option(
            "--triton-url",
            envvar="SNOOZE_TRITON_URL",
            help="HTTP URL of a running Triton (default: start the embedded tritonserver)",
        ),
    ] = None,
    triton_header: Annotated[
        list[str],
        typer.Option(
            "--triton-header",
            metavar="NAME=VALUE",
            help="NAME=VALUE sent to Triton, e.g. the restricted "
            "model-repository API key (snooze-admin=KEY); repeatable",
        ),
    ] = [],  # noqa: B006 - typer reads the default, it is never mutated
    target: Annotated[
        TargetName,
        typer.Option(
            "--target",
            help="Backends of the serving Triton: embedded (python) or "
            "full (official image: python, onnxruntime, tensorrt)",
        ),
    ] = TargetName.EMBEDDED,
    model: Annotated[
        list[str], typer.Option("--model", metavar="MODEL_ID", help="Check only this model; repeatable")
    ] = [],  # noqa: B006
    load_timeout: Annotated[
        float,
        typer.Option(
            "--load-timeout", help="Seconds per load unless the model's snooze_deployment.json says otherwise"
        ),
    ] = 300.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON instead of a table")] = False,
    junit_xml: Annotated[Path | None, typer.Option("--junit-xml", help="Also write a JUnit XML report")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="List every check, passed ones too")] = False,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="--load: an inference on generated inputs that fails is "
            "a failure (default: a warning; the model may refuse random values)",
        ),
    ] = False,
) -> None:
    """Check that a generated model repository is correct and (with --load) loadable. Exit 1 on any failure."""
    from controlplane.validation import validate_repository

    report = validate_repository(
        repo,
        load=load,
        triton_url=triton_url,
        target=target.value,
        triton_headers=_parse_headers(triton_header),
        load_timeout=load_timeout,
        models=model or None,
        strict=strict,
    )
    if junit_xml is not None:
        report.write_junit_xml(junit_xml)
    if as_json:
        typer.echo(report.to_json())
    else:
        from controlplane.cli.output import out_console

        report.print_table(out_console, verbose=verbose)
    raise typer.Exit(0 if report.ok else 1)


def register(app: typer.Typer) -> None:
    """Add `validate` to the snoozectl app."""
    app.command("validate")(validate)
