"""Rendering: golden configs per backend, Triton schema validation, atomic writes."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2

from controlplane.errors import InvalidPackageError
from controlplane.render import (
    DEPLOYMENT_FILE,
    FULL_TARGET,
    embedded_target,
    parse_config,
    render_model,
)
from controlplane.spec import DeploymentSpec, resolve
from controlplane.store import render_repository
from controlplane.store.transactions import write_model
from harness.serve import tree_digest
from python_backend.spec import SPEC_FILE

GOLDEN = Path(__file__).parent / "golden"
ROOT = Path(__file__).resolve().parents[2]


def custom_pkg(folder: Path, **manifest: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "snooze_model.py").write_text("class Model:\n    pass\n")
    (folder / "weights").mkdir(exist_ok=True)
    (folder / "weights" / "w.bin").write_bytes(b"\x00\x01")
    base = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "dims": [3]},
            {"name": "text", "datatype": "BYTES", "dims": [-1]},
        ],
        "outputs": [{"name": "y", "datatype": "INT64", "dims": [1]}],
    }
    base.update(manifest)
    (folder / "snooze_model.json").write_text(json.dumps(base))
    return folder


def onnx_pkg(folder: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    folder.mkdir(parents=True, exist_ok=True)
    graph = helper.make_graph(
        [helper.make_node("Relu", ["in"], ["out"])],
        "g",
        [helper.make_tensor_value_info("in", TensorProto.FLOAT, ["batch", 5])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 5])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(folder / "model.onnx"))
    return folder


def plan_pkg(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.plan").write_bytes(b"not-a-real-engine")
    manifest = {
        "inputs": [{"name": "in", "datatype": "FP16", "dims": [5]}],
        "outputs": [{"name": "out", "datatype": "FP16", "dims": [5]}],
    }
    (folder / "snooze_model.json").write_text(json.dumps(manifest))
    return folder


def check_golden(name: str, text: str) -> None:
    golden = GOLDEN / name
    if os.environ.get("SNOOZE_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"rendered config differs from {golden} (SNOOZE_UPDATE_GOLDEN=1 rewrites)"


def test_python_backend_config_matches_golden(tmp_path: Path) -> None:
    spec = resolve(
        DeploymentSpec(
            id="custom-net",
            path=custom_pkg(tmp_path / "p"),
            max_batch_size=16,
            max_batch_delay_ms=2.5,
            instances=2,
            max_instances=3,
        )
    )
    rendered = render_model(spec, embedded_target())
    check_golden("python.pbtxt", rendered.config_text)
    dests = {rel for _, rel in rendered.copies}
    assert {"1/package/snooze_model.py", "1/package/weights/w.bin", "1/python_backend/triton_model.py"} <= dests
    runtime = json.loads(rendered.writes[f"1/{SPEC_FILE}"])
    assert runtime["kind"] == "custom" and runtime["max_batch_size"] == 16
    assert runtime["inputs"][1] == {"name": "text", "datatype": "BYTES", "dims": [-1]}


@pytest.mark.parametrize("kind", ["custom", "onnx-native"])
def test_models_of_one_signature_share_a_parse_and_each_config_is_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Configs that differ only by the model's name are parsed once (``render._rendered_config``): each model's
    config and text must be exactly what parsing its own rendered text gives (the fallback path, forced below)."""
    from controlplane import render

    package, target = (
        (custom_pkg(tmp_path / "p"), embedded_target()) if kind == "custom" else (onnx_pkg(tmp_path / "o"), FULL_TARGET)
    )
    specs = [
        resolve(DeploymentSpec(id=i, path=package, max_batch_size=b))
        for i, b in (("a", 8), ("b.2", 8), ("c_3-x", 8), ("d", 4))
    ]
    shared = [render_model(spec, target) for spec in specs]
    monkeypatch.setattr(render, "_NAME_PLACEHOLDER", "")  # never once in a text: every config parsed on its own
    own = [render_model(spec, target) for spec in specs]
    for spec, a, b in zip(specs, shared, own, strict=True):
        assert a.config == b.config and a.config_text == b.config_text and a.config.name == spec.id
    assert [r.config.max_batch_size for r in shared] == [8, 8, 8, 4]


def test_onnx_renders_native_on_full_and_python_on_embedded(tmp_path: Path) -> None:
    spec = resolve(DeploymentSpec(id="relu", path=onnx_pkg(tmp_path / "o"), max_batch_size=4))
    full = render_model(spec, FULL_TARGET)
    check_golden("onnxruntime.pbtxt", full.config_text)
    assert [rel for _, rel in full.copies] == ["1/model.onnx"]
    embedded = render_model(spec, embedded_target())
    assert embedded.backend == "python" and embedded.config.backend == "python"
    assert json.loads(embedded.writes[f"1/{SPEC_FILE}"])["kind"] == "onnx"
    # same signature and batching on both targets
    assert [i.dims for i in full.config.input] == [i.dims for i in embedded.config.input]
    assert full.config.max_batch_size == embedded.config.max_batch_size == 4


def test_an_onnx_model_with_string_tensors_publishes_without_a_manifest_as_bytes(tmp_path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    folder = tmp_path / "labels"
    folder.mkdir()
    node = helper.make_node("LabelEncoder", ["words"], ["upper"], domain="ai.onnx.ml", keys_strings=["a"],
                            values_strings=["A"], default_string="?")  # fmt: skip
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("words", TensorProto.STRING, ["batch", 3])],
        [helper.make_tensor_value_info("upper", TensorProto.STRING, ["batch", 3])],
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 2)]
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(folder / "model.onnx"))
    spec = resolve(DeploymentSpec(id="labels", path=folder))
    for rendered in (render_model(spec, FULL_TARGET), render_model(spec, embedded_target())):
        tensors = [*rendered.config.input, *rendered.config.output]
        assert [(t.name, t.data_type, list(t.dims)) for t in tensors] == [
            ("words", model_config_pb2.TYPE_STRING, [3]),
            ("upper", model_config_pb2.TYPE_STRING, [3]),
        ]
    runtime = json.loads(rendered.writes[f"1/{SPEC_FILE}"])
    assert [t["datatype"] for t in runtime["inputs"] + runtime["outputs"]] == ["BYTES", "BYTES"]


def test_onnx_tensorrt_accelerator(tmp_path: Path) -> None:
    deployment = DeploymentSpec(id="relu", path=onnx_pkg(tmp_path / "o"), device="gpu", onnx_tensorrt=True, fp16=True)
    spec = resolve(deployment)
    config = render_model(spec, FULL_TARGET).config
    accel = config.optimization.execution_accelerators.gpu_execution_accelerator[0]
    assert accel.name == "tensorrt" and accel.parameters["precision_mode"] == "FP16"


def test_tensorrt_plan_golden_and_refused_on_embedded(tmp_path: Path) -> None:
    spec = resolve(DeploymentSpec(id="engine", path=plan_pkg(tmp_path / "t"), device="gpu", max_batch_size=8))
    check_golden("tensorrt.pbtxt", render_model(spec, FULL_TARGET).config_text)
    with pytest.raises(InvalidPackageError, match="tensorrt backend and a GPU"):
        render_model(spec, embedded_target())


def test_non_batching_model_has_no_dynamic_batcher(tmp_path: Path) -> None:
    spec = resolve(DeploymentSpec(id="m", path=custom_pkg(tmp_path / "p"), max_batch_size=0))
    config = render_model(spec, embedded_target()).config
    assert config.max_batch_size == 0 and not config.HasField("dynamic_batching")


def test_python_requirement_checked_against_target(tmp_path: Path) -> None:
    spec = resolve(DeploymentSpec(id="m", path=custom_pkg(tmp_path / "p", python=">=3.11")))
    with pytest.raises(InvalidPackageError, match="needs Python >=3.11.*runs 3.10"):
        render_model(spec, FULL_TARGET)


def test_parse_config_rejects_invalid_text() -> None:
    with pytest.raises(InvalidPackageError, match="not a valid Triton ModelConfig"):
        parse_config('name: "x"\nmax_batch_size: "eight"\n', where="test")


def test_write_is_atomic_and_replaces_whole_folder(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    spec = resolve(DeploymentSpec(id="m", path=custom_pkg(tmp_path / "p")))
    write_model(render_model(spec, embedded_target()), repo)
    (repo / "m" / "stale.txt").write_text("left from before")
    write_model(render_model(spec, embedded_target()), repo)
    assert not (repo / "m" / "stale.txt").exists()
    assert (repo / "m" / DEPLOYMENT_FILE).is_file()
    assert sorted(p.name for p in repo.iterdir()) == ["m"]  # staging lives outside the repository


@pytest.mark.parametrize(
    ("code", "why"), [(errno.EMLINK, "Too many links"), (errno.EXDEV, "Invalid cross-device link")]
)
def test_a_runtime_file_that_cannot_be_linked_where_it_is_installed_is_linked_from_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, why: str
) -> None:
    """ext4 allows 65,000 links a file: once snoozeml's runtime files have none left (repositories left behind by
    tests and benches reached it here), each model linked a copy made in the staging root instead of copying the file
    into every model. The same where snoozeml is installed on another file system than the repository (EXDEV: the
    control plane's image and the repository's volume), where every model copied all 21 runtime files before."""
    from controlplane.store import transactions
    from python_backend import PACKAGE_DIR

    real_link = os.link

    def link(src: object, dst: object, *args: object, **kwargs: object) -> None:
        if os.path.dirname(str(src)) == PACKAGE_DIR:
            raise OSError(code, why, str(src))
        real_link(src, dst, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(transactions, "_link_targets", {})
    package = custom_pkg(tmp_path / "p")
    repo = tmp_path / "repo"
    for model_id in ("a", "b"):
        write_model(render_model(resolve(DeploymentSpec(id=model_id, path=package)), embedded_target()), repo)
    original = Path(PACKAGE_DIR) / "triton_model.py"
    a, b = (repo / m / "1" / "python_backend" / "triton_model.py" for m in ("a", "b"))
    assert a.stat().st_ino == b.stat().st_ino != original.stat().st_ino  # one copy, linked by both
    assert a.read_bytes() == original.read_bytes()


def test_the_python_entry_is_one_file_linked_into_every_model_and_a_fresh_one_once_its_links_are_used_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """model.py and the file named __pycache__ beside it name no model: written once beside the staging folders and
    linked into each model's folder (a file made costs far more than a link); at EMLINK (ext4: 65,000 links) a fresh
    file takes the links."""
    from controlplane.store import transactions

    monkeypatch.setattr(transactions, "_link_targets", {})
    package = custom_pkg(tmp_path / "p")
    repo = tmp_path / "repo"
    entry = [Path("1") / "model.py", Path("1") / "__pycache__"]
    for model_id in ("a", "b"):
        write_model(render_model(resolve(DeploymentSpec(id=model_id, path=package)), embedded_target()), repo)
    for rel in entry:
        a, b = repo / "a" / rel, repo / "b" / rel
        assert a.stat().st_ino == b.stat().st_ino and a.stat().st_nlink == 3  # a, b and the shared file
    assert b"'a'" not in (repo / "a" / entry[0]).read_bytes()  # it names no model

    real_link = os.link

    def link(src: object, dst: object, *args: object, **kwargs: object) -> None:
        if os.path.basename(str(src)).startswith(".shared-") and os.stat(src).st_nlink >= 3:
            raise OSError(errno.EMLINK, "Too many links", str(src))
        real_link(src, dst, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "link", link)
    write_model(render_model(resolve(DeploymentSpec(id="c", path=package)), embedded_target()), repo)
    for rel in entry:
        c, a = repo / "c" / rel, repo / "a" / rel
        assert c.stat().st_ino != a.stat().st_ino and c.read_bytes() == a.read_bytes()  # a fresh file, same bytes


def test_failing_package_leaves_repository_byte_identical(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    good = resolve(DeploymentSpec(id="good", path=custom_pkg(tmp_path / "p")))
    render_repository([good], repo, embedded_target())
    before = tree_digest(repo)
    bad = resolve(DeploymentSpec(id="bad", path=plan_pkg(tmp_path / "t")))
    with pytest.raises(InvalidPackageError):
        render_repository([good, bad], repo, embedded_target())
    assert tree_digest(repo) == before


def test_templates_are_found_from_an_installed_layout() -> None:
    from importlib import resources

    names = {p.name for p in resources.files("model_repository_templates").iterdir()}
    assert {"python.pbtxt.j2", "onnxruntime.pbtxt.j2", "tensorrt.pbtxt.j2", "python_model.py.j2"} <= names


def test_republish_never_leaves_the_model_missing(tmp_path: Path) -> None:
    """A reader polling the model folder during many republishes always finds it (atomic swap)."""
    import threading

    repo = tmp_path / "repo"
    spec = resolve(DeploymentSpec(id="m", path=custom_pkg(tmp_path / "p")))
    rendered = render_model(spec, embedded_target())
    write_model(rendered, repo)
    missing: list[int] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            if not (repo / "m" / DEPLOYMENT_FILE).is_file():
                missing.append(1)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(50):
            write_model(rendered, repo)
    finally:
        done.set()
        thread.join()
    assert not missing, f"the model folder was missing {len(missing)} times during republishes"


# --- warm-up inside the load (Triton's model_warmup) -------------------------------------------


def test_warmup_is_rendered_from_the_signature(tmp_path: Path) -> None:
    spec = resolve(DeploymentSpec(id="m", path=custom_pkg(tmp_path / "p")))
    rendered = render_model(spec, embedded_target())
    [sample] = rendered.config.model_warmup
    assert sample.batch_size == 1 and sample.count == 1
    x, text = sample.inputs["x"], sample.inputs["text"]
    assert list(x.dims) == [3] and x.zero_data
    assert list(text.dims) == [1] and text.input_data_file == "input_1.bin"  # -1 takes 1, BYTES a short string
    assert rendered.writes["warmup/input_1.bin"] == b"\x06\x00\x00\x00snooze"


def test_warmup_false_renders_none_and_onnx_native_gets_one(tmp_path: Path) -> None:
    off = resolve(DeploymentSpec(id="m", path=custom_pkg(tmp_path / "p", warmup=False)))
    rendered = render_model(off, embedded_target())
    assert not rendered.config.model_warmup and not any(k.startswith("warmup/") for k in rendered.writes)
    native = render_model(resolve(DeploymentSpec(id="relu", path=onnx_pkg(tmp_path / "o"))), FULL_TARGET)
    assert list(native.config.model_warmup[0].inputs["in"].dims) == [5]


def test_warmup_samples_shipped_by_the_package(tmp_path: Path) -> None:
    import numpy as np

    pkg = custom_pkg(tmp_path / "p", warmup={"x": "samples/x.npy", "text": "samples/text.npy"})
    (pkg / "samples").mkdir()
    np.save(pkg / "samples" / "x.npy", np.array([1.0, 2.0, 3.0], dtype=np.float32))
    np.save(pkg / "samples" / "text.npy", np.array([b"ab", b"c"]))
    rendered = render_model(resolve(DeploymentSpec(id="m", path=pkg)), embedded_target())
    sample = rendered.config.model_warmup[0]
    assert list(sample.inputs["text"].dims) == [2] and list(sample.inputs["x"].dims) == [3]
    assert rendered.writes["warmup/input_0.bin"] == np.array([1, 2, 3], dtype="<f4").tobytes()
    assert rendered.writes["warmup/input_1.bin"] == b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"


def test_the_runtime_reads_back_the_warmup_sample_triton_gets(tmp_path: Path) -> None:
    """What the runtime runs through predict in initialize is the request Triton's warm-up sends."""
    import numpy as np
    from google.protobuf import json_format

    from python_backend.warmup import warmup_samples

    pkg = custom_pkg(tmp_path / "p", warmup={"x": "x.npy"})
    np.save(pkg / "x.npy", np.array([1.5, -2.0, 3.0], dtype=np.float32))
    model = write_model(render_model(resolve(DeploymentSpec(id="m", path=pkg)), embedded_target()), tmp_path / "r")
    config = json_format.MessageToDict(
        parse_config((model / "config.pbtxt").read_text(), where="test"), preserving_proto_field_name=True
    )
    [(name, arrays)] = warmup_samples(config, str(model))
    assert name == "snooze_warmup_samples" and set(arrays) == {"x", "text"}
    np.testing.assert_array_equal(arrays["x"], [[1.5, -2.0, 3.0]])
    assert arrays["text"].dtype == object and arrays["text"].tolist() == [[b"snooze"]]
    config["max_batch_size"] = 0
    assert warmup_samples(config, str(model))[0][1]["x"].shape == (3,)


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ({"z": "s.npy"}, r"warmup names input\(s\) \['z'\]"),
        ({"x": "missing.npy"}, "input 'x' .*no such file"),
        ({"x": "s.npy"}, "input 'x' .*shape \\[4\\], the input's dims are \\[3\\]"),
        ({"x": "i.npy"}, "input 'x' .*dtype int64, the input is FP32"),
    ],
)
def test_a_warmup_sample_that_does_not_fit_is_refused_naming_the_input(
    tmp_path: Path, sample: dict[str, str], message: str
) -> None:
    import numpy as np

    pkg = custom_pkg(tmp_path / "p", warmup=sample)
    np.save(pkg / "s.npy", np.zeros(4, dtype=np.float32))
    np.save(pkg / "i.npy", np.zeros(3, dtype=np.int64))
    with pytest.raises(InvalidPackageError, match=message):
        render_model(resolve(DeploymentSpec(id="m", path=pkg)), embedded_target())
