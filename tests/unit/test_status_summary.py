"""`snoozectl status` over many models: the summary's lines, and the publishing progress line."""

from __future__ import annotations

import io

from rich.console import Console

from controlplane.cli.status_summary import publishing_line, summary_lines, top_table

SUMMARY = {
    "total": 10000,
    "states": {"unloaded": 9990, "ready": 8, "failed": 2},
    "kinds": {"custom": 9000, "onnx": 1000},
    "memory_bytes": 300 * 2**20,
    "largest": [{"id": "big", "state": "ready", "memory_bytes": 200 * 2**20, "last_access": None}],
    "recent": [],
    "publishing": {
        "in_progress": True, "total": 10000, "done": 4200, "published": 4000, "unchanged": 200,
        "failed": {"bad": "x"}, "elapsed_secs": 12.5,
    },
}  # fmt: skip


def test_the_summary_counts_states_in_lifecycle_order_and_says_how_to_see_every_model() -> None:
    lines = summary_lines(SUMMARY)
    assert lines[0] == "10,000 models: 8 ready, 9,990 unloaded, 2 failed (9,000 custom, 1,000 onnx)"
    assert "300.0 MiB" in lines[1]
    assert lines[2].startswith("publishing: 4,200/10,000 packages (4,000 written, 200 unchanged, 1 failed)")
    assert "--all" in lines[-1] and "--json" in lines[-1]


def test_no_publishing_line_once_publishing_is_done() -> None:
    assert publishing_line({**SUMMARY["publishing"], "in_progress": False}) is None  # type: ignore[dict-item]
    assert publishing_line(None) is None


def test_the_largest_models_table_names_each_with_its_memory() -> None:
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(top_table("largest", SUMMARY["largest"]))  # type: ignore[arg-type]
    assert "big" in out.getvalue() and "200.0 MiB" in out.getvalue()
