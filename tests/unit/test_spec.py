"""Package spec: manifests, discovery, models.toml, params; errors name the file and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controlplane.dtypes import parse_dtype
from controlplane.errors import InvalidPackageError
from controlplane.spec import (
    DeploymentSpec,
    PackageKind,
    discover,
    load_models_toml,
    load_package,
    resolve,
    validate_params,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "models"


def write_custom(folder: Path, manifest: dict | None = None, code: str = "class Model: pass\n") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "snooze_model.py").write_text(code)
    base = {
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [3]}],
        "outputs": [{"name": "y", "datatype": "float32", "dims": [3]}],
    }
    (folder / "snooze_model.json").write_text(json.dumps({**base, **(manifest or {})}))
    return folder


@pytest.mark.parametrize(
    ("spelling", "wire", "triton"),
    [
        ("FP32", "FP32", "TYPE_FP32"),
        ("float32", "FP32", "TYPE_FP32"),
        ("int64", "INT64", "TYPE_INT64"),
        ("BYTES", "BYTES", "TYPE_STRING"),
        ("object", "BYTES", "TYPE_STRING"),
        ("bytes", "BYTES", "TYPE_STRING"),
        ("bool", "BOOL", "TYPE_BOOL"),
        ("TYPE_FP16", "FP16", "TYPE_FP16"),
    ],
)
def test_dtype_spellings_resolve_to_one_type(spelling: str, wire: str, triton: str) -> None:
    dt = parse_dtype(spelling)
    assert (dt.wire, dt.triton) == (wire, triton)


def test_unknown_dtype_lists_accepted_names() -> None:
    with pytest.raises(ValueError, match="FP32"):
        parse_dtype("float31")


def test_custom_package_reads_manifest_and_normalises_dtypes(tmp_path: Path) -> None:
    pkg = load_package(write_custom(tmp_path / "m"))
    assert pkg.kind is PackageKind.CUSTOM
    assert [(t.name, t.datatype, t.dims) for t in pkg.outputs] == [("y", "FP32", [3])]
    assert pkg.manifest.load_timeout_secs == 300 and pkg.manifest.request_timeout_secs == 60
    assert pkg.files == ["snooze_model.json", "snooze_model.py"]


def test_unknown_manifest_field_is_named(tmp_path: Path) -> None:
    write_custom(tmp_path / "m", {"lod_timeout_secs": 3})
    with pytest.raises(InvalidPackageError, match=r"snooze_model.json.*unknown field 'lod_timeout_secs'"):
        load_package(tmp_path / "m")


def test_malformed_manifest_json_names_the_file(tmp_path: Path) -> None:
    folder = write_custom(tmp_path / "m")
    (folder / "snooze_model.json").write_text("{not json")
    with pytest.raises(InvalidPackageError, match="snooze_model.json: not valid JSON"):
        load_package(folder)


def test_custom_model_without_signature_is_rejected_with_fix(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "snooze_model.py").write_text("class Model: pass\n")
    with pytest.raises(InvalidPackageError) as err:
        load_package(folder)
    # No manifest at all: say so (rather than name a file that does not exist) and show a whole one.
    assert str(err.value).startswith(
        f"{folder}: a custom model needs a manifest snooze_model.json declaring its 'inputs' and 'outputs'"
    ), str(err.value)
    assert "and the package has none" in str(err.value)
    assert '"inputs": [{"name": "x"' in err.value.hint and '"outputs": [' in err.value.hint


def test_manifest_without_outputs_names_what_is_missing(tmp_path: Path) -> None:
    folder = write_custom(tmp_path / "m")
    (folder / "snooze_model.json").write_text(json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "dims": [3]}]}))
    with pytest.raises(InvalidPackageError) as err:
        load_package(folder)
    assert err.value.message == (
        f"{folder / 'snooze_model.json'}: a custom model must declare its 'outputs' "
        "(name, datatype, dims without the batch axis)"
    )


def test_dtype_is_an_alias_of_datatype(tmp_path: Path) -> None:
    write_custom(tmp_path / "m", {"inputs": [{"name": "x", "dtype": "float32", "dims": [3]}]})
    assert [(t.name, t.datatype, t.dims) for t in load_package(tmp_path / "m").inputs] == [("x", "FP32", [3])]


def test_shape_is_refused_with_what_dims_means(tmp_path: Path) -> None:
    # numpy's shape has the batch axis, dims does not: the word is explained, not silently taken.
    write_custom(tmp_path / "m", {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 3]}]})
    with pytest.raises(InvalidPackageError) as err:
        load_package(tmp_path / "m")
    message = str(err.value)
    assert "unknown field 'inputs.0.shape'" in message
    assert "rename 'shape' to 'dims' and drop the batch axis" in message


def test_bad_dims_and_dtype_are_rejected(tmp_path: Path) -> None:
    write_custom(tmp_path / "a", {"inputs": [{"name": "x", "datatype": "FP32", "dims": [0]}]})
    with pytest.raises(InvalidPackageError, match="inputs.0.dims"):
        load_package(tmp_path / "a")
    write_custom(tmp_path / "b", {"inputs": [{"name": "x", "datatype": "complex64", "dims": [2]}]})
    with pytest.raises(InvalidPackageError, match="unknown data type 'complex64'"):
        load_package(tmp_path / "b")


def test_variable_dims_are_accepted(tmp_path: Path) -> None:
    write_custom(tmp_path / "m", {"inputs": [{"name": "x", "datatype": "BYTES", "dims": [-1]}]})
    assert load_package(tmp_path / "m").inputs[0].dims == [-1]


def test_not_a_package(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidPackageError, match="not a model package"):
        load_package(tmp_path / "empty")


def test_symlink_out_of_package_is_rejected(tmp_path: Path) -> None:
    folder = write_custom(tmp_path / "m")
    (tmp_path / "secret").write_text("x")
    (folder / "weights.bin").symlink_to(tmp_path / "secret")
    with pytest.raises(InvalidPackageError, match="symlink points outside"):
        load_package(folder)


def test_params_are_typed_defaulted_and_unknown_rejected(tmp_path: Path) -> None:
    schema = {"scale": {"type": "float", "default": 1.0}, "label": {"type": "str", "required": True}}
    pkg = load_package(write_custom(tmp_path / "m", {"params_schema": schema, "params": {"label": "a"}}))
    assert validate_params(pkg, {"scale": 3}, model_id="m") == {"scale": 3.0, "label": "a"}
    with pytest.raises(InvalidPackageError, match="unknown field 'colour'"):
        validate_params(pkg, {"colour": "red"}, model_id="m")
    with pytest.raises(InvalidPackageError, match="scale"):
        validate_params(pkg, {"scale": "big"}, model_id="m")


def test_params_without_schema_are_rejected(tmp_path: Path) -> None:
    pkg = load_package(write_custom(tmp_path / "m", {"params": {"a": 1}}))
    with pytest.raises(InvalidPackageError, match="declares no 'params_schema'"):
        validate_params(pkg, {}, model_id="m")


def test_models_toml_resolves_paths_and_rejects_unknown_keys(tmp_path: Path) -> None:
    write_custom(tmp_path / "pkgs" / "net")
    toml = tmp_path / "models.toml"
    toml.write_text('[[models]]\nid = "net"\npath = "pkgs/net"\nmax_batch_size = 4\nidle_timeout_secs = 10\n')
    (spec,) = load_models_toml(toml)
    assert spec.path == (tmp_path / "pkgs" / "net").resolve() and spec.max_batch_size == 4
    toml.write_text('[[models]]\nid = "net"\npath = "pkgs/net"\nmax_batch = 4\n')
    with pytest.raises(InvalidPackageError, match=r"\(id 'net'\).*unknown field 'max_batch'"):
        load_models_toml(toml)


def test_keep_alive_policy_is_fixed_by_default_and_adaptive_on_request(tmp_path: Path) -> None:
    write_custom(tmp_path / "pkgs" / "net")
    toml = tmp_path / "models.toml"
    toml.write_text(
        '[[models]]\nid = "net"\npath = "pkgs/net"\n[[models]]\nid = "ad"\npath = "pkgs/net"\nkeep_alive = "adaptive"\n'
    )
    fixed, adaptive = load_models_toml(toml)
    assert (fixed.keep_alive, adaptive.keep_alive) == ("fixed", "adaptive")
    toml.write_text('[[models]]\nid = "net"\npath = "pkgs/net"\nkeep_alive = "smart"\n')
    with pytest.raises(InvalidPackageError, match=r"\(id 'net'\).*field 'keep_alive'.*'fixed' or 'adaptive'"):
        load_models_toml(toml)


def test_worker_is_in_stub_by_default_and_preforked_on_request(tmp_path: Path) -> None:
    from controlplane.render import runtime_config

    write_custom(tmp_path / "pkgs" / "net", {"preload": ["torch", "PIL.Image", "torch"]})
    toml = tmp_path / "models.toml"
    toml.write_text(
        '[[models]]\nid = "a"\npath = "pkgs/net"\n[[models]]\nid = "b"\npath = "pkgs/net"\nworker = "preforked"\n'
    )
    stub, forked = load_models_toml(toml)
    assert (stub.worker, forked.worker) == ("in-stub", "preforked")
    config = runtime_config(resolve(forked))
    assert (config["worker"], config["preload"]) == ("preforked", ["torch", "PIL.Image"])  # deduplicated
    toml.write_text('[[models]]\nid = "a"\npath = "pkgs/net"\nworker = "forked"\n')
    with pytest.raises(InvalidPackageError, match=r"\(id 'a'\).*field 'worker'.*'in-stub' or 'preforked'"):
        load_models_toml(toml)


def test_preload_names_modules(tmp_path: Path) -> None:
    write_custom(tmp_path / "m", {"preload": ["torch", "not a module"]})
    with pytest.raises(InvalidPackageError, match=r"field 'preload'.*\['not a module'\].*importable module name"):
        load_package(tmp_path / "m")


def test_preforked_applies_to_custom_and_python_backend_onnx_models() -> None:
    from controlplane.render import FULL_TARGET, embedded_target, render_model

    spec = resolve(DeploymentSpec(id="o", path=EXAMPLES / "onnx-mlp", worker="preforked"))
    runtime = json.loads(render_model(spec, embedded_target()).writes["1/snooze_runtime.json"])
    # its worker imports onnxruntime (~60 ms here): imported in the parent, it starts native threads no fork survives
    assert runtime["worker"] == "preforked" and runtime["preload"] == []
    with pytest.raises(InvalidPackageError, match=r"model 'o': worker = \"preforked\".*Triton's onnxruntime backend"):
        render_model(spec, FULL_TARGET)


def test_duplicate_ids_are_rejected(tmp_path: Path) -> None:
    write_custom(tmp_path / "a")
    toml = tmp_path / "models.toml"
    toml.write_text('[[models]]\nid = "x"\npath = "a"\n[[models]]\nid = "x"\npath = "a"\n')
    with pytest.raises(InvalidPackageError, match="model id 'x' is used twice"):
        load_models_toml(toml)


def test_discover_merges_toml_with_folders(tmp_path: Path) -> None:
    write_custom(tmp_path / "auto")
    write_custom(tmp_path / "named")
    (tmp_path / "models.toml").write_text('[[models]]\nid = "custom-id"\npath = "named"\ndevice = "cpu"\n')
    (tmp_path / "notes").mkdir()
    (tmp_path / ".git").mkdir()
    found = {s.id: s for s in discover(tmp_path)}
    # A folder that is no package is listed, and refused with the reason when resolved (never skipped silently).
    assert sorted(found) == ["auto", "custom-id", "notes"]
    with pytest.raises(InvalidPackageError, match="not a model package.*not a Triton model folder"):
        resolve(found["notes"])


def test_a_folder_that_holds_the_packages_models_toml_names_is_not_listed_as_a_package(tmp_path: Path) -> None:
    """models.toml naming ``pkgs/a`` and ``pkgs/b``: ``pkgs/`` holds them, and is no package itself; a sibling
    folder that holds nothing named is still listed (and refused when resolved)."""
    write_custom(tmp_path / "pkgs" / "a")
    write_custom(tmp_path / "pkgs" / "deeper" / "b")
    (tmp_path / "checks").mkdir()
    (tmp_path / "models.toml").write_text(
        '[[models]]\nid = "a"\npath = "pkgs/a"\n\n[[models]]\nid = "b"\npath = "pkgs/deeper/b"\n'
    )
    assert sorted(s.id for s in discover(tmp_path)) == ["a", "b", "checks"]
    # the models.toml itself: its entries alone
    assert sorted(s.id for s in discover(tmp_path / "models.toml")) == ["a", "b"]
    with pytest.raises(InvalidPackageError, match="models folder not found"):
        discover(tmp_path / "missing.toml")


def test_examples_are_valid_packages() -> None:
    specs = {s.id: s for s in discover(EXAMPLES)}
    assert {"numpy-linear", "torch-mlp", "text-features"} <= set(specs)
    linear = resolve(specs["numpy-linear"])
    assert linear.params == {"scale": 2.0}
    types = {t.name: t.datatype for t in resolve(specs["text-features"]).package.inputs}
    assert types == {"values": "FP32", "factor": "INT64", "text": "BYTES"}


def test_max_instances_below_instances_is_rejected(tmp_path: Path) -> None:
    write_custom(tmp_path / "m")
    with pytest.raises(InvalidPackageError, match="max_instances"):
        resolve(DeploymentSpec(id="m", path=tmp_path / "m", instances=3, max_instances=2))


def test_invalid_model_id_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="id"):
        DeploymentSpec(id="../evil", path=tmp_path)


def test_entry_point_packages_are_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from controlplane.spec import entry_point_deployments

    site = tmp_path / "site"
    write_custom(site / "acme_models" / "sentiment", code="class Model:\n    pass\n")
    (site / "acme_models" / "__init__.py").write_text("")
    (site / "acme_models" / "sentiment" / "__init__.py").write_text("")
    dist = site / "acme_models-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-models\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[snoozeml.models]\nacme-sentiment = acme_models.sentiment\n")
    monkeypatch.syspath_prepend(str(site))
    found = {d.id: d for d in entry_point_deployments()}
    assert found["acme-sentiment"].path == site / "acme_models" / "sentiment"
    assert resolve(found["acme-sentiment"]).package.inputs[0].name == "x"


def test_the_complete_manifest_in_the_docs_is_valid(tmp_path: Path) -> None:
    import re

    docs = (Path(__file__).resolve().parents[2] / "docs" / "packages.md").read_text()
    section = docs[docs.index("A complete manifest") :]
    manifest = json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "snooze_model.py").write_text("class Model: pass\n")
    (folder / "snooze_model.json").write_text(json.dumps(manifest))
    pkg = load_package(folder)
    assert [(t.name, t.datatype) for t in pkg.inputs] == [("x", "FP32"), ("ids", "INT64")]
    assert resolve(DeploymentSpec(id="m", path=folder)).params == {"scale": 2.0}


GENERATOR_PREDICT = """
class Model:
    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        for i in range(3):
            yield {"y": inputs["x"] * i}
"""

NESTED_YIELD_PREDICT = """
class Model:
    def predict(self, inputs):
        def tokens():
            yield 1
        return {"y": inputs["x"]}
"""


def test_a_generator_predict_is_decoupled_and_a_nested_yield_is_not(tmp_path: Path) -> None:
    from controlplane.render import embedded_target, render_model, runtime_config

    streaming = resolve(DeploymentSpec(id="s", path=write_custom(tmp_path / "s", code=GENERATOR_PREDICT)))
    nested = resolve(DeploymentSpec(id="n", path=write_custom(tmp_path / "n", code=NESTED_YIELD_PREDICT)))
    forced = resolve(DeploymentSpec(id="f", path=write_custom(tmp_path / "f", {"decoupled": True})))
    off = resolve(DeploymentSpec(id="o", path=write_custom(tmp_path / "o", {"decoupled": False}, GENERATOR_PREDICT)))
    assert (streaming.decoupled, nested.decoupled, forced.decoupled, off.decoupled) == (True, False, True, False)
    assert runtime_config(streaming)["decoupled"] is True
    config = render_model(streaming, embedded_target()).config
    assert config.model_transaction_policy.decoupled
    assert not render_model(nested, embedded_target()).config.model_transaction_policy.decoupled
