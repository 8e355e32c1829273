"""docker-compose.yml and the Kubernetes pod (deploy/k8s/base) describe one stack: what tests/compose proves
on the compose file carries over to the pod only where the two agree.

``STACK`` below is that one description (deploy/stack.toml, from which ``make render`` writes both files:
tests/unit/test_deploy_render.py): Triton's flags, the ports, the uid, the shared folders, the journal, the
health endpoints, the control plane's arguments. Each file is read back into the same shape and must equal
it (what the containers get, not the text: this checks the rendering's meaning); where they differ by design
(Triton's address: the compose network vs the pod's loopback; the probes' form: a compose healthcheck vs
exec/httpGet probes) the test says so.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
POD = ROOT / "deploy" / "k8s" / "base" / "deployment.yaml"
KEY = "<SNOOZE_TRITON_ADMIN_KEY>"


def _described() -> dict:
    """deploy/stack.toml in the shape below, with the values the containers get (the defaults, the key as KEY)."""
    spec = importlib.util.spec_from_file_location("snooze_deploy_render", ROOT / "deploy" / "render.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    d = render.load()
    ports = {f"triton_{n}": str(p) for n, p in d["triton"]["ports"].items()}
    values = {
        "admin_key": KEY,
        "triton_host": "TRITON",
        **ports,
        **{f"volume.{k}": v["path"] for k, v in d["volumes"].items()},
    }

    def fill(text: str) -> str:
        return re.sub(r"\{([\w.]+)\}", lambda m: values[m[1]], text)

    def mounts(part: str) -> dict[str, str]:
        # the work dir is the control plane's own (compose: the image's folder; the pod: an emptyDir)
        return {
            d["volumes"][m["volume"]]["path"]: "ro" if m.get("read_only") else "rw"
            for m in d[part]["mounts"]
            if m["volume"] != "work"
        }

    args = []
    for group in d["triton"]["args"]:
        args += [fill(f) for f in group.get("flags", [])]
        if group.get("ports"):
            args += [f"--{n}-port={p}" for n, p in d["triton"]["ports"].items()]
    cp = d["controlplane"]
    locked = d["drop_capabilities"] == ["ALL"] and d["no_new_privileges"]
    return {
        "uid": f"{d['uid']}:{d['gid']}",
        "triton": {
            "image": d["triton"]["image"],
            "args": args,
            "env": {e["name"]: fill(e["value"]) for e in d["triton"]["env"]},
            "mounts": mounts("triton"),
            "ready": f"http://127.0.0.1:{d['triton']['ports']['http']}{d['triton']['ready']}",
            "locked_down": locked,
        },
        "controlplane": {
            "args": [fill(a) for a in cp["args"]],
            "env": {e["name"]: fill(e["value"]) for e in cp["env"]},
            "secrets": {x["name"] for x in cp["secrets"]},
            "ports": set(cp["ports"].values()),
            "mounts": mounts("controlplane"),
            "ready": cp["ready"],
            "locked_down": locked,
        },
    }


# The one description (deploy/stack.toml), as a shape both files are read into.
STACK = _described()
# Where they differ by design: Triton's host as the control plane names it (compose: the service name on
# the compose network; the pod: loopback, Triton binds 127.0.0.1 only), and Triton's bind-address flags.
TRITON_HOST = {"compose": "triton", "pod": "127.0.0.1"}
# Compose only: docker-init's subreaper switch (the pod's pause process reaps), knobs from .env.
COMPOSE_ONLY_ENV = {"TINI_SUBREAPER", "SNOOZE_LOG_LEVEL", "SNOOZE_MEMORY_BUDGET_MB"}
POD_ONLY_TRITON_ARGS = {"--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"}


def _compose_value(value: str) -> str:
    """As the container gets it with the defaults: ``${V:-d}`` is d, a required key is KEY, ``$$`` is ``$``."""

    def one(m: re.Match[str]) -> str:
        if m[0] == "$$":
            return "$"
        name, _, default = m[1].partition(":-")
        return KEY if name == "SNOOZE_TRITON_ADMIN_KEY" else (default if ":-" in m[1] else f"<{name.split(':')[0]}>")

    return re.sub(r"\$\$|\$\{([^}]*)\}", one, str(value))


def _pod_value(value: str) -> str:
    return str(value).replace("$(SNOOZE_TRITON_ADMIN_KEY)", KEY)


def _host(value: str, topology: str) -> str:
    return re.sub(rf"(//|^){re.escape(TRITON_HOST[topology])}:", r"\1TRITON:", value)


def _compose_locked(svc: dict) -> bool:
    """No capabilities and no privilege gain."""
    return svc.get("cap_drop") == ["ALL"] and "no-new-privileges:true" in svc.get("security_opt", [])


def _pod_locked(container: dict) -> bool:
    sc = container.get("securityContext", {})
    return sc.get("capabilities", {}).get("drop") == ["ALL"] and sc.get("allowPrivilegeEscalation") is False


@pytest.fixture(scope="module")
def compose() -> dict:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    t, c = services["triton"], services["controlplane"]

    def mounts(svc: dict) -> dict[str, str]:
        found = {}
        for v in svc["volumes"]:
            parts = _compose_value(v).split(":")
            found[parts[1]] = "ro" if parts[2:] == ["ro"] else "rw"
        return found

    def env(svc: dict) -> dict[str, str]:
        return {
            k: _host(_compose_value(v), "compose") for k, v in svc["environment"].items() if k not in COMPOSE_ONLY_ENV
        }

    cp_env = env(c)
    return {
        "uid": {t["user"], c["user"]},
        "triton": {
            "image": t["image"],
            "args": [_compose_value(a) for a in t["command"][1:]],
            "env": env(t),
            "mounts": mounts(t),
            "ready": next(_compose_value(a) for a in t["healthcheck"]["test"] if "/v2/health/ready" in str(a)),
            "locked_down": _compose_locked(t),
        },
        "controlplane": {
            "args": [_host(_compose_value(a), "compose") for a in c["command"]],
            "env": {k: v for k, v in cp_env.items() if k not in STACK["controlplane"]["secrets"]},
            "secrets": {k for k, v in c["environment"].items() if re.fullmatch(rf"\$\{{{k}:\?.*\}}", str(v))},
            "ports": {int(p.rsplit(":", 1)[1]) for p in c["ports"]},
            "mounts": {p: m for p, m in mounts(c).items()},
            "ready": "/health/ready" if "/health/ready" in " ".join(c["healthcheck"]["test"]) else None,
            "locked_down": _compose_locked(c),
        },
    }


@pytest.fixture(scope="module")
def pod() -> dict:
    [dep] = [d for d in yaml.safe_load_all(POD.read_text()) if d and d["kind"] == "Deployment"]
    spec = dep["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in spec["containers"]}
    t, c = containers["triton"], containers["controlplane"]

    def mounts(container: dict) -> dict[str, str]:
        return {
            m["mountPath"]: "ro" if m.get("readOnly") else "rw"
            for m in container["volumeMounts"]
            if m["mountPath"] != "/dev/shm" and m["mountPath"] != "/var/lib/snooze"
        }

    def env(container: dict) -> dict[str, str]:
        return {e["name"]: _host(_pod_value(e["value"]), "pod") for e in container["env"] if "value" in e}

    sc = spec["securityContext"]
    return {
        "uid": {f"{sc['runAsUser']}:{sc['runAsGroup']}"},
        "shared_pid": spec.get("shareProcessNamespace"),
        "triton": {
            "image": t["image"],
            "args": [_pod_value(a) for a in t["args"] if a not in POD_ONLY_TRITON_ARGS],
            "env": env(t),
            "mounts": mounts(t),
            "ready": next(a for a in t["readinessProbe"]["exec"]["command"] if "/v2/health/ready" in a),
            "locked_down": _pod_locked(t),
        },
        "controlplane": {
            "args": [_host(a, "pod") for a in c["args"]],
            "env": env(c),
            "secrets": {e["name"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})},
            "ports": {p["containerPort"] for p in c["ports"]},
            "mounts": mounts(c),
            "ready": c["readinessProbe"]["httpGet"]["path"],
            "locked_down": _pod_locked(c),
        },
    }


@pytest.mark.parametrize("part", ["triton", "controlplane"])
def test_compose_and_pod_match_the_one_description(compose: dict, pod: dict, part: str) -> None:
    for name, found in (("docker-compose.yml", compose), ("deploy/k8s/base/deployment.yaml", pod)):
        want = STACK[part]
        got = {k: found[part][k] for k in want}
        # The work dir is the control plane's own (compose: the image's folder; the pod: an emptyDir).
        assert got == want, f"{name} ({part}) differs from the stack description"


def test_one_uid_and_one_pid_namespace(compose: dict, pod: dict) -> None:
    assert compose["uid"] == pod["uid"] == {STACK["uid"]}
    assert pod["shared_pid"] is True
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    # Compose's pause container, as the pod's: both containers join a namespace neither owns.
    assert services["triton"]["pid"] == services["controlplane"]["pid"] == "service:pidns"


def test_the_description_is_what_tests_compose_runs() -> None:
    """tests/compose runs the shipped compose file; its override may change images and networking only."""
    override = yaml.safe_load((ROOT / "tests" / "compose" / "docker-compose.test.yml").read_text())
    allowed = {"image", "network_mode", "extra_hosts", "environment"}
    for name, svc in override["services"].items():
        assert set(svc) <= allowed, f"the test override changes {set(svc) - allowed} of {name}"
        for key in svc.get("environment", {}):
            assert key in ("SNOOZE_HTTP_PORT", "SNOOZE_GRPC_PORT", "SNOOZE_API_PORT"), key  # ports only
