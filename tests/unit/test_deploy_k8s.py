"""deploy/k8s: structural checks of the kustomize base, on its files and on what `kubectl kustomize` renders
(tests/unit/test_deploy_k8s_schemas.py checks the same against Kubernetes' schemas).

The base is one pod: Triton and the control plane as two containers sharing the PID namespace, one
non-root uid, the /run/snooze journal folder, and Triton on loopback ports apart from the gateway's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.k8s_manifests import kustomize

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"
SECRET = "snooze-api-keys"
# Contracts with the control plane and the model runtime (docs/deploy.md).
REQUEST_ID_PATTERN = "^x-request-id$"
RUN_DIR = "/run/snooze"
TRITON_PORTS = {"http": 8100, "grpc": 8101, "metrics": 8102}


def _load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((BASE / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def docs(kustomization: dict) -> list[dict]:
    return [doc for name in kustomization["resources"] for doc in _load(BASE / name)]


@pytest.fixture(scope="module")
def pod(docs: list[dict]) -> dict:
    [dep] = _by_kind(docs, "Deployment").values()
    return dep["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def containers(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod["containers"]}


def _by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _flag(args: list[str], name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    return value


def _expand(arg: str, env: dict[str, str]) -> str:
    """What the process receives for `arg`: Kubernetes expands `$(NAME)` from the container env, `$$` is `$`."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), arg)


def _controlplane_ports(container: dict) -> set[int]:
    """Every port the control plane listens on: its container ports plus its settings (env over defaults)."""
    from controlplane.settings import Settings

    env = _env(container)
    ports = {p["containerPort"] for p in container["ports"]}
    for field in (
        "http_port",
        "grpc_port",
        "api_port",
        "envoy_admin_port",
        "activator_http_port",
        "activator_grpc_port",
    ):
        name = f"SNOOZE_{field.upper()}"
        value = int(env[name]["value"]) if name in env else Settings.model_fields[field].default
        if value:  # 0 = a free port below the ephemeral range, chosen at start
            ports.add(value)
    return ports


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
    # One pod; Triton has no Service and needs no NetworkPolicy (loopback only).
    assert kinds == ["Deployment", "PersistentVolumeClaim", "Secret", "Service", "Service"]


def test_one_pod_of_triton_and_controlplane(docs: list[dict], pod: dict) -> None:
    [dep] = _by_kind(docs, "Deployment").values()
    assert dep["spec"]["replicas"] == 1  # one Triton per repository, one owner of the lifecycle
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    assert [c["name"] for c in pod["containers"]] == ["triton", "controlplane"]
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["kubectl.kubernetes.io/default-container"] == "controlplane"


def test_pid_namespace_shared_by_one_non_root_uid(pod: dict, containers: dict[str, dict]) -> None:
    assert pod["shareProcessNamespace"] is True  # the control plane sees Triton's processes in /proc
    ctx = pod["securityContext"]
    assert ctx["runAsNonRoot"] is True
    dockerfile = (ROOT / "Dockerfile").read_text()
    uid, gid = (int(x) for x in re.search(r"^USER\s+(\d+):(\d+)", dockerfile, re.MULTILINE).groups())
    assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"]) == (uid, gid, gid) and uid != 0
    for name, c in containers.items():
        own = c.get("securityContext", {})
        # Same uid in both: /proc/<pid>/smaps and kill() then need no capability.
        assert own.get("runAsUser", uid) == uid and own.get("runAsGroup", gid) == gid, name
        assert own["allowPrivilegeEscalation"] is False and own["capabilities"]["drop"] == ["ALL"], name
        assert "SYS_PTRACE" not in own["capabilities"].get("add", []), name


def test_selectors_match_template_labels_and_services_find_pods(docs: list[dict]) -> None:
    [dep] = _by_kind(docs, "Deployment").values()
    selector = dep["spec"]["selector"]["matchLabels"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items(), "selector does not match its pod labels"
    port_names = {p["name"] for c in dep["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
    for name, svc in _by_kind(docs, "Service").items():
        assert svc["spec"]["selector"].items() <= labels.items(), f"Service {name} does not select the pod"
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"Service {name}: no container port {port['targetPort']}"


def test_services_gateway_and_api_only(docs: list[dict], containers: dict[str, dict]) -> None:
    services = _by_kind(docs, "Service")
    ports = {name: sorted(p["port"] for p in svc["spec"]["ports"]) for name, svc in services.items()}
    assert ports == {"snooze-gateway": [8000, 8001], "snooze-api": [8080]}
    assert "ports" not in containers["triton"], "Triton listens on loopback: nothing outside the pod reaches it"


def test_probes_and_resources_on_every_container(containers: dict[str, dict]) -> None:
    for name, c in containers.items():
        for probe in ("readinessProbe", "livenessProbe"):
            assert c.get(probe, {}).get("httpGet") or c.get(probe, {}).get("exec"), f"{name}: no {probe}"
        requests = c.get("resources", {}).get("requests", {})
        assert {"cpu", "memory"} <= set(requests), f"{name}: no cpu/memory requests"
    triton, cp = containers["triton"], containers["controlplane"]
    http = f"http://127.0.0.1:{_flag(triton['args'], '--http-port')}"
    # Loopback only: the kubelet's httpGet goes to the pod IP, so Triton's probes run curl in the container.
    for probe, path in (("startupProbe", "live"), ("readinessProbe", "ready"), ("livenessProbe", "live")):
        command = triton[probe]["exec"]["command"]
        assert command[0] == "curl" and "-f" in command[1] and command[-1] == f"{http}/v2/health/{path}", probe
        assert triton[probe]["timeoutSeconds"] >= 2, f"{probe}: curl needs more than the 1 s default"
    assert cp["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert cp["livenessProbe"]["httpGet"]["path"] == "/health/live"


def test_triton_args_shm_and_readonly_repository(pod: dict, containers: dict[str, dict]) -> None:
    c = containers["triton"]
    assert c["image"] == TRITON_IMAGE
    args = c["args"]
    for flag in (
        "--model-repository=/models",
        "--model-control-mode=explicit",
        "--disable-auto-complete-config",
        "--strict-readiness=false",
        "--http-restricted-api=model-repository:snooze-admin=$(SNOOZE_TRITON_ADMIN_KEY)",
        "--grpc-restricted-protocol=model-repository:snooze-admin=$(SNOOZE_TRITON_ADMIN_KEY)",
    ):
        assert flag in args
    env = _env(c)
    assert "SNOOZE_TRITON_ADMIN_KEY" in env  # $(VAR) in args expands only from the container env
    assert env["HOME"]["value"] == "/tmp"  # uid 10001 has no home in the Triton image
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/dev/shm"]["name"] == "dshm"
    assert mounts["/models"]["readOnly"] is True


def test_triton_forwards_the_request_id_header(containers: dict[str, dict]) -> None:
    c = containers["triton"]
    env = {name: e.get("value", "secret") for name, e in _env(c).items()}
    args = [_expand(a, env) for a in c["args"]]
    assert _flag(args, "--http-header-forward-pattern") == REQUEST_ID_PATTERN
    assert _flag(args, "--grpc-header-forward-pattern") == REQUEST_ID_PATTERN


def test_triton_on_loopback_ports_apart_from_the_gateway(containers: dict[str, dict]) -> None:
    args = containers["triton"]["args"]
    ports = {kind: int(_flag(args, f"--{kind}-port")) for kind in TRITON_PORTS}
    assert ports == TRITON_PORTS
    for kind in TRITON_PORTS:
        assert _flag(args, f"--{kind}-address") == "127.0.0.1", f"Triton's {kind} port must stay inside the pod"
    # One network namespace: the gateway's and the API's ports (and any fixed loopback port) must differ.
    clash = set(ports.values()) & _controlplane_ports(containers["controlplane"])
    assert not clash, f"ports {sorted(clash)} are both Triton's and the control plane's"


def test_controlplane_points_at_tritons_urls(containers: dict[str, dict]) -> None:
    c = containers["controlplane"]
    env = _env(c)
    assert env["SNOOZE_TARGET"]["value"] == "full"
    assert env["SNOOZE_TRITON_URL"]["value"] == f"http://127.0.0.1:{TRITON_PORTS['http']}"
    assert env["SNOOZE_TRITON_GRPC_URL"]["value"] == f"127.0.0.1:{TRITON_PORTS['grpc']}"
    assert env["SNOOZE_TRITON_METRICS_URL"]["value"] == f"http://127.0.0.1:{TRITON_PORTS['metrics']}"
    for key in ("SNOOZE_API_KEYS", "SNOOZE_ADMIN_KEYS", "SNOOZE_TRITON_ADMIN_KEY"):
        assert env[key]["valueFrom"]["secretKeyRef"]["name"] == SECRET
    args = c["args"]
    assert args[args.index("--target") + 1] == "full"
    assert args[args.index("--triton-url") + 1] == env["SNOOZE_TRITON_URL"]["value"]
    assert args[args.index("--triton-grpc-url") + 1] == env["SNOOZE_TRITON_GRPC_URL"]["value"]
    assert args[args.index("--host") + 1] == "0.0.0.0"


def test_shared_run_folder_in_both_containers(pod: dict, containers: dict[str, dict]) -> None:
    volumes = {v["name"]: v for v in pod["volumes"]}
    journal_dirs = set()
    for name, c in containers.items():
        [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == RUN_DIR]
        assert not mount.get("readOnly"), f"{name}: {RUN_DIR} must be writable"
        run = volumes[mount["name"]]["emptyDir"]
        assert run["medium"] == "Memory" and run["sizeLimit"], "memory-backed, and bounded"
        journal_dirs.add(_env(c)["SNOOZE_JOURNAL_DIR"]["value"])
    assert len({m["name"] for c in containers.values() for m in c["volumeMounts"] if m["mountPath"] == RUN_DIR}) == 1
    [journal] = journal_dirs  # Triton's stubs write where the control plane reads
    assert journal.startswith(RUN_DIR + "/")


def test_secret_and_pvc_references_resolve(docs: list[dict], pod: dict, containers: dict[str, dict]) -> None:
    secrets = _by_kind(docs, "Secret")
    claims = _by_kind(docs, "PersistentVolumeClaim")
    for name, c in containers.items():
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] in secrets, f"{name}: Secret {ref['name']} is not in the base"
                assert ref["key"] in secrets[ref["name"]]["stringData"], f"{name}: no key {ref['key']}"
    volume_names = {v["name"] for v in pod["volumes"]}
    for name, c in containers.items():
        for m in c["volumeMounts"]:
            assert m["name"] in volume_names, f"{name}: mounts {m['name']}, which the pod does not have"
    for v in pod["volumes"]:
        if "persistentVolumeClaim" in v:
            assert v["persistentVolumeClaim"]["claimName"] in claims
    [pvc] = claims.values()
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]  # one pod mounts it: any storage class will do


def test_kubectl_kustomize_builds_the_base() -> None:
    built = kustomize(K8S)
    assert len(built) == 5
    assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "snoozeml" for d in built)
    [dep] = [d for d in built if d["kind"] == "Deployment"]
    images = {c["name"]: c["image"] for c in dep["spec"]["template"]["spec"]["containers"]}
    assert images == {"triton": TRITON_IMAGE, "controlplane": "snoozeml-controlplane:0.1.0"}
    assert dep["spec"]["template"]["spec"]["shareProcessNamespace"] is True
