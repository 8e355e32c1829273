"""What every snoozectl command prints the same way: errors (message + fix, or JSON) on one console."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from controlplane.errors import SnoozeError

out_console = Console()
err_console = Console(stderr=True)

AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout")]


def fail(exc: SnoozeError, as_json: bool = False, extra: dict[str, Any] | None = None) -> typer.Exit:
    """Report a user-facing error and return the exit to raise: `error:`/`fix:` on stderr, or one
    JSON object `{"ok": false, "error", "code", "hint", ...}` on stdout for scripts."""
    if as_json:
        print(json.dumps({"ok": False, **exc.to_dict(), **(extra or {})}, default=str))
    else:
        err_console.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False, soft_wrap=True)
        if exc.hint:
            err_console.print(f"[bold]fix:[/] {escape(exc.hint)}", highlight=False, soft_wrap=True)
    return typer.Exit(1)
