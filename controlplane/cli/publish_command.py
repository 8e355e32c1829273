"""`snoozectl publish PATH`: pack a package folder, upload it, and (with --load) wait until it serves."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from controlplane.cli.control_client import DEFAULT_URL, ApiKey, Url, open_client, waiting
from controlplane.cli.output import AsJson, err_console, fail, out_console
from controlplane.cli.status_command import status_table
from controlplane.errors import SnoozeError

_PATH_HINT = "pass the package folder (it is packed for you) or an archive of it"


def _parse_params(items: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SnoozeError(
                f"--param '{item}' is not KEY=VALUE", hint="e.g. --param scale=2.0 (values are JSON when they parse)"
            )
        try:
            params[key] = json.loads(raw)
        except json.JSONDecodeError:
            params[key] = raw
    return params


def _upload_progress(as_json: bool) -> tuple[Progress | None, Callable[[int, int], None] | None]:
    if as_json:
        return None, None
    bar = Progress(
        TextColumn("uploading"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err_console,
        transient=True,
    )
    task = bar.add_task("upload", total=None)

    def update(sent: int, total: int) -> None:
        bar.update(task, completed=sent, total=total)

    return bar, update


def publish(
    path: Annotated[
        Path, typer.Argument(metavar="PATH", help="Package folder (packed and uploaded) or .tar.gz/.tgz/.tar/.zip")
    ],
    model_id: Annotated[str | None, typer.Option("--id", help="Model id (default: the folder name)")] = None,
    device: Annotated[
        str | None, typer.Option(metavar="cpu|gpu|auto", help="Where the model runs [default: cpu]")
    ] = None,
    max_batch_size: Annotated[int | None, typer.Option(help="0 disables batching")] = None,
    max_batch_delay_ms: Annotated[float | None, typer.Option(help="Dynamic batcher max queue delay")] = None,
    idle_timeout: Annotated[
        float | None,
        typer.Option(
            "--idle-timeout-secs", "--idle-timeout", help="Unload after this many idle seconds (idle_timeout_secs)"
        ),
    ] = None,
    keep_alive: Annotated[
        str | None,
        typer.Option(
            metavar="fixed|adaptive",
            help="fixed: the idle timeout; adaptive: learned keep-alive and pre-warm windows [default: fixed]",
        ),
    ] = None,
    worker: Annotated[
        str | None,
        typer.Option(
            metavar="in-stub|preforked",
            help="Custom models: in the python-backend stub, or in a worker "
            "forked from a parent that preloaded the framework [default: in-stub]",
        ),
    ] = None,
    instances: Annotated[int | None, typer.Option(help="Instances loaded on wake-up")] = None,
    max_instances: Annotated[int | None, typer.Option(help="Upper bound for the autoscaler")] = None,
    memory_mb: Annotated[float | None, typer.Option(help="Declared memory footprint")] = None,
    param: Annotated[
        list[str] | None, typer.Option("--param", metavar="KEY=VALUE", help="Model param (repeatable)")
    ] = None,
    wakes: Annotated[
        list[str] | None,
        typer.Option("--wakes", metavar="MODEL", help="A model this one calls through BLS, woken with it (repeatable)"),
    ] = None,
    server_path: Annotated[
        bool, typer.Option("--server-path", help="The server reads PATH from its own filesystem (no upload)")
    ] = False,
    load: Annotated[bool, typer.Option("--load", help="Load the model once published (a cold start)")] = False,
    prefer_native: Annotated[
        bool,
        typer.Option(
            "--prefer-native/--no-convert",
            help="Export a custom torch package (export_module hook) to ONNX and publish that if parity passes",
        ),
    ] = True,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    as_json: AsJson = False,
) -> None:
    """Validate and publish a model package; the repository changes only if it is valid.

    \b
    Examples:
      snoozectl publish ./my-net --id my-net
      snoozectl publish ./my-net --id my-net --load --max-batch-size 16 --idle-timeout-secs 600
      snoozectl publish my-net.tar.gz --id my-net --json
    """
    options = {
        "device": device,
        "max_batch_size": max_batch_size,
        "max_batch_delay_ms": max_batch_delay_ms,
        "idle_timeout_secs": idle_timeout,
        "keep_alive": keep_alive,
        "worker": worker,
        "instances": instances,
        "max_instances": max_instances,
        "memory_mb": memory_mb,
    }
    deployment: dict[str, Any] = {k: v for k, v in options.items() if v is not None}
    if not server_path and not path.exists():
        raise fail(SnoozeError(f"{path}: no such file or folder", hint=_PATH_HINT), as_json)
    with open_client(url, api_key, as_json) as client, ExitStack() as native:
        from controlplane.api.client import default_model_id

        client.live()  # an unreachable API is said first, before any conversion work
        name = model_id or default_model_id(path)
        existed = load and _published(client, name)
        if param:
            deployment["params"] = _parse_params(param)
        if wakes:
            deployment["wakes"] = wakes
        decision = None
        if prefer_native and path.is_dir() and not server_path:  # archives and server paths go as they are
            decision = _native_decision(path, deployment, native, as_json)
            path = decision.publish_path
            if decision.converted:  # the params are baked into the exported graph
                deployment.pop("params", None)
        detail = _send(client, path, name, deployment, server_path=server_path, as_json=as_json)
        if load:
            detail["status"] = _load_or_withdraw(client, name, existed, as_json)
    if decision is not None:
        detail["conversion"] = {"native": decision.native, "converted": decision.converted, "reason": decision.reason}
    _say_published(detail, decision, name, load=load, as_json=as_json)


def _native_decision(path: Path, deployment: dict[str, Any], native: ExitStack, as_json: bool) -> Any:
    """``native_package`` for a package folder, its stages on a spinner; the converted package lives as long as
    ``native``."""
    from controlplane.native import native_package

    def convert(progress: Callable[[str], None]) -> Any:
        batch = deployment.get("max_batch_size", 8)
        return native.enter_context(
            native_package(path, max_batch_size=batch, params=deployment.get("params"), progress=progress)
        )

    if as_json:
        return convert(lambda _stage: None)
    with err_console.status("looking for a native export") as spinner:
        return convert(lambda stage: spinner.update(f"converting to ONNX: {stage}"))


def _send(
    client: Any, path: Path, name: str, deployment: dict[str, Any], *, server_path: bool, as_json: bool
) -> dict[str, Any]:
    """Publish ``path``: by its path on the server, or uploaded as an archive with a progress bar."""
    if server_path:
        return waiting(f"publishing {name}", as_json, lambda: client.publish_path(path, name, **deployment))
    bar, update = _upload_progress(as_json)
    if bar is None:
        return client.publish_archive(path, name, **deployment)
    with bar:
        return client.publish_archive(path, name, progress=update, **deployment)


def _say_published(detail: dict[str, Any], decision: Any, name: str, *, load: bool, as_json: bool) -> None:
    """The answer: one JSON object, or `published ...`, its notes and (with --load) the status table."""
    if as_json:
        print(json.dumps(detail))
        return
    out_console.print(f"published [bold]{name}[/] ({detail['kind']}, {detail['backend']} backend)", highlight=False)
    for line in _publish_notes(detail, decision):
        out_console.print(line, highlight=False, markup=False, soft_wrap=True)
    if load:
        out_console.print(status_table([detail]))


def _publish_notes(detail: dict[str, Any], decision: Any) -> list[str]:
    """Below `published ...`: the conversion's outcome worth saying, and what publishing decided (notes)."""
    lines = [f"  native: {decision.reason}"] if decision is not None and _worth_saying(decision) else []
    return lines + [f"  note: {note}" for note in detail.get("notes") or []]


def _published(client: Any, model_id: str) -> bool:
    from controlplane.api.client import ControlPlaneError

    try:
        client.get(model_id)
    except ControlPlaneError as exc:
        if exc.status_code == 404:
            return False
        raise
    return True


def _load_or_withdraw(client: Any, name: str, existed: bool, as_json: bool) -> dict[str, Any]:
    """`publish --load`: a new model that does not load is deleted again, so that a failed publish
    leaves the server as it was; a model that was already published stays (its previous files are
    gone), and the error says so."""
    from controlplane.api.client import ControlPlaneError

    try:
        status = waiting(f"loading {name} (cold start)", as_json, lambda: client.load(name))
        if status.get("state") != "failed":
            return status
        error = ControlPlaneError(
            f"model '{name}' failed to load: {status.get('reason', '')}", status_code=503, code="load_failed"
        )
    except ControlPlaneError as exc:
        error = exc
    if existed:
        note = f"model '{name}' stays published (it replaced the earlier one) in state 'failed'"
    else:
        client.delete(name)
        note = f"model '{name}' was not kept: publish --load keeps only a model that loads"
    hint = f"{error.hint}; " if error.hint else ""
    raise ControlPlaneError(
        error.message,
        hint=f"{hint}{note}; try it with `snoozectl check <folder>`",
        status_code=error.status_code,
        code=error.code,
    )


# Fallback stages that come after an export hook was found: the user asked for a native model.
_ATTEMPTED = ("torch", "export", "parity", "worker")


def _worth_saying(decision: Any) -> bool:
    """A conversion, or a fallback from one that was attempted; a plain custom model (no export hook),
    a native package or --no-convert is the ordinary case and says nothing (--json carries the reason)."""
    return bool(decision.converted or decision.stage in _ATTEMPTED)
