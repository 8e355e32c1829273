"""deploy/k8s/fleet: structural checks of the fleet overlay, on what `kubectl kustomize` renders (the dev
extra's kubectl; tests/harness/k8s_manifests.py), plus the files themselves.

The overlay turns the base's pod into StatefulSet/snooze-node (so the node pod is the base's pod, changed
only where a fleet must differ), adds the headless Service of the nodes and the fleet gateway Deployment
(`snoozectl fleet gateway`), and makes the repository claim ReadWriteMany. The gateway's flags are parsed
by the real CLI and expanded by the real node-list code, so a flag typo or a name mismatch fails here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer.main

from controlplane.cli import app
from controlplane.fleet.nodes import fleet_nodes
from controlplane.settings import Settings
from harness.k8s_manifests import kustomize

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
FLEET = K8S / "fleet"
TRITON_PORTS = {"http": 8100, "grpc": 8101, "metrics": 8102}
RUN_DIR = "/run/snooze"
SECRET = "snooze-api-keys"
# Where the fleet's node pod may differ from the base's pod, and nowhere else.
NODE_POD_CHANGES = {
    "/metadata/labels/app.kubernetes.io/component",  # node: the base's Services select the gateway now
    "/spec/containers/0/args/0",  # Triton: --model-repository=<the repository folder in the store>
    "/spec/containers/1/env/6/value",  # control plane: SNOOZE_MODEL_REPOSITORY, the same folder
    "/spec/containers/1/args",  # no --models: nodes do not publish at start-up
    "/spec/containers/1/volumeMounts",  # ... so no packages folder
    "/spec/volumes",
    "/spec/initContainers",  # store-init: the repository folder exists before Triton starts
    "/spec/securityContext/fsGroupChangePolicy",  # no recursive chown of the shared store per pod start
}


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return kustomize(FLEET)


@pytest.fixture(scope="module")
def base_pod() -> dict:
    [dep] = [d for d in kustomize(K8S / "base") if d["kind"] == "Deployment"]
    return dep["spec"]["template"]


def _one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} rendered"
    return found[0]


@pytest.fixture(scope="module")
def nodes(rendered: list[dict]) -> dict:
    return _one(rendered, "StatefulSet")


@pytest.fixture(scope="module")
def node_pod(nodes: dict) -> dict:
    return nodes["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def gateway(rendered: list[dict]) -> dict:
    return _one(rendered, "Deployment", "snooze-fleet-gateway")


def _containers(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod["containers"]}


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _flag(args: list[str], name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    return value


def _expand(arg: str, env: dict[str, str]) -> str:
    """What the process receives: Kubernetes expands `$(NAME)` from the container env, `$$` is `$`."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), arg)


def _diff(a: Any, b: Any, path: str = "") -> set[str]:
    """The paths where ``a`` and ``b`` differ (lists of one length item by item, else whole)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {p for k in a.keys() | b.keys() for p in _diff(a.get(k), b.get(k), f"{path}/{k}")}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return {p for i, (x, y) in enumerate(zip(a, b, strict=True)) for p in _diff(x, y, f"{path}/{i}")}
    return set() if a == b else {path}


def _gateway_params(gateway: dict) -> dict[str, Any]:
    """The fleet gateway container's command line, parsed by snoozectl's own parser (env expanded as the
    kubelet does, with namespace 'snooze')."""
    [c] = gateway["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["snoozectl", "fleet", "gateway"]
    env = {"POD_NAMESPACE": "snooze"}
    args = [_expand(a, env) for a in c["args"]]
    group = typer.main.get_command(app)
    command = group.commands["fleet"].commands["gateway"]  # type: ignore[attr-defined]
    return command.make_context("gateway", args).params


# ------------------------------------------------------------------------------------------------


def test_kustomization_lists_existing_files_and_covers_the_folder() -> None:
    kustomization = yaml.safe_load((FLEET / "kustomization.yaml").read_text())
    assert kustomization["resources"][0] == "../base"
    listed = kustomization["resources"][1:] + [p["path"] for p in kustomization["patches"] if "path" in p]
    for name in listed:
        assert (FLEET / name).is_file(), f"kustomization.yaml lists {name}, which does not exist"
    assert {p.name for p in FLEET.glob("*.yaml")} - {"kustomization.yaml"} == set(listed)
    kind_change = [p for p in kustomization["patches"] if p.get("path") == "node-patch.yaml"]
    assert kind_change[0]["options"] == {"allowKindChange": True, "allowNameChange": True}


def test_the_overlay_renders_nodes_a_gateway_and_their_services(rendered: list[dict]) -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in rendered)
    assert kinds == [
        ("Deployment", "snooze-fleet-gateway"),
        ("PersistentVolumeClaim", "snooze-model-repository"),
        ("PodDisruptionBudget", "snooze-fleet-gateway"),
        ("PodDisruptionBudget", "snooze-node"),
        ("Secret", SECRET),
        ("Service", "snooze-api"),
        ("Service", "snooze-gateway"),
        ("Service", "snooze-nodes"),
        ("StatefulSet", "snooze-node"),
    ]
    assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "snoozeml" for d in rendered)
    assert all("namespace" not in d["metadata"] for d in rendered), "namespace-less, as the base"


def test_the_node_pod_is_the_base_pod_changed_only_where_a_fleet_must(base_pod: dict, nodes: dict) -> None:
    assert _diff(base_pod, nodes["spec"]["template"]) == NODE_POD_CHANGES


def test_nodes_are_a_parallel_statefulset_of_three(nodes: dict) -> None:
    spec = nodes["spec"]
    assert spec["replicas"] == 3 and spec["podManagementPolicy"] == "Parallel"
    assert spec["serviceName"] == "snooze-nodes"
    assert "strategy" not in spec, "a Deployment field: a StatefulSet is rejected with it"
    assert "volumeClaimTemplates" not in spec, "one store for every node, not a volume each"
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()


def test_the_node_pod_keeps_the_base_contracts(node_pod: dict) -> None:
    containers = _containers(node_pod)
    assert list(containers) == ["triton", "controlplane"]
    assert node_pod["shareProcessNamespace"] is True  # the control plane sees Triton's processes
    ctx = node_pod["securityContext"]
    uid, gid = ctx["runAsUser"], ctx["runAsGroup"]
    assert ctx["runAsNonRoot"] is True and uid != 0 and ctx["fsGroup"] == gid
    for c in [*node_pod["containers"], *node_pod["initContainers"]]:
        own = c.get("securityContext", {})
        assert own.get("runAsUser", uid) == uid and own.get("runAsGroup", gid) == gid, c["name"]
        assert own["allowPrivilegeEscalation"] is False and own["capabilities"]["drop"] == ["ALL"], c["name"]
    args = containers["triton"]["args"]
    assert {k: int(_flag(args, f"--{k}-port")) for k in TRITON_PORTS} == TRITON_PORTS
    assert all(_flag(args, f"--{k}-address") == "127.0.0.1" for k in TRITON_PORTS)
    assert not set(TRITON_PORTS.values()) & {p["containerPort"] for p in containers["controlplane"]["ports"]}
    volumes = {v["name"]: v for v in node_pod["volumes"]}
    runs = {m["name"] for c in containers.values() for m in c["volumeMounts"] if m["mountPath"] == RUN_DIR}
    [run] = runs
    assert volumes[run]["emptyDir"]["medium"] == "Memory"
    journals = {_env(c)["SNOOZE_JOURNAL_DIR"]["value"] for c in containers.values()}
    [journal] = journals
    assert journal.startswith(RUN_DIR + "/")


def test_every_node_mounts_the_rwx_store_and_its_repository_is_a_folder_in_it(
    rendered: list[dict], node_pod: dict
) -> None:
    containers = _containers(node_pod)
    claim = _one(rendered, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    [store] = [v["name"] for v in node_pod["volumes"] if "persistentVolumeClaim" in v]
    assert {v["persistentVolumeClaim"]["claimName"] for v in node_pod["volumes"] if v["name"] == store} == {
        claim["metadata"]["name"]
    }
    mounts = {
        c["name"]: [m for m in c["volumeMounts"] if m["name"] == store][0]
        for c in [*node_pod["containers"], *node_pod["initContainers"]]
    }
    assert set(mounts) == {"triton", "controlplane", "store-init"}
    [mount_path] = {m["mountPath"] for m in mounts.values()}
    assert mounts["triton"]["readOnly"] is True and not mounts["controlplane"].get("readOnly")
    cp = containers["controlplane"]
    repository = _env(cp)["SNOOZE_MODEL_REPOSITORY"]["value"]
    assert _flag(containers["triton"]["args"], "--model-repository") == repository
    assert "--model-repository" not in cp["args"] and "--models" not in cp["args"]
    # The staging folder and the writers' lock live beside the repository: on the shared volume too.
    assert Path(repository).parent == Path(mount_path) and Path(repository) != Path(mount_path)
    [init] = node_pod["initContainers"]
    assert init["command"] == ["mkdir", "-p", repository]  # Triton will not start on a missing repository
    assert init["image"] == cp["image"]


def test_the_headless_service_selects_the_node_pods_only(rendered: list[dict], nodes: dict, gateway: dict) -> None:
    svc = _one(rendered, "Service", nodes["spec"]["serviceName"])
    spec = svc["spec"]
    assert spec["clusterIP"] == "None"
    # Ready nodes only in DNS: a starting or failing node leaves the ring (docs/deploy.md, "Fleet").
    assert spec["publishNotReadyAddresses"] is False
    node_labels = nodes["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"].items() <= node_labels.items()
    assert not spec["selector"].items() <= gateway["spec"]["template"]["metadata"]["labels"].items()
    ports = {
        p["name"]: p["containerPort"] for p in _containers(nodes["spec"]["template"]["spec"])["controlplane"]["ports"]
    }
    assert {p["targetPort"]: p["port"] for p in spec["ports"]} == ports


def test_the_gateway_routes_to_the_statefulsets_pods(rendered: list[dict], nodes: dict, gateway: dict) -> None:
    params = _gateway_params(gateway)
    assert params["statefulset"] == nodes["metadata"]["name"]
    assert (
        params["service"]
        == nodes["spec"]["serviceName"]
        == _one(rendered, "Service", "snooze-nodes")["metadata"]["name"]
    )
    assert params["replicas"] == nodes["spec"]["replicas"], "the gateway must know every node of the StatefulSet"
    fleet = fleet_nodes(
        [], statefulset=params["statefulset"], service=params["service"], replicas=params["replicas"],
        namespace=params["namespace"], http_port=params["node_http_port"], grpc_port=params["node_grpc_port"],
        api_port=params["node_api_port"],
    )  # fmt: skip
    assert [n.name for n in fleet] == [f"snooze-node-{i}" for i in range(3)]  # the pods' names: ring positions
    assert fleet[0].host == "snooze-node-0.snooze-nodes.snooze.svc"
    node_ports = {
        p["name"]: p["containerPort"] for p in _containers(nodes["spec"]["template"]["spec"])["controlplane"]["ports"]
    }
    assert {"http": fleet[0].http_port, "grpc": fleet[0].grpc_port, "api": fleet[0].api_port} == node_ports
    [c] = gateway["spec"]["template"]["spec"]["containers"]
    assert _env(c)["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_the_node_replicas_and_the_gateways_agree_in_the_files() -> None:
    """The same rule on the files (without kubectl): the patch's replicas and the gateway's --replicas."""
    ops = yaml.safe_load((FLEET / "node-patch.yaml").read_text())
    [replicas] = [op["value"] for op in ops if op["path"] == "/spec/replicas"]
    [deployment] = yaml.safe_load_all((FLEET / "gateway.yaml").read_text())
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert int(args[args.index("--replicas") + 1]) == replicas
    assert args[args.index("--statefulset") + 1] == next(op["value"] for op in ops if op["path"] == "/metadata/name")
    assert args[args.index("--service") + 1] == next(op["value"] for op in ops if op["path"] == "/spec/serviceName")


def test_the_gateway_deployment_replicas_probes_and_ports(gateway: dict) -> None:
    spec = gateway["spec"]
    assert spec["replicas"] >= 2  # stateless: every replica computes the same ring
    pod = spec["template"]["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    [c] = pod["containers"]
    assert c["image"].startswith("snoozeml-controlplane:")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert len(set(ports.values())) == len(ports), "no port twice"
    params = _gateway_params(gateway)
    assert params["host"] == "0.0.0.0"
    # What it listens on (flags over the settings' defaults) is what the pod declares.
    listens = {k: params[f"{k}_port"] or Settings.model_fields[f"{k}_port"].default for k in ("http", "grpc", "api")}
    assert listens == ports
    assert c["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "api"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "api"}
    ctx = pod["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] != 0
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    work = _gateway_params(gateway)["work_dir"]
    assert any(str(work).startswith(m["mountPath"]) for m in c["volumeMounts"]), "Envoy's bootstrap needs a volume"


def test_clients_reach_the_fleet_gateway_under_the_base_service_names(
    rendered: list[dict], gateway: dict, nodes: dict
) -> None:
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    [c] = gateway["spec"]["template"]["spec"]["containers"]
    port_names = {p["name"] for p in c["ports"]}
    ports = {}
    for name in ("snooze-gateway", "snooze-api"):
        spec = _one(rendered, "Service", name)["spec"]
        assert spec["selector"].items() <= labels.items(), f"{name} must select the fleet gateway"
        assert not spec["selector"].items() <= nodes["spec"]["template"]["metadata"]["labels"].items(), name
        assert {p["targetPort"] for p in spec["ports"]} <= port_names
        ports[name] = sorted(p["port"] for p in spec["ports"])
    assert ports == {"snooze-gateway": [8000, 8001], "snooze-api": [8080]}


def test_every_node_and_the_gateway_have_the_same_keys(rendered: list[dict], node_pod: dict, gateway: dict) -> None:
    secret = _one(rendered, "Secret")
    [gw] = gateway["spec"]["template"]["spec"]["containers"]
    cp = _containers(node_pod)["controlplane"]
    for key in ("SNOOZE_API_KEYS", "SNOOZE_ADMIN_KEYS"):
        ref = _env(gw)[key]["valueFrom"]["secretKeyRef"]
        assert ref == _env(cp)[key]["valueFrom"]["secretKeyRef"], key
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]


def test_disruption_budgets_select_their_pods(rendered: list[dict], nodes: dict, gateway: dict) -> None:
    for workload in (nodes, gateway):
        pdb = _one(rendered, "PodDisruptionBudget", workload["metadata"]["name"])
        assert pdb["spec"]["selector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"]
    assert _one(rendered, "PodDisruptionBudget", "snooze-node")["spec"]["maxUnavailable"] == 1
    assert _one(rendered, "PodDisruptionBudget", "snooze-fleet-gateway")["spec"]["minAvailable"] == 1
