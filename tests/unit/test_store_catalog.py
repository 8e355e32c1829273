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
