"""Every folder the control plane hands to Envoy, Triton or a child is absolute, whatever the caller
passed: each of those runs with a working directory of its own (Envoy in <work_dir>/envoy)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.gateway.wake_lua import held_log_path, ready_dir_path
from controlplane.settings import Settings


def test_relative_paths_from_flags_env_and_the_default_are_resolved_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("SNOOZE_WORK_DIR", "SNOOZE_MODEL_REPOSITORY", "SNOOZE_JOURNAL_DIR"):
        monkeypatch.delenv(name, raising=False)
    default = Settings()
    assert default.work_dir == tmp_path / ".snooze"
    assert default.repository == tmp_path / ".snooze" / "model_repository"
    flags = Settings(work_dir=Path(".snooze"), model_repository=Path("repo"), journal_dir=Path("j/../journal"))
    assert (flags.work_dir, flags.model_repository, flags.journal_dir) == (
        tmp_path / ".snooze",
        tmp_path / "repo",
        tmp_path / "journal",
    )
    monkeypatch.setenv("SNOOZE_WORK_DIR", "work")
    from_env = Settings()
    # what the Envoy bootstrap names: absolute, so Envoy's own cwd (<work_dir>/envoy) does not matter
    assert held_log_path(from_env) == tmp_path / "work" / "gateway-held.log"
    assert ready_dir_path(from_env).is_absolute()
    monkeypatch.chdir("/")
    assert from_env.work_dir == tmp_path / "work"  # a later chdir changes nothing
