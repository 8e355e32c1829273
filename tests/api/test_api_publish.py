"""Publishing through the API: uploads, server paths, bad packages leave the repository untouched."""

from __future__ import annotations

import asyncio
import io
import json
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from controlplane.settings import Settings
from controlplane.store import ModelStore
from harness.api import ADMIN, RecordingLifecycle, tar_gz, upload
from harness.serve import tree_digest


def _onnx_package(folder: Path, manifest: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, folder / "model.onnx")
    if manifest is not None:
        (folder / "snooze_model.json").write_text(json.dumps(manifest))
    return folder


async def test_upload_publishes_validated_model_and_tells_lifecycle(
    client: httpx.AsyncClient, make_package: Callable[..., Path], store: ModelStore, lifecycle: RecordingLifecycle
) -> None:
    archive = tar_gz(make_package())
    r = await upload(client, archive, deployment={"max_batch_size": 4, "idle_timeout_secs": 60, "params": {"scale": 3}})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["id"] == "m1"
    assert body["kind"] == "custom" and body["backend"] == "python"
    assert body["deployment"]["max_batch_size"] == 4
    assert Path(body["deployment"]["path"]) == store.repository / "m1"  # not the emptied upload folder
    assert (Path(body["deployment"]["path"]) / "config.pbtxt").is_file()
    assert body["params"] == {"scale": 3.0}
    assert body["metadata"]["task"] == "scaling"
    assert 'name: "m1"' in body["config"] and "max_batch_size: 4" in body["config"]
    assert body["status"]["state"] == "unloaded"
    assert store.ids() == ["m1"]
    assert ("published", "m1") in lifecycle.calls


async def test_keep_alive_policy_is_stored_with_the_published_model(
    client: httpx.AsyncClient, make_package: Callable[..., Path], store: ModelStore
) -> None:
    archive = tar_gz(make_package())
    r = await upload(client, archive, deployment={"keep_alive": "adaptive", "idle_timeout_secs": 60})
    assert r.status_code == 201, r.text
    assert r.json()["deployment"]["keep_alive"] == "adaptive"
    assert store.get("m1").deployment.keep_alive == "adaptive"  # survives a control-plane restart
    r = await upload(client, archive, model_id="m2")
    assert r.status_code == 201 and r.json()["deployment"]["keep_alive"] == "fixed"


async def test_single_top_level_folder_is_the_package(
    client: httpx.AsyncClient, make_package: Callable[..., Path], store: ModelStore
) -> None:
    r = await upload(client, tar_gz(make_package(), top="my-net"), model_id="my-net")
    assert r.status_code == 201, r.text
    assert (store.repository / "my-net" / "1" / "package" / "snooze_model.py").is_file()


async def test_zip_upload_with_id_in_deployment(
    client: httpx.AsyncClient, make_package: Callable[..., Path], store: ModelStore
) -> None:
    folder = make_package()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for path in folder.iterdir():
            zf.write(path, path.name)
    r = await upload(client, buf.getvalue(), model_id=None, deployment={"id": "zipped"}, filename="pkg.zip")
    assert r.status_code == 201, r.text
    assert store.ids() == ["zipped"]


async def test_onnx_upload_derives_signature(client: httpx.AsyncClient, tmp_path: Path) -> None:
    folder = _onnx_package(tmp_path / "onnx")
    r = await upload(client, tar_gz(folder), model_id="relu")
    assert r.status_code == 201, r.text
    assert r.json()["inputs"] == [{"name": "x", "datatype": "FP32", "dims": [4]}]


async def test_republish_replaces_the_model(
    client: httpx.AsyncClient, make_package: Callable[..., Path], store: ModelStore
) -> None:
    archive = tar_gz(make_package())
    assert (await upload(client, archive, deployment={"max_batch_size": 2})).status_code == 201
    assert (await upload(client, archive, deployment={"max_batch_size": 6})).status_code == 201
    assert store.get("m1").deployment.max_batch_size == 6


async def test_concurrent_publishes_of_one_id_leave_one_whole_model(
    client: httpx.AsyncClient, make_package: Callable[..., Path], store: ModelStore, lifecycle: RecordingLifecycle
) -> None:
    archive = tar_gz(make_package())
    sizes = [1, 2, 3, 4, 5, 6]
    answers = await asyncio.gather(*(upload(client, archive, deployment={"max_batch_size": n}) for n in sizes))
    assert [a.status_code for a in answers] == [201] * len(sizes)
    model = store.get("m1")
    assert model.deployment.max_batch_size in sizes
    assert f"max_batch_size: {model.deployment.max_batch_size}" in model.config_text
    assert sorted(p.name for p in store.repository.iterdir()) == ["m1"]
    assert lifecycle.calls.count(("published", "m1")) == len(sizes)


async def test_publish_from_server_path(
    client: httpx.AsyncClient, make_package: Callable[..., Path], store: ModelStore
) -> None:
    folder = make_package()
    r = await client.post("/v1/models:from-path", json={"id": "local", "path": str(folder)}, headers=ADMIN)
    assert r.status_code == 201, r.text
    assert store.ids() == ["local"]
    assert not (folder / "__pycache__").exists()  # the import check writes nothing into the user's folder


async def test_publish_from_path_refused_when_disabled(
    client: httpx.AsyncClient, make_package: Callable[..., Path], settings: Settings
) -> None:
    settings.allow_local_paths = False
    r = await client.post("/v1/models:from-path", json={"id": "local", "path": str(make_package())}, headers=ADMIN)
    assert r.status_code == 403
    assert "SNOOZE_ALLOW_LOCAL_PATHS" in r.json()["hint"]


async def test_publish_from_relative_path_is_refused(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/models:from-path", json={"id": "local", "path": "models/x"}, headers=ADMIN)
    assert r.status_code == 422
    assert "relative" in r.json()["error"]


# ---------------------------------------------------------------------------------------------
# Bad input: a 4xx naming the problem, the repository byte-identical


def _tar_with(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def _good_files(folder: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    return [_file(p.name, p.read_bytes()) for p in sorted(folder.iterdir())]


@pytest.fixture
async def published(client: httpx.AsyncClient, make_package: Callable[..., Path]) -> None:
    """One good model already in the repository, so 'unchanged' means more than 'still empty'."""
    r = await upload(client, tar_gz(make_package("existing")), model_id="m1")
    assert r.status_code == 201, r.text


def _bad_archives(make_package: Callable[..., Path], tmp_path: Path) -> dict[str, tuple[bytes, int, str]]:
    good = make_package("good")
    files = _good_files(good)
    fifo = tarfile.TarInfo("pipe")
    fifo.type = tarfile.FIFOTYPE
    bad_json = make_package("bad-json", manifest='{"inputs": [')
    unknown_field = make_package("unknown", manifest={"inputs": [], "outputs": [], "colour": "red"})
    import_error = make_package("import-error", model_py="import not_a_real_module_xyz\n\nclass Model: ...\n")
    syntax_error = make_package("syntax-error", model_py="def broken(:\n")
    missing_in_load = make_package(
        "missing-in-load",
        model_py="class Model:\n    def load(self, model_dir, device):\n        import sklearnx\n\n"
        "    def predict(self, inputs):\n        return inputs\n",
    )
    no_class = make_package("no-class", model_py="class Other:\n    pass\n")
    onnx_mismatch = _onnx_package(
        tmp_path / "onnx-mismatch", {"inputs": [{"name": "x", "datatype": "INT64", "dims": [4]}]}
    )
    return {
        "dotdot": (_tar_with([*files, _file("../evil.py", b"x")]), 422, "'../evil.py' escapes"),
        "absolute": (_tar_with([*files, _file("/tmp/evil.py", b"x")]), 422, "absolute path"),
        "symlink-out": (_tar_with([*files, _link("data", "../../etc/passwd")]), 422, "outside the package"),
        "symlink-abs": (_tar_with([*files, _link("data", "/etc/passwd")]), 422, "absolute path '/etc/passwd'"),
        "hardlink-out": (_tar_with([*files, _link("data", "../x", tarfile.LNKTYPE)]), 422, "escapes"),
        "fifo": (_tar_with([*files, (fifo, None)]), 422, "device file or FIFO"),
        "too-large": (_tar_with([*files, _file("weights.bin", b"\0" * (2 * 2**20))]), 413, "limit"),
        "not-an-archive": (b"this is not an archive", 422, "not a tar or zip archive"),
        "bad-json": (tar_gz(bad_json), 422, "snooze_model.json: not valid JSON"),
        "unknown-field": (tar_gz(unknown_field), 422, "unknown field 'colour'"),
        "import-error": (tar_gz(import_error), 422, "No module named 'not_a_real_module_xyz'"),
        "syntax-error": (tar_gz(syntax_error), 422, "SyntaxError"),
        # found at publish, not by the first request: an import inside load() that is not installed
        "missing-in-load": (
            tar_gz(missing_in_load),
            422,
            "model 'm1': snooze_model.py:3 imports 'sklearnx', "
            "which is not installed where Triton's python backend runs the model",
        ),
        "no-class": (tar_gz(no_class), 422, "defines no class 'Model'"),
        "onnx-mismatch": (tar_gz(onnx_mismatch), 422, "'x' is FP32 in the ONNX file, INT64 in the manifest"),
        "no-package": (tar_gz(tmp_path / "packages"), 422, "not a model package"),
    }


@pytest.mark.usefixtures("published")
async def test_bad_uploads_are_refused_and_repository_is_byte_identical(
    client: httpx.AsyncClient, make_package: Callable[..., Path], store: ModelStore, tmp_path: Path
) -> None:
    before = tree_digest(store.repository)
    for case, (archive, status, fragment) in _bad_archives(make_package, tmp_path).items():
        r = await upload(client, archive, model_id="m1", filename=f"{case}.tar.gz")
        assert r.status_code == status, (case, r.text)
        body = r.json()
        assert fragment in body["error"], (case, body)
        assert body["code"] in ("invalid_package", "package_too_large"), (case, body)
        assert body["hint"], (case, body)
        assert tree_digest(store.repository) == before, case
    assert list((store.repository.parent / "uploads").iterdir()) == []  # temporary extractions are gone


async def test_errors_name_the_upload_not_the_temporary_folder(
    client: httpx.AsyncClient, make_package: Callable[..., Path]
) -> None:
    archive = tar_gz(make_package("bad", manifest='{"inputs": ['), top="my-net")
    r = await upload(client, archive, filename="my-net.tgz")
    assert r.json()["error"].startswith("my-net.tgz/my-net/snooze_model.json: not valid JSON")


@pytest.mark.parametrize(
    ("deployment", "fragment"),
    [
        ({"max_batch_size": -1}, "field 'max_batch_size'"),
        ({"colour": "red"}, "unknown field 'colour'"),
        ({"keep_alive": "smart"}, "field 'keep_alive': Input should be 'fixed' or 'adaptive'"),
        ({"path": "/etc"}, "must not set 'path'"),
        ({"id": "other"}, "several model ids"),
        ({"params": {"nope": 1}}, "nope"),
    ],
)
async def test_bad_deployment_fields_are_named(
    client: httpx.AsyncClient, make_package: Callable[..., Path], store: ModelStore, deployment: dict, fragment: str
) -> None:
    r = await upload(client, tar_gz(make_package()), deployment=deployment)
    assert r.status_code == 422, r.text
    assert fragment in r.json()["error"]
    assert store.ids() == []


async def test_upload_without_id_or_package_field(client: httpx.AsyncClient, make_package: Callable[..., Path]) -> None:
    r = await upload(client, tar_gz(make_package()), model_id=None)
    assert r.status_code == 422 and "model id" in r.json()["error"]
    r = await client.post("/v1/models?id=m1", data={"deployment": "{}"}, files={"other": ("x", b"x")}, headers=ADMIN)
    assert r.status_code == 422 and "'package'" in r.json()["error"]


async def test_declared_content_length_over_limit_is_refused_before_reading(client: httpx.AsyncClient) -> None:
    headers = {**ADMIN, "content-type": "multipart/form-data; boundary=x", "content-length": str(50 * 2**20)}
    r = await client.post("/v1/models?id=m1", content=b"--x--\r\n", headers=headers)
    assert r.status_code == 413
    assert r.json()["code"] == "package_too_large"


async def test_streamed_body_over_limit_is_cut_off(client: httpx.AsyncClient) -> None:
    async def body():  # chunked: no Content-Length to trust
        yield b'--x\r\nContent-Disposition: form-data; name="package"; filename="p.tgz"\r\n\r\n'
        for _ in range(5):
            yield np.zeros(2**20, dtype=np.uint8).tobytes()

    headers = {**ADMIN, "content-type": "multipart/form-data; boundary=x"}
    r = await client.post("/v1/models?id=m1", content=body(), headers=headers)
    assert r.status_code == 413


def test_imports_are_looked_up_only_where_triton_shares_this_environment(
    make_package: Callable[..., Path], settings: Settings
) -> None:
    from controlplane.api.operations import _validate
    from controlplane.errors import InvalidPackageError
    from controlplane.spec import DeploymentSpec

    code = "class Model:\n    def load(self, model_dir, device):\n        import torchx_in_a_derived_image\n"
    code += "\n    def predict(self, inputs):\n        return inputs\n"
    deployment = DeploymentSpec(id="m", path=make_package("in-load", model_py=code))
    with pytest.raises(InvalidPackageError, match="imports 'torchx_in_a_derived_image'"):
        _validate(deployment, settings)  # the embedded Triton: this interpreter's packages
    # An external Triton (the official image or a derived one) has packages the control plane cannot see.
    assert _validate(deployment, settings.model_copy(update={"triton_url": "http://127.0.0.1:1"})).id == "m"
