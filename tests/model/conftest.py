"""The fast tier's world: the real ``LifecycleManager`` over the fake Triton (``harness.lifecycle_world``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.lifecycle_world import LifecycleWorld


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LifecycleWorld]:
    logging.getLogger("snoozeml").setLevel(logging.CRITICAL)
    w = LifecycleWorld(tmp_path, monkeypatch=monkeypatch)
    yield w
    w.close()  # answers every call and checks the invariants once more
    logging.getLogger("snoozeml").setLevel(logging.NOTSET)
