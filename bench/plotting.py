"""The sections' plots: matplotlib without a display, loaded only when a report draws one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DPI = 80


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display; imported on first use: discovering sections draws
    nothing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> str:
    """Write ``fig`` to ``path`` and close it; the file name, as the report links it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    pyplot().close(fig)
    return path.name
