"""The snapshot contract's parts that need no Triton: environment, control folder, fingerprint diff."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from pathlib import Path

import pytest
from pydantic import SecretStr
from rich.console import Console

from controlplane.settings import Settings
from controlplane.snapshot import (
    CONTROL_DIR_ENV,
    READY_FOR_SNAPSHOT,
    RESTORE_COMPLETE,
    RESTORE_FAILED,
    STANDBY_ENV,
    TRITON_RESTORE_READY,
    ControlDir,
    SnapshotEntrypoint,
    SnapshotError,
    control_dir_from_env,
    standby_from_env,
)
from controlplane.snapshot_fingerprint import FINGERPRINT_FORMAT, _settings_part, fingerprint_differences


def test_control_dir_must_be_set_and_writable(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError) as err:
        control_dir_from_env({})
    assert CONTROL_DIR_ENV in err.value.message and CONTROL_DIR_ENV in (err.value.hint or "")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SnapshotError) as err:
        control_dir_from_env({CONTROL_DIR_ENV: str(blocker / "control")})
    assert f"{CONTROL_DIR_ENV}={blocker / 'control'} is not a writable folder" in err.value.message
    made = control_dir_from_env({CONTROL_DIR_ENV: str(tmp_path / "new" / "control")})
    assert made.is_dir() and list(made.iterdir()) == []


@pytest.mark.parametrize(
    ("value", "expected"), [("", False), ("0", False), ("false", False), ("1", True), ("yes", True)]
)
def test_standby_flag(value: str, expected: bool) -> None:
    assert standby_from_env({STANDBY_ENV: value}) is expected


def test_standby_flag_rejects_garbage() -> None:
    with pytest.raises(SnapshotError, match=STANDBY_ENV):
        standby_from_env({STANDBY_ENV: "maybe"})


def test_clear_stale_removes_only_the_workloads_files(tmp_path: Path) -> None:
    control = ControlDir(tmp_path)
    for name in (READY_FOR_SNAPSHOT, TRITON_RESTORE_READY, RESTORE_FAILED, RESTORE_COMPLETE):
        (tmp_path / name).write_text("old")
    assert sorted(control.clear_stale()) == sorted([READY_FOR_SNAPSHOT, TRITON_RESTORE_READY, RESTORE_FAILED])
    assert [p.name for p in tmp_path.iterdir()] == [RESTORE_COMPLETE]  # the agent's file stays
    assert control.clear_stale() == []


def test_write_is_atomic_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    control = ControlDir(tmp_path)
    control.write_json("x.json", {"a": 1})
    control.write_json("x.json", {"a": 2})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SnapshotError, match="bad.json is not valid JSON"):
        control.read_json("bad.json")
    assert control.read_json("absent.json") is None


def test_settings_part_hashes_secrets() -> None:
    part = _settings_part(Settings(api_keys=[SecretStr("top-secret")], http_port=9000, log_level="debug"))
    assert part["http_port"] == 9000 and "log_level" not in part
    assert part["api_keys"][0].startswith("sha256:") and "top-secret" not in json.dumps(part)


def _fp(parts: dict) -> dict:
    return {"format": FINGERPRINT_FORMAT, "digest": json.dumps(parts, sort_keys=True), "parts": parts}


def test_fingerprint_differences_name_the_part() -> None:
    captured = _fp(
        {
            "settings": {"http_port": 8000, "api_keys": ["sha256:aa"]},
            "published": {"m": {"config": "1"}, "gone": {"config": "2"}},
        }
    )
    current = _fp(
        {
            "settings": {"http_port": 9000, "api_keys": ["sha256:bb"]},
            "published": {"m": {"config": "3"}, "new": {"config": "4"}},
        }
    )
    assert fingerprint_differences(captured, captured) == []
    assert fingerprint_differences(captured, current) == [
        "published.gone.config: present at capture, gone now",
        "published.m.config: changed since the capture",
        "published.new.config: new since the capture",
        "settings.api_keys: changed since the capture",
        "settings.http_port: 8000 at capture, 9000 now",
    ]
    assert "format" in fingerprint_differences({**captured, "format": 0}, current)[0]


async def test_standby_stays_inert_after_restore_complete(tmp_path: Path) -> None:
    """The placeholder builds no settings and no stack, before or after restore-complete; it waits to be
    cancelled (serve_snapshot cancels it on SIGTERM and exits 0)."""

    def make_settings() -> Settings:
        raise AssertionError("a restore placeholder must not prepare a stack")

    out = io.StringIO()
    entry = SnapshotEntrypoint(ControlDir(tmp_path), make_settings, None, console=Console(file=out, width=200))
    (tmp_path / READY_FOR_SNAPSHOT).write_text("stale")
    waiting = asyncio.create_task(entry.stand_by())
    await asyncio.sleep(0.5)
    (tmp_path / RESTORE_COMPLETE).write_text("")
    await asyncio.sleep(1.0)  # five polls
    assert not waiting.done() and entry.stack is None
    assert "restore-complete seen" in out.getvalue() and "inert" in out.getvalue()
    assert sorted(p.name for p in tmp_path.iterdir()) == [RESTORE_COMPLETE]  # the stale file went, nothing came
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    await entry.stop()
