"""A large publishing run hands part of its packages to a helper process (``controlplane.store.stager``): it stages,
the control plane commits. What a run publishes, refuses and leaves behind is the same as in one process, whatever
happens to the helper (it dies, it hangs, the run is stopped)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from controlplane.publishing import Publishing, publish_all
from controlplane.render import embedded_target
from controlplane.spec import DeploymentSpec
from controlplane.store import ModelStore, stager
from controlplane.store.transactions import staging_root
from harness.serve import write_package

pytestmark = pytest.mark.timeout(120)


def _packages(root: Path, n: int, *, broken: str | None = None) -> list[DeploymentSpec]:
    deployments = []
    for i in range(n):
        folder = write_package(root / f"m{i:03d}")
        if folder.name == broken:
            (folder / "snooze_model.json").write_text('{"inputs": [{"name": "x", "datatype": "FP33", "dims": [2]}]}')
        deployments.append(DeploymentSpec(id=folder.name, path=folder))
    return deployments


def _staged_left(repo: Path) -> list[str]:
    return sorted(p.name for p in staging_root(repo).iterdir() if p.is_dir())


class Submits:
    """Counts what the control plane hands the helper; ``then`` runs on the call numbered ``at``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int = 0, then=None) -> None:
        self.count, self.pids = 0, set()
        self.helper: stager.Stager | None = None
        real = stager.Stager.submit

        def submit(helper: stager.Stager, deployment: DeploymentSpec, digest: str) -> None:
            self.count += 1
            self.pids.add(helper.proc.pid)
            self.helper = helper
            if self.count == at and then is not None:
                then(helper)
            real(helper, deployment, digest)

        monkeypatch.setattr(stager.Stager, "submit", submit)


def test_a_run_with_a_helper_publishes_and_refuses_what_one_process_does(tmp_path: Path, monkeypatch) -> None:
    deployments = _packages(tmp_path / "packages", 40, broken="m007")
    store = ModelStore(tmp_path / "repo", embedded_target())
    submits = Submits(monkeypatch)
    progress, said = Publishing(), []
    progress.plan(deployments)
    publish_all(store, progress, say=said.append, helper_from=1)
    assert submits.count >= 1 and len(submits.pids) == 1  # the helper staged its share
    assert (progress.published, list(progress.failed)) == (39, ["m007"])
    assert "FP33" in progress.failed["m007"] and any("refused m007" in line for line in said)
    assert store.ids() == [d.id for d in deployments if d.id != "m007"]
    assert sorted(p.name for p in store.repository.iterdir()) == store.ids()
    for model in store.list():  # each folder whole, with its own record
        assert (model.path / "config.pbtxt").is_file() and model.source_hash
    assert _staged_left(store.repository) == []
    assert not any(os.path.exists(f"/proc/{pid}") for pid in submits.pids)  # the helper ended with the run


def test_a_helper_that_dies_mid_run_leaves_its_packages_to_the_control_plane(tmp_path: Path, monkeypatch, caplog):
    """Killed once it has answered (an answer waits in its pipe) while it holds more."""
    from controlplane import publishing

    deployments = _packages(tmp_path / "packages", 30)
    store = ModelStore(tmp_path / "repo", embedded_target())
    submits = Submits(monkeypatch)
    killed: list[int] = []
    real_stage = publishing.stage

    def stage(*args, **kwargs):  # the control plane's own next package, once the helper has answered
        helper = submits.helper
        if helper is not None and not killed:
            deadline = time.monotonic() + 60
            while not helper.ready() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert helper.ready(), "the helper never answered"
            os.kill(helper.proc.pid, signal.SIGKILL)
            killed.append(helper.proc.pid)
        return real_stage(*args, **kwargs)

    monkeypatch.setattr(publishing, "stage", stage)
    progress = Publishing()
    progress.plan(deployments)
    with caplog.at_level(logging.WARNING, logger="snoozeml.publishing"):
        publish_all(store, progress, say=lambda line: None, helper_from=1)
    assert killed and any("publishing helper gone" in r.message for r in caplog.records)
    assert (progress.published, progress.failed) == (30, {})
    assert store.ids() == [d.id for d in deployments]
    assert _staged_left(store.repository) == []


def test_a_helper_that_stops_answering_is_ended_and_its_packages_published_here(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(stager, "ANSWER_SECS", 0.5)
    deployments = _packages(tmp_path / "packages", 20)
    store = ModelStore(tmp_path / "repo", embedded_target())
    stopped: list[int] = []

    def freeze(helper: stager.Stager) -> None:
        os.kill(helper.proc.pid, signal.SIGSTOP)  # alive, answering nothing
        stopped.append(helper.proc.pid)

    Submits(monkeypatch, at=3, then=freeze)
    progress = Publishing()
    progress.plan(deployments)
    publish_all(store, progress, say=lambda line: None, helper_from=1)
    assert (progress.published, progress.failed) == (20, {})
    assert store.ids() == [d.id for d in deployments]
    assert not os.path.exists(f"/proc/{stopped[0]}")  # killed, and reaped
    assert _staged_left(store.repository) == []


def test_a_model_in_the_helpers_hands_counts_as_waiting_until_it_is_committed(tmp_path: Path, monkeypatch) -> None:
    """A request for it waits for it (``Publishing.arrival``) rather than getting a 404."""
    deployments = _packages(tmp_path / "packages", 12)
    store = ModelStore(tmp_path / "repo", embedded_target())
    progress = Publishing()
    seen: list[tuple[str, bool, bool]] = []

    def check(helper: stager.Stager) -> None:
        for held in helper.held:
            seen.append((held.id, progress.waiting(held.id), store.exists(held.id)))

    Submits(monkeypatch, at=4, then=check)
    progress.plan(deployments)
    publish_all(store, progress, say=lambda line: None, helper_from=1)
    assert seen and all(waiting and not published for _, waiting, published in seen)
    assert not progress.waiting(seen[0][0]) and store.exists(seen[0][0])


def test_a_run_stopped_midway_ends_its_helper_and_leaves_no_staged_folder(tmp_path: Path, monkeypatch) -> None:
    """A stop (Ctrl-C) does not wait for the helper's answers: it is ended, and what it staged goes."""
    deployments = _packages(tmp_path / "packages", 60)
    store = ModelStore(tmp_path / "repo", embedded_target())
    progress = Publishing()
    submits = Submits(monkeypatch, at=1, then=lambda helper: progress.stop())
    progress.plan(deployments)
    worker = threading.Thread(
        target=publish_all, args=(store, progress), kwargs={"say": lambda line: None, "helper_from": 1}
    )
    worker.start()
    worker.join(60)
    assert not worker.is_alive()
    # not waited for: what the helper held waits for the next start, as the packages never taken do
    assert progress.published < 60 and progress.failed == {} and len(store.ids()) == progress.published
    assert sorted(p.name for p in store.repository.iterdir()) == store.ids()  # each one whole
    assert _staged_left(store.repository) == []
    assert not any(os.path.exists(f"/proc/{pid}") for pid in submits.pids)


def test_answers_that_arrived_together_are_each_taken_without_waiting(tmp_path: Path, monkeypatch) -> None:
    """The helper's answers are read from the pipe itself: answers that came in together are not left in a buffer of
    the control plane, where ``ready`` would not see them and ``take`` would wait ``ANSWER_SECS`` for the last."""
    monkeypatch.setattr(stager, "ANSWER_SECS", 2.0)
    deployments = _packages(tmp_path / "packages", stager.DEPTH)
    store = ModelStore(tmp_path / "repo", embedded_target())
    helper = stager.Stager.start(store.repository, store.target)
    assert helper is not None
    try:
        for deployment in deployments:
            helper.submit(deployment, "digest")
        deadline = time.monotonic() + 60
        while len(list(staging_root(store.repository).glob("*.staged"))) < len(deployments):
            assert time.monotonic() < deadline, "the helper staged nothing"
            time.sleep(0.05)
        time.sleep(0.5)  # every answer written into the pipe
        started = time.monotonic()
        taken = [helper.take() for _ in deployments]
        assert time.monotonic() - started < 1.0
        assert [d.id for d, staged, failed in taken] == [d.id for d in deployments]
        assert all(staged is not None and staged.is_dir() and failed is None for _, staged, failed in taken)
    finally:
        helper.close()
