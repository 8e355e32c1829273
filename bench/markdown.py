"""The pieces every section's markdown is built from: a table, durations in milliseconds, a JSON block."""

from __future__ import annotations

import json
from typing import Any


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def ms(s: float) -> str:
    return f"{1000 * s:.0f} ms"


def ms2(s: float) -> str:
    return f"{1000 * s:.2f} ms"


def json_block(data: Any, limit: int = 4000) -> str:
    return json.dumps(data, indent=1)[:limit]
