"""The shipped docker-compose.yml and Kubernetes manifests are the rendering of one description
(deploy/stack.toml + deploy/templates/, ``make render``): where they must agree, they come from one place."""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("snooze_deploy_render", ROOT / "deploy" / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)


@pytest.mark.parametrize("shipped", sorted(render.OUTPUTS))
def test_shipped_file_is_its_rendering(shipped: str) -> None:
    want = render.rendered()[shipped]
    got = (ROOT / shipped).read_text()
    assert got == want, (
        f"{shipped} differs from its rendering of deploy/stack.toml and "
        f"deploy/templates/{render.OUTPUTS[shipped][0]}: edit those and run `make render` "
        f"(python3 deploy/render.py), never the rendered file"
    )


def _parsed(stack: dict) -> tuple[dict, dict]:
    out = render.rendered(stack)
    compose = yaml.safe_load(out["docker-compose.yml"])["services"]
    [dep] = [d for d in yaml.safe_load_all(out["deploy/k8s/base/deployment.yaml"]) if d and d["kind"] == "Deployment"]
    return compose, dep["spec"]["template"]["spec"]


def test_one_change_to_the_description_reaches_compose_and_the_pod() -> None:
    stack = copy.deepcopy(render.load())
    stack["triton"]["ports"]["http"] = 8200
    stack["uid"], stack["gid"] = 10002, 10003
    stack["volumes"]["journal"]["path"] = "/run/elsewhere"
    stack["controlplane"]["ports"]["api"] = 8090
    compose, pod = _parsed(stack)
    containers = {c["name"]: c for c in pod["containers"]}

    assert "--http-port=${TRITON_HTTP_PORT:-8200}" in compose["triton"]["command"]
    assert "--http-port=8200" in containers["triton"]["args"]
    assert compose["controlplane"]["environment"]["SNOOZE_TRITON_URL"] == "http://triton:${TRITON_HTTP_PORT:-8200}"
    assert {"name": "SNOOZE_TRITON_URL", "value": "http://127.0.0.1:8200"} in containers["controlplane"]["env"]
    assert "http://127.0.0.1:${TRITON_HTTP_PORT:-8200}/v2/health/ready" in compose["triton"]["healthcheck"]["test"]
    assert "http://127.0.0.1:8200/v2/health/ready" in containers["triton"]["readinessProbe"]["exec"]["command"]

    assert {compose[s]["user"] for s in ("pidns", "triton", "controlplane")} == {"10002:10003"}
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (10002, 10003)

    assert "snooze-run:/run/elsewhere" in compose["triton"]["volumes"]
    assert {"name": "run", "mountPath": "/run/elsewhere"} in containers["triton"]["volumeMounts"]
    assert compose["triton"]["environment"]["SNOOZE_JOURNAL_DIR"] == "/run/elsewhere/journal"

    assert "${API_PORT:-8090}:8090" in compose["controlplane"]["ports"]
    assert {"name": "api", "containerPort": 8090} in containers["controlplane"]["ports"]


def test_compose_escapes_a_literal_dollar_and_the_pod_keeps_it() -> None:
    compose, pod = _parsed(render.load())
    [triton] = [c for c in pod["containers"] if c["name"] == "triton"]
    # compose reads $$ as a literal $ (a lone $ would start a variable); Kubernetes expands only $(NAME).
    assert "--http-header-forward-pattern=^x-request-id$$" in compose["triton"]["command"]
    assert "--http-header-forward-pattern=^x-request-id$" in triton["args"]
    key = "--http-restricted-api=model-repository:snooze-admin="
    assert (
        key + "${SNOOZE_TRITON_ADMIN_KEY:?set SNOOZE_TRITON_ADMIN_KEY in .env (see .env.example)}"
        in compose["triton"]["command"]
    )
    assert key + "$(SNOOZE_TRITON_ADMIN_KEY)" in triton["args"]


@pytest.mark.parametrize(
    "text",
    [
        "0.0.0.0",
        "10001:10001",
        "8080",
        "1.5",
        "true",
        "off",
        "null",
        "~",
        "",
        "a: b",
        "x #y",
        "#c",
        "{x}",
        "[x]",
        "- x",
        "* x",
        "'q'",
        '"q"',
        "@x",
        "%x",
        "--flag=a:b",
        "${V:?set V in .env (see .env.example)}",
        "http://h:${P:-1}",
        "^x-request-id$",
        "0x1F",
        ".inf",
        "12:30:00",
        "1e3",
    ],
)
def test_scalars_read_back_as_the_same_string(text: str) -> None:
    assert yaml.safe_load(f"k: {render.scalar(text)}")["k"] == text


def test_unknown_placeholder_names_the_template_line_and_the_known_names() -> None:
    with pytest.raises(SystemExit) as e:
        render.render("a: 1\nb: {{ triton.imag }}\n", "compose", name="deploy/templates/x.yml")
    assert "deploy/templates/x.yml:2: unknown placeholder {{ triton.imag }}" in str(e.value)
    assert "triton.image" in str(e.value)


def test_check_mode_names_a_drifted_file(tmp_path: Path) -> None:
    # A copy of the repository's deploy inputs and their renderings, then one rendered file edited by hand.
    files = {
        rel: (ROOT / rel).read_text()
        for rel in [
            "deploy/render.py",
            "deploy/stack.toml",
            *(f"deploy/templates/{t}" for t, _ in render.OUTPUTS.values()),
        ]
    }
    for rel, text in {**files, **render.rendered()}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    pod = tmp_path / "deploy/k8s/base/deployment.yaml"
    pod.write_text(pod.read_text().replace("--http-port=8100", "--http-port=8111"))
    run = [sys.executable, str(tmp_path / "deploy/render.py"), "--check"]
    proc = subprocess.run(run, capture_output=True, text=True)
    assert proc.returncode == 1
    assert "deploy/k8s/base/deployment.yaml differs" in proc.stderr and "make render" in proc.stderr, proc.stderr
    assert "docker-compose.yml" not in proc.stderr
    # make render (without --check) puts it back.
    assert subprocess.run(run[:-1], capture_output=True).returncode == 0
    assert subprocess.run(run, capture_output=True).returncode == 0
    assert "--http-port=8100" in pod.read_text()
