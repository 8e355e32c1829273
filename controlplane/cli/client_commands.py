"""`snoozectl publish | status | list | load | unload | delete`: talk to a running control API over HTTP.

``register(app)`` adds the commands to the snoozectl Typer app. Progress and spinners go to stderr,
so ``--json`` output on stdout stays parseable."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from controlplane.cli.output import AsJson, err_console, fail, out_console
from controlplane.errors import SnoozeError

if TYPE_CHECKING:
    from controlplane.api.client import ControlPlaneClient

DEFAULT_URL = "http://127.0.0.1:8080"

Url = Annotated[str, typer.Option("--url", envvar="SNOOZE_API_URL", help="Control API URL")]
ApiKey = Annotated[
    str | None,
    typer.Option(
        "--api-key", envvar="SNOOZE_API_KEY", show_default=False,
        help="An admin key of the control API (every /v1 call needs one; inference keys only infer)",
    ),
]

_out = out_console
_err = err_console
T = TypeVar("T")


@contextmanager
def _client(url: str, api_key: str | None, as_json: bool) -> Iterator[ControlPlaneClient]:
    """A client whose errors end the command as `error: ...` + `fix: ...` (or JSON) with exit code 1."""
    from controlplane.api.client import ControlPlaneClient  # httpx: imported only by commands that use it

    try:
        with ControlPlaneClient(url, api_key) as client:
            yield client
    except SnoozeError as exc:
        raise fail(exc, as_json) from None


def _waiting(message: str, as_json: bool, call: Callable[[], T]) -> T:
    if as_json:
        return call()
    with _err.status(message):
        return call()


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


def _ago(epoch: float | None) -> str:
    if not epoch:
        return "never"
    secs = max(0.0, time.time() - epoch)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs / size:.0f}{unit} ago"
    return f"{secs:.0f}s ago"


def _duration(secs: float | None) -> str:
    if secs is None:
        return "-"
    if secs >= 120:
        return f"{secs / 60:g}m"
    return f"{secs:g}s"


def _keep_alive(status: dict[str, Any]) -> str:
    """The keep-alive policy's current windows: ``fixed 5m``, ``learning 3/10 (5m)`` (the fixed timeout until then),
    ``adaptive: pre-warm +6.2s, keep +30s`` (after each request), ``adaptive: keep +45s``."""
    timeout = _duration(status.get("idle_timeout_secs"))
    policy = status.get("keep_alive")
    if not policy:  # a server from before keep-alive policies
        return timeout
    if policy["policy"] == "fixed":
        return f"fixed {timeout}"
    if not policy["pattern"]:
        return f"learning {policy['samples']}/{policy.get('min_samples', '?')} ({timeout})"
    keep = _span(policy["keep_alive_secs"])
    if policy.get("prewarm_after_secs") is None:
        return f"adaptive: keep +{keep}"
    return f"adaptive: pre-warm +{_span(policy['prewarm_after_secs'])}, keep +{keep}"


def _span(secs: float) -> str:
    """A learned window edge, three digits at most: ``6.2s``, ``45s``, ``11.5m``, ``2.5h``."""
    for unit, size in (("h", 7200), ("m", 120)):
        if secs >= size:
            return f"{secs / (size // 2):.3g}{unit}"
    return f"{secs:.3g}s"


def _memory(nbytes: int | None) -> str:
    return "-" if not nbytes else f"{nbytes / 2**20:.1f} MiB"


def _memory_cell(status: dict[str, Any]) -> str:
    """Measured memory as is; declared (memory_mb, where Triton's processes cannot be seen) marked so;
    a loaded model whose memory nobody knows says so rather than showing nothing."""
    source = status.get("memory_source", "measured")
    if status.get("memory_bytes") and source == "declared":
        return f"~{_memory(status['memory_bytes'])} (declared)"
    if not status.get("memory_bytes") and status.get("state") in ("ready", "unloading"):
        return "unknown"
    return _memory(status.get("memory_bytes"))


_STATE_STYLE = {"ready": "green", "loading": "yellow", "unloading": "yellow", "failed": "bold red"}


REASON_CHARS = 100  # a failed model's reason in the table; --json and `GET /v1/models/{id}` carry it whole


def _short_reason(reason: str) -> str:
    """The first line of a load failure (Triton appends its own traceback), cut to fit a table cell."""
    first = reason.strip().splitlines()[0] if reason.strip() else ""
    cut = len(first) > REASON_CHARS or first != reason.strip()
    shown = first[: REASON_CHARS - 1] + "…" if len(first) > REASON_CHARS else first
    return shown + (" (more: --json)" if cut else "")


def _state(status: dict[str, Any], *, in_table: bool = False) -> str:
    state = status["state"]
    text = f"[{_STATE_STYLE[state]}]{state}[/]" if state in _STATE_STYLE else state
    # reasons quote runtime errors such as "[snooze:oom] ...": not rich markup
    if state == "failed" and status.get("reason") and not in_table:
        return f"{text} ({escape(_short_reason(status['reason']))})"
    return text


def _gpu_memory(per_device: dict[str, int] | None) -> str:
    """``{"0": 512 MiB, "1": 0}`` -> ``gpu0 512.0 MiB``; GPUs holding nothing are left out."""
    held = sorted((int(device), n) for device, n in (per_device or {}).items() if n)
    return ", ".join(f"gpu{device} {_memory(n)}" for device, n in held) or "-"


def _nodes(per_node: dict[str, dict[str, Any]] | None) -> str:
    """A fleet's view: the nodes holding the model, each with its state when not ready and its memory."""
    if not per_node:
        return "-"
    cells = []
    for name, s in sorted(per_node.items()):
        state = "" if s.get("state") == "ready" else f" {s.get('state')}"
        memory = f" {_memory(s['memory_bytes'])}" if s.get("memory_bytes") else ""
        cells.append(f"{name}{state}{memory}")
    return ", ".join(cells)


def _status_table(models: list[dict[str, Any]]) -> Table:
    # the GPU column only where the server measures GPU memory: CPU-only servers keep the narrower table
    gpu = any(model["status"].get("gpu_memory_bytes") is not None for model in models)
    fleet = any("nodes" in model["status"] for model in models)  # a fleet API answered
    columns = ["model", "state", "instances", "last access", "keep-alive", "memory"]
    columns += ["GPU memory"] if gpu else []
    columns += ["nodes"] if fleet else []
    warm = any(model["status"].get("warmup") for model in models)  # servers before warm-up sources: no column
    columns += ["warm-up"] if warm else []
    table = Table(*columns, "last cold start")
    table.columns[0].no_wrap = True  # a model id is what users copy: never cut it
    for column in table.columns:  # narrow terminals wrap the cells, never cut a header's word
        column.min_width = max(len(word) for word in str(column.header).split())
    for model in models:
        s = model["status"]
        cold = s.get("last_cold_start_secs")
        table.add_row(
            model["id"], _state(s, in_table=True), str(s.get("instances", 0)), _ago(s.get("last_access")),
            _keep_alive(s), _memory_cell(s),
            *([_gpu_memory(s.get("gpu_memory_bytes"))] if gpu else []),
            *([_nodes(s.get("nodes"))] if fleet else []),
            *([_warmup_cell(s.get("warmup"))] if warm else []),
            "-" if cold is None else f"{cold:.2f}s",
        )
    return table


def _warmup_cell(line: str | None) -> str:
    """The warm-up's source (signature, learned, samples), "skipped" (the line below says why), or "-"."""
    if not line:
        return "-"
    return "skipped" if line.startswith("skipped") else line


def _failure_lines(models: list[dict[str, Any]]) -> list[str]:
    """Below the table, one line per failed model: its reason's first line (a table cell is too narrow); and
    one per model whose generated warm-up was skipped, with why."""
    failed = [
        f"{model['id']}: {_short_reason(model['status']['reason'])}"
        for model in models
        if model["status"].get("state") == "failed" and model["status"].get("reason")
    ]
    skipped = [
        f"{model['id']}: warmup: {model['status']['warmup']}"
        for model in models
        if str(model["status"].get("warmup") or "").startswith("skipped")
    ]
    return failed + skipped


def _runtime(client: Any) -> dict[str, Any]:
    """The processes models share (preloaded parents); empty where the server has no such route (a fleet API)."""
    from controlplane.api.client import ControlPlaneError

    try:
        return client.runtime()
    except ControlPlaneError:
        return {}


def _parent_line(parent: dict[str, Any]) -> str:
    failed = f", could not import {', '.join(parent['failed'])}" if parent.get("failed") else ""
    return (
        f"preloaded parent pid {parent['pid']} ({', '.join(parent.get('preload', []))}): "
        f"{_memory(parent.get('memory_bytes'))}, {parent.get('workers', 0)} worker(s){failed}"
    )


def _memory_line(runtime: dict[str, Any]) -> str | None:
    """Both counts of host memory: what the budget counts (models' Pss summed, tritonserver, parents) and Triton's
    cgroup's own usage, where the server reports them."""
    if "accounted_bytes" not in runtime:
        return None
    budget = runtime.get("budget_bytes")
    line = (
        f"memory: models {_memory(runtime.get('models_bytes'))}, counted in all {_memory(runtime['accounted_bytes'])}"
        f" of {_memory(budget) if budget is not None else 'no budget'} (proportional: shared pages split)"
    )
    if runtime.get("cgroup_usage_bytes") is not None:
        limit = runtime.get("cgroup_limit_bytes")
        line += f"; Triton's cgroup holds {_memory(runtime['cgroup_usage_bytes'])}"
        line += f" of {_memory(limit)} (evicts over {_memory(runtime.get('cgroup_ceiling_bytes'))})" if limit else ""
    return line


def _wake_queue_line(queue: dict[str, Any] | None) -> str | None:
    """Loads waiting to start, when there are any (``GET /v1/runtime``'s ``wake_queue``)."""
    if not queue or not queue.get("waiting"):
        return None
    waiting = ", ".join(f"{w['model']} ({w['waiting_for']}, {w['wait_secs']:.1f}s)" for w in queue["waiting"])
    return (
        f"wake queue: {queue['length']} load(s) waiting to start (a request waits at most "
        f"{queue['wait_bound_secs']:g}s for its load to start): {waiting}"
    )


def _upload_progress(as_json: bool) -> tuple[Progress | None, Callable[[int, int], None] | None]:
    if as_json:
        return None, None
    bar = Progress(
        TextColumn("uploading"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), console=_err, transient=True
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
        typer.Option("--idle-timeout-secs", "--idle-timeout",
                     help="Unload after this many idle seconds (idle_timeout_secs)"),
    ] = None,
    keep_alive: Annotated[
        str | None,
        typer.Option(metavar="fixed|adaptive", help="fixed: the idle timeout; adaptive: learned keep-alive and "
                     "pre-warm windows [default: fixed]"),
    ] = None,
    worker: Annotated[
        str | None,
        typer.Option(metavar="in-stub|preforked", help="Custom models: in the python-backend stub, or in a worker "
                     "forked from a parent that preloaded the framework [default: in-stub]"),
    ] = None,
    instances: Annotated[int | None, typer.Option(help="Instances loaded on wake-up")] = None,
    max_instances: Annotated[int | None, typer.Option(help="Upper bound for the autoscaler")] = None,
    memory_mb: Annotated[float | None, typer.Option(help="Declared memory footprint")] = None,
    param: Annotated[
        list[str] | None, typer.Option("--param", metavar="KEY=VALUE", help="Model param (repeatable)")
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
    from contextlib import ExitStack

    options = {
        "device": device, "max_batch_size": max_batch_size, "max_batch_delay_ms": max_batch_delay_ms,
        "idle_timeout_secs": idle_timeout, "keep_alive": keep_alive, "worker": worker, "instances": instances,
        "max_instances": max_instances, "memory_mb": memory_mb,
    }
    deployment = {k: v for k, v in options.items() if v is not None}
    if not server_path and not path.exists():
        raise fail(SnoozeError(f"{path}: no such file or folder",
                               hint="pass the package folder (it is packed for you) or an archive of it"), as_json)
    with _client(url, api_key, as_json) as client, ExitStack() as native:
        from controlplane.api.client import default_model_id

        client.live()  # an unreachable API is said first, before any conversion work
        name = model_id or default_model_id(path)
        existed = load and _published(client, name)
        if param:
            deployment["params"] = _parse_params(param)
        decision = None
        if prefer_native and path.is_dir() and not server_path:  # archives and server paths go as they are
            from controlplane.native import native_package

            def convert(progress: Callable[[str], None]) -> Any:
                batch = deployment.get("max_batch_size", 8)
                return native.enter_context(
                    native_package(path, max_batch_size=batch, params=deployment.get("params"), progress=progress)
                )

            if as_json:
                decision = convert(lambda _stage: None)
            else:
                with _err.status("looking for a native export") as spinner:
                    decision = convert(lambda stage: spinner.update(f"converting to ONNX: {stage}"))
            path = decision.publish_path
            if decision.converted:  # the params are baked into the exported graph
                deployment.pop("params", None)
        if server_path:
            detail = _waiting(f"publishing {name}", as_json, lambda: client.publish_path(path, name, **deployment))
        else:
            bar, update = _upload_progress(as_json)
            if bar is None:
                detail = client.publish_archive(path, name, **deployment)
            else:
                with bar:
                    detail = client.publish_archive(path, name, progress=update, **deployment)
        if load:
            detail["status"] = _load_or_withdraw(client, name, existed, as_json)
    if decision is not None:
        detail["conversion"] = {"native": decision.native, "converted": decision.converted, "reason": decision.reason}
    if as_json:
        print(json.dumps(detail))
        return
    _out.print(f"published [bold]{name}[/] ({detail['kind']}, {detail['backend']} backend)", highlight=False)
    for line in _publish_notes(detail, decision):
        _out.print(line, highlight=False, markup=False, soft_wrap=True)
    if load:
        _out.print(_status_table([detail]))


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
        status = _waiting(f"loading {name} (cold start)", as_json, lambda: client.load(name))
        if status.get("state") != "failed":
            return status
        error = ControlPlaneError(f"model '{name}' failed to load: {status.get('reason', '')}", status_code=503,
                                  code="load_failed")
    except ControlPlaneError as exc:
        error = exc
    if existed:
        note = f"model '{name}' stays published (it replaced the earlier one) in state 'failed'"
    else:
        client.delete(name)
        note = f"model '{name}' was not kept: publish --load keeps only a model that loads"
    hint = f"{error.hint}; " if error.hint else ""
    raise ControlPlaneError(error.message, hint=f"{hint}{note}; try it with `snoozectl check <folder>`",
                            status_code=error.status_code, code=error.code)


# Fallback stages that come after an export hook was found: the user asked for a native model.
_ATTEMPTED = ("torch", "export", "parity", "worker")


def _worth_saying(decision: Any) -> bool:
    """A conversion, or a fallback from one that was attempted; a plain custom model (no export hook),
    a native package or --no-convert is the ordinary case and says nothing (--json carries the reason)."""
    return bool(decision.converted or decision.stage in _ATTEMPTED)


def status(url: Url = DEFAULT_URL, api_key: ApiKey = None, as_json: AsJson = False) -> None:
    """Published models: state, instances, last access, keep-alive, memory, last cold start.

    \b
    Examples:
      snoozectl status
      snoozectl status --json --url http://10.0.0.5:8080 --api-key "$ADMIN_KEY"
    """
    with _client(url, api_key, as_json) as client:
        models = client.list()
        runtime = _runtime(client)
    if as_json:
        print(json.dumps(models))
    elif not models:
        _out.print("no models published (publish one with `snoozectl publish <folder>`)")
    else:
        _out.print(_status_table(models))
        for line in _failure_lines(models):
            _out.print(line, highlight=False, markup=False, soft_wrap=True)
        for parent in runtime.get("preloaded_parents", []):
            _out.print(_parent_line(parent), highlight=False)
        if memory := _memory_line(runtime):
            _out.print(memory, highlight=False, markup=False, soft_wrap=True)
        if queue := _wake_queue_line(runtime.get("wake_queue")):
            _out.print(queue, highlight=False, markup=False, soft_wrap=True)


def load(
    model_id: Annotated[str, typer.Argument(metavar="MODEL_ID", help="Model id")],
    instances: Annotated[int | None, typer.Option(help="Instances (default: the deployment's)")] = None,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    as_json: AsJson = False,
) -> None:
    """Load (wake) a model and wait until it is ready."""
    with _client(url, api_key, as_json) as client:
        result = _waiting(f"loading {model_id} (cold start)", as_json, lambda: client.load(model_id, instances))
    if as_json:
        print(json.dumps(result))
        return
    cold = result.get("last_cold_start_secs")
    took = f" in {cold:.2f}s" if cold is not None else ""
    _out.print(f"[bold]{model_id}[/] is {_state(result)}{took} ({result.get('instances', 0)} instance(s))")


def unload(
    model_id: Annotated[str, typer.Argument(metavar="MODEL_ID", help="Model id")],
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    as_json: AsJson = False,
) -> None:
    """Unload a model now; it wakes again on its next request."""
    with _client(url, api_key, as_json) as client:
        result = _waiting(f"unloading {model_id}", as_json, lambda: client.unload(model_id))
    if as_json:
        print(json.dumps(result))
    else:
        _out.print(f"[bold]{model_id}[/] is {_state(result)}")


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
    with _client(url, api_key, as_json) as client:
        client.delete(model_id)
    if as_json:
        print(json.dumps({"deleted": model_id}))
    else:
        _out.print(f"deleted [bold]{model_id}[/]")


def register(app: typer.Typer) -> None:
    """Add the control-API commands to the snoozectl app."""
    app.command()(publish)
    app.command()(status)
    app.command("list", hidden=True)(status)  # an old name of status, kept for scripts
    app.command()(load)
    app.command()(unload)
    app.command()(delete)
