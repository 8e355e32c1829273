"""`snoozectl status` with many models: a summary (counts by state and kind, memory, the largest and the most recently
used models, publishing's progress) instead of one row per model; `--all` or `--json` for every model."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from controlplane.api.client import ControlPlaneError

# Over this many models, `snoozectl status` shows the summary (unless --all or --json).
SUMMARY_OVER = 50
SUMMARY_TOP = 10


def fetch_summary(client: Any) -> dict[str, Any] | None:
    """The server's summary, or None where it has none (a server before it, or a fleet's API)."""
    try:
        return client.summary(SUMMARY_TOP)
    except ControlPlaneError as e:
        if e.status_code in (404, 405):
            return None
        raise


def publishing_line(p: dict[str, Any] | None) -> str | None:
    """``publishing: 4,200/10,000 packages (...)`` while `serve --models` publishes in the background."""
    if not p or not p.get("in_progress"):
        return None
    failed = f", {len(p['failed'])} failed" if p.get("failed") else ""
    return (
        f"publishing: {p['done']:,}/{p['total']:,} packages ({p['published']:,} written, {p['unchanged']:,} "
        f"unchanged{failed}) in {p['elapsed_secs']:.1f}s; a request for one still waiting publishes it next"
    )


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The counts, as lines."""
    order = ["ready", "loading", "unloading", "unloaded", "failed"]
    states = summary.get("states", {})
    counts = ", ".join(f"{states[s]:,} {s}" for s in [*order, *sorted(set(states) - set(order))] if states.get(s))
    kinds = ", ".join(f"{n:,} {kind}" for kind, n in sorted(summary.get("kinds", {}).items()))
    lines = [f"{summary['total']:,} models: {counts or 'none'} ({kinds or 'no kinds'})"]
    lines.append(f"memory held by loaded models: {summary.get('memory_bytes', 0) / 2**20:.1f} MiB")
    if line := publishing_line(summary.get("publishing")):
        lines.append(line)
    lines.append("every model: `snoozectl status --all` (a table) or `--json`")
    return lines


def top_table(title: str, models: list[dict[str, Any]]) -> Table:
    """The largest or the most recently used models."""
    from controlplane.cli.status_command import _ago, _memory

    table = Table("model", "state", "memory", "last access", title=title)
    table.columns[0].no_wrap = True
    for m in models:
        table.add_row(m["id"], m["state"], _memory(m.get("memory_bytes")), _ago(m.get("last_access")))
    return table
