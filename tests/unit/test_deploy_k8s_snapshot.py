"""deploy/k8s/snapshot: structural checks of the snapshot overlay (its patch and seccomp profile),
plus checks of the rendered manifests (`kubectl kustomize`, the dev extra's kubectl; tests/harness/k8s_manifests.py)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from harness.k8s_manifests import kustomize

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = ROOT / "deploy" / "k8s" / "snapshot"
BASE = ROOT / "deploy" / "k8s" / "base"
PROFILE = SNAPSHOT / "seccomp" / "snoozeml-no-io-uring.json"
IO_URING = {"io_uring_setup", "io_uring_enter", "io_uring_register"}


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((SNAPSHOT / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def raw_ops(kustomization: dict) -> list[dict]:
    files = [p["path"] for p in kustomization["patches"] if "path" in p]
    assert files == ["workload-patch.yaml"]
    return yaml.safe_load((SNAPSHOT / files[0]).read_text())


@pytest.fixture(scope="module")
def patch_ops(raw_ops: list[dict]) -> dict[str, object]:
    return {op["path"]: op["value"] for op in raw_ops if op["op"] == "replace"}


def _base_deployment() -> dict:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    docs = [d for name in kustomization["resources"] for d in yaml.safe_load_all((BASE / name).read_text()) if d]
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    return deployment


def _check_workload(pod: dict) -> None:
    """The snapshot contract's pod: control volume, env, probe, seccomp, entrypoint."""
    (container,) = pod["containers"]
    name = container["name"]
    # Triton is the entrypoint's child: the container keeps its own PID namespace for the checkpoint.
    assert pod["shareProcessNamespace"] is False
    assert container["command"][:2] == ["snoozectl", "snapshot-entrypoint"]
    env = {e["name"]: e for e in container["env"]}
    assert "SNOOZE_TRITON_URL" not in env and "SNOOZE_TRITON_GRPC_URL" not in env, "Triton must run in the pod"
    assert "SNAPSHOT_RESTORE_STANDBY" not in env, "standby is for restore placeholders only"
    control_dir = env["SNAPSHOT_CONTROL_DIR"]["value"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["snapshot-control"]["mountPath"] == control_dir
    assert mounts["snapshot-control"]["subPath"] == name, "the control folder's subPath is the container name"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["snapshot-control"] == {"name": "snapshot-control", "emptyDir": {}}
    assert all("persistentVolumeClaim" not in v for v in volumes.values())
    work = env["SNOOZE_WORK_DIR"]["value"]
    assert not any(work.startswith(m["mountPath"]) for m in mounts.values()), "the work dir must be in the snapshot"
    probe = container["readinessProbe"]["exec"]["command"]
    assert "triton-restore-ready" in probe[-1] and "$SNAPSHOT_CONTROL_DIR" in probe[-1]
    assert shlex.split(probe[-1])[:2] == ["test", "-f"]
    assert "livenessProbe" not in container and "startupProbe" not in container, "a standby pod listens on nothing"
    seccomp = container["securityContext"]["seccompProfile"]
    assert seccomp["type"] == "Localhost"
    assert Path(seccomp["localhostProfile"]).name == PROFILE.name


def test_overlay_on_the_base_drops_the_external_triton(kustomization: dict) -> None:
    assert kustomization["resources"] == ["../base"]
    deleted = {yaml.safe_load(p["patch"])["metadata"]["name"] for p in kustomization["patches"] if "patch" in p}
    assert deleted == {"snooze-model-repository"}  # Triton is a container of the patched pod, not a resource
    for p in kustomization["patches"]:
        if "patch" in p:
            assert yaml.safe_load(p["patch"])["$patch"] == "delete"
    # The workload patch targets the base's one pod (Triton + control plane).
    [target] = [p["target"] for p in kustomization["patches"] if "path" in p]
    base = _base_deployment()
    assert (target["kind"], target["name"]) == (base["kind"], base["metadata"]["name"])


def test_workload_patch(raw_ops: list[dict], patch_ops: dict[str, object]) -> None:
    spec = {
        "containers": patch_ops["/spec/template/spec/containers"],
        "volumes": patch_ops["/spec/template/spec/volumes"],
        "shareProcessNamespace": patch_ops["/spec/template/spec/shareProcessNamespace"],
    }
    _check_workload(spec)
    base_spec = _base_deployment()["spec"]["template"]
    # A JSON 6902 replace or remove fails on a path the base lacks: every patched path exists there.
    for op in raw_ops:
        node = base_spec
        for key in op["path"].removeprefix("/spec/template/").split("/"):
            node = node[key.replace("~1", "/").replace("~0", "~")]
    removed = {op["path"] for op in raw_ops if op["op"] == "remove"}
    # The base names `controlplane` as the default container, which the snapshot pod does not have.
    assert removed == {"/spec/template/metadata/annotations"}
    assert set(base_spec["metadata"]["annotations"]) == {"kubectl.kubernetes.io/default-container"}


def test_seccomp_profile_blocks_io_uring() -> None:
    profile = json.loads(PROFILE.read_text())
    assert profile["defaultAction"] in ("SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO")
    blocked = {name for rule in profile["syscalls"] if rule["action"] == "SCMP_ACT_ERRNO" for name in rule["names"]}
    assert IO_URING <= blocked
    allowed = {n for rule in profile["syscalls"] if rule["action"] == "SCMP_ACT_ALLOW" for n in rule["names"]}
    assert not IO_URING & allowed
    (rule,) = [r for r in profile["syscalls"] if IO_URING <= set(r["names"])]
    assert rule["errnoRet"] == 38, "ENOSYS: libraries treat it as 'no io_uring here' and fall back to epoll"


def test_kustomize_renders_one_snapshot_workload() -> None:
    docs = kustomize(SNAPSHOT)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["Deployment", "Secret", "Service", "Service"]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    _check_workload(pod)
    assert "annotations" not in deployment["spec"]["template"]["metadata"]
    assert pod["containers"][0]["image"].startswith("snoozeml-snapshot:")
    port_names = {p["name"] for p in pod["containers"][0]["ports"]}
    for svc in (d for d in docs if d["kind"] == "Service"):
        assert svc["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
