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


def test_a_killed_writers_staged_folder_goes_and_its_retired_version_comes_back(tmp_path):
    """The staged folder is the model's folder itself (``<model>@<host>.<pid>.<random>.staged``), and the version a
    republish moved out where the kernel has no atomic swap is ``....retired`` beside it."""
    repo = tmp_path / "model_repository"
    staging = tmp_path / ".model_repository.staging"
    (repo / "kept").mkdir(parents=True)
    host, gone, live = _writer().rpartition(".")[0], dead_pid(), os.getpid()
    # Killed between the renames: the old version moved out, the new one not yet in.
    (staging / f"swapped@{host}.{gone}.abc123.retired").mkdir(parents=True)
    (staging / f"swapped@{host}.{gone}.abc123.retired" / "config.pbtxt").write_text('name: "swapped"')
    (staging / f"swapped@{host}.{gone}.abc123.staged" / "1").mkdir(parents=True)
    # Killed while writing a new version of a model still in the repository; and after a swap, before the old
    # version it held went.
    (staging / f"kept@{host}.{gone}.def456.staged" / "1").mkdir(parents=True)
    (staging / f"kept@{host}.{gone}.fed654.retired").mkdir()
    # A live writer's.
    (staging / f"busy@{host}.{live}.ghi789.staged").mkdir()
    (staging / f"busy@{host}.{live}.ghi789.retired").mkdir()

    removed = recover_staging(repo)

    assert sorted(removed) == sorted(
        f"{m}@{host}.{gone}.{r}" for m, r in [("swapped", "abc123.retired"), ("swapped", "abc123.staged"),
                                               ("kept", "def456.staged"), ("kept", "fed654.retired")]
    )  # fmt: skip
    assert (repo / "swapped" / "config.pbtxt").read_text() == 'name: "swapped"'
    assert sorted(p.name for p in repo.iterdir()) == ["kept", "swapped"] and not list((repo / "kept").iterdir())
    assert sorted(p.name for p in staging.iterdir()) == [
        f"busy@{host}.{live}.ghi789.retired",
        f"busy@{host}.{live}.ghi789.staged",
    ]


def test_a_republish_without_an_atomic_swap_replaces_the_folder_and_leaves_nothing_staged(tmp_path, monkeypatch):
    """Where the kernel or file system has no RENAME_EXCHANGE: the old version moves out (``.retired``), the new one
    in, and the old one goes."""
    from controlplane import render
    from controlplane.spec import DeploymentSpec, resolve
    from controlplane.store import ModelStore, transactions
    from harness.serve import write_package

    monkeypatch.setattr(transactions, "_exchange", lambda a, b: False)
    repo = tmp_path / "models"
    store = ModelStore(repo, render.embedded_target())
    package = write_package(tmp_path / "pkg")
    store.publish(resolve(DeploymentSpec(id="m", path=package, max_batch_size=2)))
    store.publish(resolve(DeploymentSpec(id="m", path=package, max_batch_size=4)))
    assert "max_batch_size: 4" in (repo / "m" / "config.pbtxt").read_text()
    staging = transactions.staging_root(repo)
    assert [p.name for p in staging.iterdir() if p.is_dir()] == []


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
