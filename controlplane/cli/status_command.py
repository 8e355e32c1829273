"""`snoozectl status` (and its old name `list`): the published models as a table, then what they share."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.console import RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from controlplane.cli.control_client import DEFAULT_URL, ApiKey, Url, open_client
from controlplane.cli.output import AsJson, out_console
from controlplane.cli.status_summary import SUMMARY_OVER, fetch_summary, publishing_line, summary_lines, top_table
from controlplane.cli.status_watch import Watch


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
    ``adaptive: pre-warm +6.2s, keep +30s`` (after each request), ``adaptive: keep +45s``; ``, doze +22s`` for a
    model that can doze."""
    timeout = _duration(status.get("idle_timeout_secs"))
    policy = status.get("keep_alive")
    if not policy:  # a server from before keep-alive policies
        return timeout
    doze = f", doze +{_span(policy['doze_after_secs'])}" if policy.get("doze_after_secs") is not None else ""
    if policy["policy"] == "fixed":
        return f"fixed {timeout}{doze}"
    if not policy["pattern"]:
        return f"learning {policy['samples']}/{policy.get('min_samples', '?')} ({timeout}){doze}"
    keep = _span(policy["keep_alive_secs"])
    if policy.get("prewarm_after_secs") is None:
        return f"adaptive: keep +{keep}{doze}"
    return f"adaptive: pre-warm +{_span(policy['prewarm_after_secs'])}, keep +{keep}{doze}"


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


def state_text(status: dict[str, Any], *, in_table: bool = False) -> str:
    state = status["state"]
    text = f"[{_STATE_STYLE[state]}]{state}[/]" if state in _STATE_STYLE else state
    # reasons quote runtime errors such as "[snooze:oom] ...": not rich markup
    if state == "failed" and status.get("reason") and not in_table:
        return f"{text} ({escape(_short_reason(status['reason']))})"
    if state == "ready" and status.get("level") == "dozing":  # loaded, its workers ended: its next request forks one
        return f"{text} [dim](dozing)[/]"
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


def status_table(models: list[dict[str, Any]]) -> Table:
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
            model["id"],
            state_text(s, in_table=True),
            str(s.get("instances", 0)),
            _ago(s.get("last_access")),
            _keep_alive(s),
            _memory_cell(s),
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


def _note_lines(models: list[dict[str, Any]]) -> list[str]:
    """Below the table, what publishing decided for each model: a Triton folder's owned fields, limits of its kind."""
    lines = []
    for model in models:
        notes = model.get("notes") or []
        if notes:
            lines.append(f"{model['id']} ({model.get('kind', '?')}):")
            lines += [f"  - {note}" for note in notes]
    return lines


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


def status(
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
    as_json: AsJson = False,
    show_all: Annotated[bool, typer.Option("--all", help=f"A row per model even over {SUMMARY_OVER} models")] = False,
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C, with what changed: states, levels, wakes")
    ] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.2, help="Seconds between refreshes (--watch)")] = 2.0,
    count: Annotated[int, typer.Option("--count", min=0, help="Refreshes before --watch stops; 0: until Ctrl-C")] = 0,
) -> None:
    """Published models: state, instances, last access, keep-alive, memory, last cold start.

    Over 50 models: a summary (counts by state and kind, memory, the largest and most recently used models,
    publishing's progress); --all for the table of every model, --json for every model's status.

    \b
    Examples:
      snoozectl status
      snoozectl status --all
      snoozectl status --json --url http://10.0.0.5:8080 --api-key "$ADMIN_KEY"
      snoozectl status --watch               # redrawn every 2 s, with what changed
      snoozectl status --watch --json        # one JSON line per refresh
    """
    with open_client(url, api_key, as_json) as client:
        if watch:
            _watch(client, show_all=show_all, interval=interval, count=count, as_json=as_json)
            return
        summary = None if as_json or show_all else fetch_summary(client)
        if summary is not None and summary["total"] > SUMMARY_OVER:
            _print_summary(summary, _runtime(client))
            return
        models = client.list()
        runtime = _runtime(client)
    if summary is not None and (line := publishing_line(summary.get("publishing"))):
        out_console.print(line, highlight=False, markup=False, soft_wrap=True)
    if as_json:
        print(json.dumps(models))
    elif not models:
        out_console.print("no models published (publish one with `snoozectl publish <folder>`)")
    else:
        out_console.print(status_table(models))
        for line in _failure_lines(models):
            out_console.print(line, highlight=False, markup=False, soft_wrap=True)
        for line in _note_lines(models):
            out_console.print(line, highlight=False, markup=False, soft_wrap=True)
        _print_runtime(runtime)


def _runtime_lines(runtime: dict[str, Any]) -> list[str]:
    lines = [_parent_line(parent) for parent in runtime.get("preloaded_parents", [])]
    return lines + [line for line in (_memory_line(runtime), _wake_queue_line(runtime.get("wake_queue"))) if line]


def _print_runtime(runtime: dict[str, Any]) -> None:
    for line in _runtime_lines(runtime):
        out_console.print(line, highlight=False, markup=False, soft_wrap=True)


def _watch(client: Any, *, show_all: bool, interval: float, count: int, as_json: bool) -> None:
    """``status --watch``: the table (a summary over SUMMARY_OVER models), refreshed, with what changed."""

    def read() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return client.list(), _runtime(client)

    def render(models: list[dict[str, Any]], runtime: dict[str, Any]) -> list[RenderableType]:
        if len(models) > SUMMARY_OVER and not show_all:
            shown: list[RenderableType] = [Text(line) for line in summary_lines(client.summary())]
        else:
            shown = [status_table(models)] if models else [Text("no models published")]
        return shown + [Text(line) for line in _runtime_lines(runtime)]

    Watch(read, render, interval=interval, count=count, as_json=as_json).run()


def _print_summary(summary: dict[str, Any], runtime: dict[str, Any]) -> None:
    for line in summary_lines(summary):
        out_console.print(line, highlight=False, markup=False, soft_wrap=True)
    if summary.get("largest"):
        out_console.print(top_table("largest loaded models", summary["largest"]))
    if summary.get("recent"):
        out_console.print(top_table("most recently used models", summary["recent"]))
    _print_runtime(runtime)
