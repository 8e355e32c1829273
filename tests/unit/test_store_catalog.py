"""The store's catalog: one scan serves the listing and the follower of other writers (``ModelStore.changes``)."""

from __future__ import annotations

import json
from pathlib import Path

from controlplane.render import embedded_target
from controlplane.spec import DeploymentSpec, resolve
from controlplane.store import ModelStore

MANIFEST = {
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [2]}],
    "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
}
MODEL_PY = "class Model:\n    def load(self, model_dir, device):\n        pass\n\n    def predict(self, inputs):\n" \
    "        return {'y': inputs['x']}\n"  # fmt: skip


def _package(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "snooze_model.py").write_text(MODEL_PY)
    (root / "snooze_model.json").write_text(json.dumps(MANIFEST))
    return root


def test_changes_reports_another_writers_republish_and_delete_and_the_listing_follows(tmp_path: Path) -> None:
    package = _package(tmp_path / "pkg")
    here = ModelStore(tmp_path / "repo", embedded_target())
    for model_id in ("a", "b", "c"):
        here.publish(resolve(DeploymentSpec(id=model_id, path=package)))
    assert here.changes() == ([], [])  # its own writes are not news
    other = ModelStore(tmp_path / "repo", embedded_target())
    republished = other.publish(resolve(DeploymentSpec(id="a", path=package)))
    other.delete("b")
    other.publish(resolve(DeploymentSpec(id="d", path=package)))

    assert here.changes() == (["a"], ["b"])  # a new model needs nothing: a request wakes it
    listed = here.list(max_age=3600)  # the follower's scan brought the catalog up to date
    assert [m.id for m in listed] == ["a", "c", "d"]
    assert listed[0].publish == republished.publish
    assert here.changes() == ([], [])


def test_a_published_record_keeps_its_warmup_source(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "repo", embedded_target())
    model = store.publish(resolve(DeploymentSpec(id="m", path=_package(tmp_path / "pkg"))))
    assert model.warmup_source is not None  # recorded at publish ("" where the config has no warm-up)
    assert model.warmup_source in ("", "signature", "samples")


def test_a_read_trusts_the_catalog_as_long_as_the_followers_scans_are_apart(tmp_path: Path) -> None:
    """A listing or a sweep may read a catalog as old as the follower lets it become: at tens of thousands of models a
    scan takes seconds and the follower spaces its scans by ten of them; a read that scanned every 30 s regardless
    took seconds inside a request (a page of 100 at 50,000 models: p99 3.3 s)."""
    store = ModelStore(tmp_path / "repo", embedded_target())
    store.scan_secs = 0.01  # a small repository: the floor holds
    assert store.trusted_age(30.0) == 30.0
    store.scan_secs = 4.0  # about 50,000 folders on this VM
    assert store.trusted_age(30.0) == 80.0
    package = _package(tmp_path / "pkg")
    ModelStore(tmp_path / "repo", embedded_target()).publish(resolve(DeploymentSpec(id="a", path=package)))
    scans = 0
    real = store._scan

    def counted() -> dict[str, tuple[int, int]]:
        nonlocal scans
        scans += 1
        return real()

    store._scan = counted  # type: ignore[method-assign]
    assert store.list(max_age=store.trusted_age(30.0)) == []  # the scan at its start is recent: no scan inline
    assert scans == 0
    assert [m.id for m in store.list(max_age=0.0)] == ["a"] and scans == 1
