"""Triton model folders as a package kind, without a server: detection, the config kept as written with the fields
snoozeml owns (each said in a note), what is refused and why, auto-complete at publish, and the rendered folder."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from controlplane.errors import InvalidPackageError
from controlplane.render import DEPLOYMENT_FILE, FULL_TARGET, embedded_target, render_model
from controlplane.spec import DeploymentSpec, Device, PackageKind, discover, resolve
from controlplane.spec.triton_folder import USER_MODULE, triton_config_json
from controlplane.store import PublishedModel
from controlplane.store.transactions import write_model
from controlplane.upload import extract_package
from harness import triton_folders as tf

ENSEMBLE_CONFIG = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
ensemble_scheduling {
  step [
    { model_name: "counter" model_version: -1 input_map { key: "x" value: "x" } output_map { key: "y" value: "mid" } },
    { model_name: "versioned" model_version: 2 input_map { key: "x" value: "mid" } output_map { key: "y" value: "y" } }
  ]
}
"""


def _config(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def _published(tmp_path: Path, deployment: DeploymentSpec, target=None) -> PublishedModel:
    rendered = render_model(resolve(deployment), target or embedded_target())
    return PublishedModel.read(write_model(rendered, tmp_path / "repo"))


def _rendered_config(folder: Path) -> model_config_pb2.ModelConfig:
    return _config((folder / "config.pbtxt").read_text())


# ---------------------------------------------------------------------------------------------
# Detection


def test_a_triton_repository_is_discovered_folder_by_folder_and_each_takes_its_kind(tmp_path: Path) -> None:
    repo = tf.write_repository(tmp_path / "models", tmp_path / "calls")
    (repo / "pipeline" / "1").mkdir(parents=True)
    (repo / "pipeline" / "config.pbtxt").write_text(ENSEMBLE_CONFIG)
    found = {d.id: d for d in discover(repo)}
    assert set(found) == {
        "calc", "auto_batch", "auto_nobatch", "stream", "counter", "poison", "versioned", "mlp", "notes", "pipeline",
    }  # fmt: skip
    kinds = {name: resolve(d).package.kind for name, d in found.items() if name != "notes"}
    assert kinds["mlp"] is PackageKind.TRITON_ONNX and kinds["pipeline"] is PackageKind.TRITON_ENSEMBLE
    assert {kinds[n] for n in ("calc", "auto_batch", "auto_nobatch", "stream", "counter", "versioned")} == {
        PackageKind.TRITON_PYTHON
    }
    with pytest.raises(InvalidPackageError, match=r"notes: not a model package.*not a Triton model folder"):
        resolve(found["notes"])


def test_a_models_folder_that_is_a_triton_model_folder_is_its_one_deployment(tmp_path: Path) -> None:
    folder = tf.write_calc(tmp_path / "calc")
    [deployment] = discover(folder)
    assert deployment.id == "calc" and resolve(deployment).package.kind is PackageKind.TRITON_PYTHON


def test_a_version_folder_with_a_model_file_is_enough_to_be_a_triton_folder(tmp_path: Path) -> None:
    folder = tf.write_auto_batch(tmp_path / "auto")
    assert not (folder / "config.pbtxt").exists()
    assert resolve(DeploymentSpec(id="auto", path=folder)).package.kind is PackageKind.TRITON_PYTHON


# ---------------------------------------------------------------------------------------------
# The config: kept as written, owned fields changed and said


def test_a_python_models_config_is_kept_but_for_its_name_which_is_the_id(tmp_path: Path) -> None:
    folder = tf.write_calc(tmp_path / "calc")
    published = _published(tmp_path, DeploymentSpec(id="calculator", path=folder))
    written, served = _config(tf.CALC_CONFIG), _rendered_config(published.path)
    del served.parameters["snooze_publish"]  # the store's token of this publish
    assert served.name == "calculator"
    served.name = written.name
    assert served == written
    assert published.kind is PackageKind.TRITON_PYTHON and published.backend == "python"
    assert any("name: 'calculator' (config.pbtxt says 'calc')" in note for note in published.notes), published.notes
    assert any("request_timeout_secs does not apply" in note for note in published.notes)
    dep = published.deployment
    assert (dep.max_batch_size, dep.max_batch_delay_ms, dep.instances, dep.device) == (8, 1.0, 1, Device.CPU)
    assert [(t.name, t.datatype, t.dims) for t in published.inputs] == [
        ("A", "FP32", [4]), ("B", "FP32", [4]), ("LABEL", "BYTES", [1]),
    ]  # fmt: skip


def test_a_python_models_files_are_moved_beside_the_wrapper_unchanged(tmp_path: Path) -> None:
    folder = tf.write_calc(tmp_path / "calc")
    version = _published(tmp_path, DeploymentSpec(id="calc", path=folder)).path / "1"
    assert (version / f"{USER_MODULE}.py").read_bytes() == (folder / "1" / "model.py").read_bytes()
    assert (version / "labels.py").read_bytes() == (folder / "1" / "labels.py").read_bytes()
    wrapper = (version / "model.py").read_text()
    assert "wrapped_model(__package__" in wrapper and f'"{USER_MODULE}"' in wrapper
    assert (version / "python_backend" / "triton_wrapper.py").is_file()
    assert (version / "python_backend" / "journal.py").is_file()


def test_an_onnx_folder_keeps_its_batching_and_instances_on_the_python_runner(tmp_path: Path) -> None:
    folder = tf.write_mlp(tmp_path / "mlp")
    published = _published(tmp_path, DeploymentSpec(id="mlp", path=folder))
    served = _rendered_config(published.path)
    assert served.backend == "python" and not served.platform
    assert served.max_batch_size == 16
    assert [(g.kind, g.count) for g in served.instance_group] == [(model_config_pb2.ModelInstanceGroup.KIND_CPU, 2)]
    assert list(served.dynamic_batching.preferred_batch_size) == [4, 8]
    assert served.dynamic_batching.max_queue_delay_microseconds == 500
    assert published.kind is PackageKind.TRITON_ONNX and published.backend == "python"
    assert published.deployment.instances == 2 and published.deployment.max_instances >= 2
    assert any(n.startswith("backend: python (config.pbtxt says platform onnxruntime_onnx)") for n in published.notes)
    runtime = json.loads((published.path / "1" / "snooze_runtime.json").read_text())
    assert (runtime["kind"], runtime["onnx_file"], runtime["max_batch_size"]) == ("onnx", "model.onnx", 16)
    assert (published.path / "1" / "package" / "model.onnx").is_file()


def test_an_onnx_folder_on_a_triton_with_onnxruntime_is_served_as_written(tmp_path: Path) -> None:
    folder = tf.write_mlp(tmp_path / "mlp")
    published = _published(tmp_path, DeploymentSpec(id="mlp", path=folder), FULL_TARGET)
    served = _rendered_config(published.path)
    del served.parameters["snooze_publish"]
    assert served == _config(tf.MLP_CONFIG)
    assert published.backend == "onnxruntime" and (published.path / "1" / "model.onnx").is_file()
    assert not any(note.startswith("backend") for note in published.notes)


def test_an_ensemble_keeps_its_empty_version_folder_and_names_its_steps(tmp_path: Path) -> None:
    folder = tmp_path / "pipeline"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(ENSEMBLE_CONFIG)
    published = _published(tmp_path, DeploymentSpec(id="pipeline", path=folder))
    assert published.kind is PackageKind.TRITON_ENSEMBLE and published.backend == "ensemble"
    assert published.ensemble_steps == (("counter", ""), ("versioned", "2"))
    assert (published.path / "1").is_dir() and not any((published.path / "1").iterdir())
    assert _rendered_config(published.path).platform == "ensemble"


def test_versions_follow_the_version_policy(tmp_path: Path) -> None:
    folder = tf.write_versioned(tmp_path / "versioned")
    published = _published(tmp_path, DeploymentSpec(id="versioned", path=folder))
    assert published.versions == ("1", "2")
    assert (published.path / "1" / f"{USER_MODULE}.py").is_file() and (published.path / "2" / "model.py").is_file()
    config = folder / "config.pbtxt"
    config.write_text(config.read_text().replace("version_policy { all { } }", ""))
    latest = _published(tmp_path / "latest", DeploymentSpec(id="versioned", path=folder))
    assert latest.versions == ("2",)  # Triton's default: the latest one
    config.write_text(config.read_text() + "version_policy { specific { versions: [ 1, 3 ] } }\n")
    with pytest.raises(InvalidPackageError, match=r"version_policy serves version\(s\) \[3\]"):
        resolve(DeploymentSpec(id="versioned", path=folder))


def test_the_config_json_is_tritons_every_plain_field_and_numbers_as_numbers() -> None:
    as_json = triton_config_json(_config(tf.STREAM_CONFIG))
    assert as_json["max_batch_size"] == 0 and as_json["input"][0]["dims"] == [1]
    assert as_json["model_transaction_policy"] == {"decoupled": True}


# ---------------------------------------------------------------------------------------------
# Deployment settings and refusals


def test_deployment_settings_of_the_lifecycle_apply_and_those_the_config_says_are_refused(tmp_path: Path) -> None:
    folder = tf.write_calc(tmp_path / "calc")
    spec = resolve(DeploymentSpec(id="calc", path=folder, idle_timeout_secs=7, keep_alive="adaptive", memory_mb=64))
    assert (spec.deployment.idle_timeout_secs, spec.deployment.keep_alive, spec.deployment.memory_mb) == (
        7, "adaptive", 64,
    )  # fmt: skip
    with pytest.raises(InvalidPackageError, match=r"max_batch_size \(config: max_batch_size\).*config\.pbtxt"):
        resolve(DeploymentSpec(id="calc", path=folder, max_batch_size=4))
    with pytest.raises(InvalidPackageError, match=r"instances \(config: instance_group\.count\)"):
        resolve(DeploymentSpec(id="calc", path=folder, instances=2))
    with pytest.raises(InvalidPackageError, match=r"preforked"):
        resolve(DeploymentSpec(id="calc", path=folder, worker="preforked"))
    with pytest.raises(InvalidPackageError, match=r"params \['scale'\].*parameters"):
        resolve(DeploymentSpec(id="calc", path=folder, params={"scale": 2}))


def test_a_reserved_parameter_is_refused_naming_it_and_why(tmp_path: Path) -> None:
    folder = tf.write_calc(tmp_path / "calc")
    config = folder / "config.pbtxt"
    config.write_text(config.read_text() + 'parameters { key: "snooze_publish" value { string_value: "mine" } }\n')
    with pytest.raises(InvalidPackageError, match=r"\['snooze_publish'\].*snoozeml's own.*tell a publish") as info:
        resolve(DeploymentSpec(id="calc", path=folder))
    assert "rename" in (info.value.hint or "")


def test_a_sequence_longer_than_the_idle_timeout_is_refused(tmp_path: Path) -> None:
    folder = tf.write_counter(tmp_path / "seq")
    config = folder / "config.pbtxt"
    text = config.read_text().replace("dynamic_batching { }", "")
    config.write_text(text + "sequence_batching { max_sequence_idle_microseconds: 60000000 }\n")
    with pytest.raises(InvalidPackageError, match=r"max_sequence_idle_microseconds"):
        resolve(DeploymentSpec(id="seq", path=folder, idle_timeout_secs=30))
    spec = resolve(DeploymentSpec(id="seq", path=folder, idle_timeout_secs=90))
    assert spec.deployment.sequence is not None and spec.deployment.sequence.max_sequence_idle_secs == 60


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda f: (f / "1" / "model.py").unlink(), r"1/model\.py: missing \(version 1 is served"),
        (lambda f: (f / "1" / "python_backend").mkdir(), r"snoozeml writes this name into the version folder"),
        (
            lambda f: (f / "config.pbtxt").write_text('backend: "pytorch"\n'),
            r"backend 'pytorch': snoozeml serves Triton model folders of the python, onnxruntime and tensorrt",
        ),
        (lambda f: (f / "config.pbtxt").write_text("max_batch_size: eight\n"), r"not a valid Triton ModelConfig"),
        (
            lambda f: (f / "config.pbtxt").unlink(),
            r"no config\.pbtxt, and model\.py defines no auto_complete_config",
        ),
    ],
)
def test_a_broken_triton_folder_is_refused_naming_the_file(tmp_path: Path, change, words: str) -> None:
    folder = tf.write_calc(tmp_path / "calc")
    change(folder)
    with pytest.raises(InvalidPackageError, match=words):
        resolve(DeploymentSpec(id="calc", path=folder))


# ---------------------------------------------------------------------------------------------
# Auto-complete, once, at publish


def test_auto_complete_writes_the_config_of_a_folder_without_one(tmp_path: Path) -> None:
    folder = tf.write_auto_batch(tmp_path / "auto_batch")
    published = _published(tmp_path, DeploymentSpec(id="auto_batch", path=folder))
    served = _rendered_config(published.path)
    assert served.name == "auto_batch" and served.backend == "python" and served.max_batch_size == 4
    assert served.HasField("dynamic_batching")
    assert [(t.name, list(t.dims)) for t in served.input] == [("X", [3])]
    assert any(
        note.startswith("config written at publish by the model's auto_complete_config") for note in published.notes
    )
    assert not list(folder.rglob("__pycache__"))  # nothing left in the user's folder


def test_auto_complete_completes_a_partial_config_and_keeps_what_it_says(tmp_path: Path) -> None:
    folder = tf.write_auto_nobatch(tmp_path / "auto_nobatch")
    served = _rendered_config(_published(tmp_path, DeploymentSpec(id="auto_nobatch", path=folder)).path)
    assert served.max_batch_size == 0 and not served.HasField("dynamic_batching")
    assert served.parameters["factor"].string_value == "3"
    assert [t.name for t in served.output] == ["Y"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (
            "raise RuntimeError('no shapes today')",
            r"(?s)auto_complete_config failed.*model\.py.*RuntimeError: no shapes today",
        ),
        ("return 'a config'", r"returned str, not the pb_utils\.ModelConfig"),
        ("config.set_max_batch_size(2)\nreturn config", r"config\.pbtxt sets max_batch_size 8, above the 2"),
        ("import time\ntime.sleep(30)", r"did not finish within 2 s"),
    ],
)
def test_a_failing_auto_complete_is_refused_naming_the_model_and_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, words: str
) -> None:
    monkeypatch.setattr("controlplane.auto_complete.AUTO_COMPLETE_TIMEOUT_SECS", 2.0)
    folder = tmp_path / "broken"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 8\n')
    (folder / "1" / "model.py").write_text(
        "class TritonPythonModel:\n"
        "    @staticmethod\n"
        "    def auto_complete_config(config):\n"
        + "".join(f"        {line}\n" for line in body.splitlines())
        + "\n    def execute(self, requests):\n        return []\n"
    )
    with pytest.raises(InvalidPackageError, match=words) as info:
        resolve(DeploymentSpec(id="broken", path=folder))
    assert "model 'broken'" in info.value.message and str(folder / "1" / "model.py") in info.value.message


# ---------------------------------------------------------------------------------------------
# Uploads


def test_an_uploaded_folder_holding_only_its_version_folder_keeps_it(tmp_path: Path) -> None:
    folder = tf.write_auto_batch(tmp_path / "auto_batch")
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        tar.add(folder / "1", arcname="1")
    archive.seek(0)
    root = extract_package(archive, tmp_path / "extracted", max_bytes=1 << 20)
    assert (root / "1" / "model.py").is_file()
    published = _published(tmp_path, DeploymentSpec(id="auto_batch", path=root))
    assert json.loads((published.path / DEPLOYMENT_FILE).read_text())["kind"] == "triton-python"
