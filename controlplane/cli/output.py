"""What every snoozectl command prints the same way: errors (message + fix, or JSON) on one console."""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from controlplane.errors import SnoozeError

# Piped (a CI log, a file, grep) Rich would fold tables at 80 columns, cutting rows apart: wide enough for
# whole rows instead, unless COLUMNS says otherwise. A terminal keeps its own width.
PIPED_WIDTH = 240


def console_for(*, stderr: bool = False) -> Console:
    console = Console(stderr=stderr)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(stderr=stderr, width=PIPED_WIDTH)
    return console


out_console = console_for()
err_console = console_for(stderr=True)

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
