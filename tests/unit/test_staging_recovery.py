"""What a control plane killed mid-publish leaves in the staging folder is cleaned up at the next start.

The window between the two renames of a republish (old version moved out, new one not yet in) is too
short to hit with a kill, so its leftover is built by hand here.
"""

from __future__ import annotations

import os
import subprocess
import sys

from controlplane.store.transactions import _writer, recover_staging


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_writers_leftovers_are_removed_and_a_retired_model_put_back(tmp_path):
    repo = tmp_path / "model_repository"
    staging = tmp_path / ".model_repository.staging"
    (repo / "kept").mkdir(parents=True)
    gone = dead_pid()
    # Killed between the renames: the old version sits in retired/, the repository lacks the model.
    (staging / f"swapped.{gone}.abc123" / "retired").mkdir(parents=True)
    (staging / f"swapped.{gone}.abc123" / "retired" / "config.pbtxt").write_text('name: "swapped"')
    (staging / f"swapped.{gone}.abc123" / "model").mkdir()
    # Killed while writing a new version of a model that is still in the repository.
    (staging / f"kept.{gone}.def456" / "model" / "1").mkdir(parents=True)
    (staging / f"kept.{gone}.def456" / "retired").mkdir()
    # A live writer's folder and a name this module does not write are left alone.
    (staging / f"busy.{os.getpid()}.ghi789").mkdir()
    (staging / "something-else").mkdir()

    removed = recover_staging(repo)

    assert sorted(removed) == [f"kept.{gone}.def456", f"swapped.{gone}.abc123"]
    assert (repo / "swapped" / "config.pbtxt").read_text() == 'name: "swapped"'
    assert sorted(p.name for p in repo.iterdir()) == ["kept", "swapped"]
    assert sorted(p.name for p in staging.iterdir()) == [f"busy.{os.getpid()}.ghi789", "something-else"]


def test_a_shared_repository_keeps_other_hosts_writers(tmp_path):
    """Fleet nodes share one repository: a staging folder is this host's to clean only if this host wrote it."""
    repo = tmp_path / "model_repository"
    staging = tmp_path / ".model_repository.staging"
    repo.mkdir()
    host = _writer().rpartition(".")[0]
    gone = dead_pid()
    (staging / f"mine@{host}.{gone}.abc123" / "model").mkdir(parents=True)
    (staging / f"live@{host}.{os.getpid()}.def456").mkdir()
    # Another node's writer: its pid means nothing here, whether or not a process has it on this host.
    (staging / f"theirs@other-node.{gone}.ghi789" / "model").mkdir(parents=True)

    assert recover_staging(repo) == [f"mine@{host}.{gone}.abc123"]
    assert sorted(p.name for p in staging.iterdir()) == [
        f"live@{host}.{os.getpid()}.def456",
        f"theirs@other-node.{gone}.ghi789",
    ]


def test_a_repository_at_a_mount_root_stages_inside_itself(tmp_path, monkeypatch):
    """In the containers the repository is a volume's mount root: its parent is another filesystem, where a
    rename into the repository would not be atomic. Staging then lives in a hidden folder inside it."""
    from controlplane import render
    from controlplane.spec import DeploymentSpec, resolve
    from controlplane.store import ModelStore, transactions
    from controlplane.store.transactions import INNER_STAGING
    from harness.serve import write_package

    monkeypatch.setattr(transactions, "_same_filesystem", lambda a, b: False)
    repo = tmp_path / "models"
    store = ModelStore(repo, render.embedded_target())
    store.publish(resolve(DeploymentSpec(id="m", path=write_package(tmp_path / "pkg"))))
    assert (repo / INNER_STAGING).is_dir() and store.ids() == ["m"]
    host = _writer().rpartition(".")[0]
    (repo / INNER_STAGING / f"m@{host}.{dead_pid()}.abc123" / "model").mkdir(parents=True)
    assert len(recover_staging(repo)) == 1
    assert [p.name for p in (repo / INNER_STAGING).iterdir() if p.is_dir()] == []
