"""serve beside an external Triton makes the journal folder it was given when the shared volume is fresh.

compose and Kubernetes mount an empty tmpfs/emptyDir at /run/snooze with SNOOZE_JOURNAL_DIR=/run/snooze/journal
in both containers. The stubs only write into that folder, so nothing made it: the control plane said
"request journal: none" and a request that met a dead model process could not be told apart (tests/compose
found it).
"""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from controlplane.settings import Settings
from controlplane.stack import ServingStack
from controlplane.triton import processes as triton_processes


@pytest.fixture
def seen_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tritonserver visible in this PID namespace (what the shared namespace gives the control plane)."""
    monkeypatch.setattr(triton_processes.TritonProcesses, "server", lambda self: SimpleNamespace(pid=4242))


async def test_a_missing_journal_folder_is_made(tmp_path: Path, seen_triton: None) -> None:
    journal = tmp_path / "run" / "journal"  # the fresh volume: /run/snooze exists, its journal folder not
    journal.parent.mkdir(mode=0o700)
    out = io.StringIO()
    stack = ServingStack(Settings(journal_dir=journal), console=Console(file=out, width=300))
    _, found = await stack._observe_triton("http://127.0.0.1:8100")
    assert found == journal and journal.is_dir()
    assert f"request journal: {journal}" in out.getvalue()


async def test_an_unusable_journal_folder_is_said(tmp_path: Path, seen_triton: None) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder's parent should be: cannot be made
    out = io.StringIO()
    stack = ServingStack(Settings(journal_dir=blocked / "journal"), console=Console(file=out, width=300))
    _, found = await stack._observe_triton("http://127.0.0.1:8100")
    assert found is None
    assert "request journal: none" in out.getvalue()
