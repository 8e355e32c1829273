"""`serve --models` publishing in the background: progress, a restart that adopts unchanged packages, a request
for a model still waiting (503 naming it, and it goes first)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from controlplane.gateway.handlers import ModelAnswers
from controlplane.gateway.triton_words import UNKNOWN_MODEL, NotYetPublishedError, UnknownModelError
from controlplane.publishing import Publishing, publish_all
from controlplane.render import embedded_target
from controlplane.settings import Settings
from controlplane.spec import DeploymentSpec, resolve
from controlplane.store import ModelStore

MODEL_PY = "class Model:\n    def load(self, model_dir, device):\n        pass\n\n    def predict(self, inputs):\n" \
    "        return {'y': inputs['x']}\n"  # fmt: skip
MANIFEST = {
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [2]}],
    "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
}


def _packages(root: Path, n: int) -> list[DeploymentSpec]:
    deployments = []
    for i in range(n):
        folder = root / f"m{i}"
        folder.mkdir(parents=True)
        (folder / "snooze_model.py").write_text(MODEL_PY)
        (folder / "snooze_model.json").write_text(json.dumps(MANIFEST))
        deployments.append(DeploymentSpec(id=folder.name, path=folder))
    return deployments


def _run(store: ModelStore, deployments: list[DeploymentSpec]) -> tuple[Publishing, list[str]]:
    progress, republished = Publishing(), []
    progress.plan(deployments)
    publish_all(store, progress, say=lambda line: None, on_published=republished.append)
    return progress, republished


def test_a_restart_adopts_unchanged_packages_and_republishes_only_the_changed_one(tmp_path: Path) -> None:
    deployments = _packages(tmp_path / "packages", 3)
    store = ModelStore(tmp_path / "repo", embedded_target())
    first, _ = _run(store, deployments)
    assert first.describe()["published"] == 3 and not first.in_progress
    tokens = {m.id: m.publish for m in store.list()}
    (tmp_path / "packages" / "m1" / "snooze_model.py").write_text(MODEL_PY + "# changed\n")

    restarted = ModelStore(tmp_path / "repo", embedded_target())  # a new process, the work dir kept
    second, republished = _run(restarted, deployments)
    assert (second.published, second.unchanged) == (1, 2)
    assert republished == ["m1"]  # a loaded copy of it reloads
    now = {m.id: m.publish for m in restarted.list()}
    assert now["m0"] == tokens["m0"] and now["m2"] == tokens["m2"] and now["m1"] != tokens["m1"]


def test_a_broken_package_is_reported_and_the_others_are_published(tmp_path: Path) -> None:
    deployments = _packages(tmp_path / "packages", 2)
    (tmp_path / "packages" / "m0" / "snooze_model.json").write_text("{not json")
    store = ModelStore(tmp_path / "repo", embedded_target())
    progress, _ = _run(store, deployments)
    assert store.ids() == ["m1"]
    assert list(progress.failed) == ["m0"] and "snooze_model.json" in progress.failed["m0"]


def test_a_model_a_request_asks_for_is_published_next(tmp_path: Path) -> None:
    progress = Publishing()
    progress.plan(_packages(tmp_path, 3))
    assert progress.waiting("m2") and not progress.waiting("elsewhere")
    first = progress.next()
    assert first is not None and first.id == "m2"
    assert [d.id for d in iter(progress.next, None)] == ["m0", "m1"]


def test_a_request_for_a_model_still_waiting_gets_a_retryable_answer_naming_it(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "repo", embedded_target())
    progress = Publishing()
    progress.plan(_packages(tmp_path / "packages", 2))
    answers = ModelAnswers(None, store, Settings(work_dir=tmp_path / "work"), publishing=progress)  # type: ignore[arg-type]
    with pytest.raises(NotYetPublishedError) as caught:
        answers.published("m1")
    error = caught.value
    assert error.status_code == 503 and error.retry_after and error.retry_after > 0
    assert error.message.startswith(f"{UNKNOWN_MODEL}: 'm1'") and "waiting to be published" in error.message
    with pytest.raises(UnknownModelError):  # never part of this run: Triton's own 404
        answers.published("nobody")


async def test_a_request_waits_for_its_model_which_is_published_first(tmp_path: Path) -> None:
    deployments = _packages(tmp_path / "packages", 3)
    store = ModelStore(tmp_path / "repo", embedded_target())
    progress = Publishing()
    progress.plan(deployments)
    order: list[str] = []
    worker = asyncio.create_task(
        asyncio.to_thread(publish_all, store, progress, say=lambda line: None, on_published=order.append)
    )
    await progress.arrival("m2", timeout=30)
    assert store.exists("m2")
    await worker
    assert store.ids() == ["m0", "m1", "m2"] and not progress.in_progress


def test_a_restarted_store_takes_unchanged_records_from_the_saved_catalog(tmp_path: Path) -> None:
    deployments = _packages(tmp_path / "packages", 2)
    store = ModelStore(tmp_path / "repo", embedded_target())
    _run(store, deployments)  # saves the catalog when done
    (tmp_path / "packages" / "m1" / "snooze_model.py").write_text(MODEL_PY + "# changed\n")
    other = ModelStore(tmp_path / "repo", embedded_target())
    other.publish(resolve(deployments[1]))  # written since the catalog was saved

    restarted = ModelStore(tmp_path / "repo", embedded_target())
    models = {m.id: m for m in restarted.list()}
    assert models["m1"].publish == other.get("m1").publish  # read again: its identity changed
    assert models["m0"].publish == store.get("m0").publish
    assert [m.id for m in restarted.list()] == ["m0", "m1"]


def test_a_request_for_a_refused_package_says_why_in_tritons_words(tmp_path: Path) -> None:
    deployments = _packages(tmp_path / "packages", 1)
    (tmp_path / "packages" / "m0" / "snooze_model.json").write_text("{not json")
    store = ModelStore(tmp_path / "repo", embedded_target())
    progress, _ = _run(store, deployments)
    answers = ModelAnswers(None, store, Settings(work_dir=tmp_path / "work"), publishing=progress)  # type: ignore[arg-type]
    with pytest.raises(UnknownModelError) as caught:
        answers.published("m0")
    assert caught.value.message.startswith(f"{UNKNOWN_MODEL}: 'm0' is not found")
    assert "refused its package" in caught.value.message and "snooze_model.json" in caught.value.message
