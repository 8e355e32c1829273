"""deploy/k8s: a schema-light structural check of the kustomize base (kubeconform is not installable
from the package registries here), plus `kubectl kustomize` when a kubectl is on PATH."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"
SECRET = "snooze-api-keys"


def _load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((BASE / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def docs(kustomization: dict) -> list[dict]:
    return [doc for name in kustomization["resources"] for doc in _load(BASE / name)]


def _by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _containers(docs: list[dict]) -> list[tuple[str, dict]]:
    return [(name, c) for name, dep in _by_kind(docs, "Deployment").items()
            for c in dep["spec"]["template"]["spec"]["containers"]]


def test_kustomization_lists_existing_files_and_covers_the_folder(kustomization: dict) -> None:
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed))
    for name in listed:
        assert (BASE / name).is_file(), f"kustomization.yaml lists {name}, which does not exist"
    on_disk = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk == set(listed), "every manifest of the base must be listed in kustomization.yaml"
    top = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert top["resources"] == ["base"]


def test_every_document_is_a_namespaceless_resource(docs: list[dict]) -> None:
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind") and doc.get("metadata", {}).get("name"), doc
        assert "namespace" not in doc["metadata"], f"{doc['metadata']['name']}: the base is namespace-less"
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("Deployment") == 2 and "PersistentVolumeClaim" in kinds and "Secret" in kinds
    assert kinds.count("Service") == 3


def test_selectors_match_template_labels_and_services_find_pods(docs: list[dict]) -> None:
    deployments = _by_kind(docs, "Deployment")
    for name, dep in deployments.items():
        selector = dep["spec"]["selector"]["matchLabels"]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"{name}: selector does not match its pod labels"
    for name, svc in _by_kind(docs, "Service").items():
        selector = svc["spec"]["selector"]
        targets = [d for d in deployments.values()
                   if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(targets) == 1, f"Service {name} must select exactly one Deployment's pods"
        port_names = {p["name"] for _, c in _containers([targets[0]]) for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"Service {name}: no container port {port['targetPort']}"


def test_services_gateway_api_and_internal_triton(docs: list[dict]) -> None:
    services = _by_kind(docs, "Service")
    ports = {name: sorted(p["port"] for p in svc["spec"]["ports"]) for name, svc in services.items()}
    assert ports["snooze-gateway"] == [8000, 8001]
    assert ports["snooze-api"] == [8080]
    assert services["snooze-triton"]["spec"]["type"] == "ClusterIP"
    assert services["snooze-triton"]["spec"]["selector"]["app.kubernetes.io/component"] == "triton"


def test_probes_and_resources_on_every_container(docs: list[dict]) -> None:
    for name, c in _containers(docs):
        for probe in ("readinessProbe", "livenessProbe"):
            assert c.get(probe, {}).get("httpGet"), f"{name}/{c['name']}: no {probe}"
        requests = c.get("resources", {}).get("requests", {})
        assert {"cpu", "memory"} <= set(requests), f"{name}/{c['name']}: no cpu/memory requests"
    containers = {c["name"]: c for _, c in _containers(docs)}
    assert containers["triton"]["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert containers["triton"]["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert containers["controlplane"]["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert containers["controlplane"]["livenessProbe"]["httpGet"]["path"] == "/health/live"


def test_triton_args_shm_and_readonly_repository(docs: list[dict]) -> None:
    dep = _by_kind(docs, "Deployment")["snooze-triton"]
    pod = dep["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert c["image"] == TRITON_IMAGE
    args = c["args"]
    for flag in ("--model-repository=/models", "--model-control-mode=explicit",
                 "--disable-auto-complete-config", "--strict-readiness=false",
                 "--http-restricted-api=model-repository:snooze-admin=$(SNOOZE_TRITON_ADMIN_KEY)",
                 "--grpc-restricted-protocol=model-repository:snooze-admin=$(SNOOZE_TRITON_ADMIN_KEY)"):
        assert flag in args
    env_names = {e["name"] for e in c["env"]}
    assert "SNOOZE_TRITON_ADMIN_KEY" in env_names  # $(VAR) in args expands only from the container env
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/dev/shm"]["name"] == "dshm"
    assert mounts["/models"]["readOnly"] is True


def test_controlplane_non_root_full_target_and_secret_env(docs: list[dict]) -> None:
    dep = _by_kind(docs, "Deployment")["snooze-controlplane"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["fsGroup"] == 10001
    assert dep["spec"]["replicas"] == 1
    [c] = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["SNOOZE_TARGET"]["value"] == "full"
    assert env["SNOOZE_TRITON_URL"]["value"] == "http://snooze-triton:8000"
    for key in ("SNOOZE_API_KEYS", "SNOOZE_ADMIN_KEYS", "SNOOZE_TRITON_ADMIN_KEY"):
        assert env[key]["valueFrom"]["secretKeyRef"]["name"] == SECRET
    args = c["args"]
    assert args[args.index("--target") + 1] == "full"
    assert args[args.index("--triton-url") + 1] == env["SNOOZE_TRITON_URL"]["value"]
    assert args[args.index("--host") + 1] == "0.0.0.0"


def test_secret_and_pvc_references_resolve(docs: list[dict]) -> None:
    secrets = _by_kind(docs, "Secret")
    claims = _by_kind(docs, "PersistentVolumeClaim")
    for name, c in _containers(docs):
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] in secrets, f"{name}: Secret {ref['name']} is not in the base"
                assert ref["key"] in secrets[ref["name"]]["stringData"], f"{name}: no key {ref['key']}"
    for dep in _by_kind(docs, "Deployment").values():
        for v in dep["spec"]["template"]["spec"]["volumes"]:
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims
    [pvc] = claims.values()
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_network_policy_admits_only_the_controlplane_to_triton(docs: list[dict]) -> None:
    [policy] = _by_kind(docs, "NetworkPolicy").values()
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "triton"
    [rule] = policy["spec"]["ingress"]
    [peer] = rule["from"]
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "controlplane"


def test_kubectl_kustomize_builds_the_base() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl on PATH; the structural tests above check the manifests")
    proc = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 and "unknown command" in proc.stderr:
        pytest.skip(f"this kubectl has no kustomize: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    built = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert len(built) == 8
    assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "snoozeml" for d in built)
    [cp] = [d for d in built if d["metadata"]["name"] == "snooze-controlplane"]
    assert cp["spec"]["template"]["spec"]["containers"][0]["image"] == "snoozeml-controlplane:0.1.0"
