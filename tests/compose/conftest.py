"""tests/compose: the figures each check measured (wake time, recovery times, memory seen), listed at the end
of the run (`make compose-test`) and written to COMPOSE_FIGURES (default .snooze/compose-figures.txt)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

FIGURES = pytest.StashKey[list[str]]()
ROOT = Path(__file__).resolve().parents[2]


def pytest_configure(config: pytest.Config) -> None:
    config.stash[FIGURES] = []


@pytest.fixture(scope="session")
def figure(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Record one measured figure (also printed at once, for -s)."""
    lines = request.config.stash[FIGURES]

    def record(line: str) -> None:
        print(f"\n{line}")
        lines.append(f"{os.environ.get('PYTEST_CURRENT_TEST', '').split('::')[-1].split(' ')[0]}: {line}")

    return record


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:  # noqa: ANN001 (pytest's type)
    lines = config.stash.get(FIGURES, [])
    if not lines:
        return
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    terminalreporter.section("compose figures")
    for line in [*lines, f"(uptime at the end: {load})"]:
        terminalreporter.write_line(line)
    out = Path(os.environ.get("COMPOSE_FIGURES", ROOT / ".snooze" / "compose-figures.txt"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join([*lines, f"(uptime at the end: {load})"]) + "\n")
    terminalreporter.write_line(f"(written to {out})")
