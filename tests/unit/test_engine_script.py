"""deploy/docker/engine.sh's branches, each with a PATH of stand-ins for docker, dockerd, apt-get, id.

The real engine start is what ``make compose-test`` exercises; here the branches a machine rarely takes:
a docker client but no daemon binary (installed with apt), no client at all, not root, no apt-get, a
daemon that never answers. Each stand-in logs its call; ``docker info`` answers once the stand-in dockerd
has run.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "docker" / "engine.sh"
REAL = ("setsid", "seq", "sleep", "tail", "cat", "touch", "cp")


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f'#!/bin/sh\necho "{name.lstrip(".")} $*" >> "$STUB_LOG"\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


class World:
    def __init__(self, tmp: Path, *, root: bool) -> None:
        self.bin, self.state, self.log = tmp / "bin", tmp / "state", tmp / "calls.log"
        self.bin.mkdir()
        self.state.mkdir()
        for name in REAL:
            os.symlink(shutil.which(name), self.bin / name)
        _stub(self.bin, "id", f"echo {0 if root else 1000}")
        self.dockerd_log = tmp / "dockerd.log"

    def docker_cli(self) -> None:
        _stub(self.bin, "docker", f'[ "$1" = version ] && echo 20.10; [ -e "{self.state}/up" ]')

    def dockerd(self, answers: bool = True) -> None:
        _stub(self.bin, "dockerd", self.dockerd_body(answers))

    def dockerd_body(self, answers: bool = True) -> str:
        """Answers (docker info) once started, if ``answers``; its pid in state/dockerd.pid."""
        up = f'touch "{self.state}/up"; ' if answers else ""
        return f'echo $$ > "{self.state}/dockerd.pid"; {up}exec sleep 30'

    def apt_get(self, provides: tuple[str, ...] = (), ok: bool = True) -> None:
        # `apt-get install ... docker.io`: the packages' binaries appear on PATH (dockerd, debootstrap, docker).
        body = "".join(f'cp "{self.bin}/.{p}" "{self.bin}/{p}"; ' for p in provides)
        _stub(self.bin, "apt-get", f'case "$1" in install) {body}{"exit 0" if ok else "exit 100"};; esac')

    def stage(self, name: str, body: str) -> None:
        """A binary apt-get installs (hidden until then)."""
        _stub(self.bin, f".{name}", body)

    def run(self, wait: int = 5) -> subprocess.CompletedProcess[str]:
        env = {
            "PATH": str(self.bin),
            "STUB_LOG": str(self.log),
            "DOCKERD_LOG": str(self.dockerd_log),
            "ENGINE_WAIT_SECS": str(wait),
            "ENGINE_SBIN_DIRS": "",
        }
        proc = subprocess.run(["/bin/bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
        return proc

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path, root=True)


def _end_dockerd(world: World) -> None:
    """End the stand-in dockerd the script left running (setsid: it outlives the script, as the real one)."""
    pid_file = world.state / "dockerd.pid"
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), 9)
        except ProcessLookupError:
            pass


def test_a_client_without_a_daemon_binary_installs_docker_io_and_starts_it(world: World) -> None:
    # This machine's case: a static docker CLI on PATH, no dockerd.
    world.docker_cli()
    world.stage("dockerd", world.dockerd_body())
    world.stage("debootstrap", "true")
    world.apt_get(provides=("dockerd", "debootstrap"))
    try:
        proc = world.run()
    finally:
        _end_dockerd(world)
    assert proc.returncode == 0, proc.stderr
    calls = world.calls()
    assert "apt-get install -y -q docker.io debootstrap" in calls, calls
    assert "dockerd --bridge=none --iptables=false --ip-masq=false" in calls, calls
    assert "engine up" in proc.stderr


def test_no_client_is_installed_with_apt_as_root(world: World) -> None:
    world.stage("docker", f'[ "$1" = version ] && echo 20.10; [ -e "{world.state}/up" ]')
    world.dockerd()
    world.stage("debootstrap", "true")
    world.apt_get(provides=("docker",))
    (world.bin / "debootstrap").symlink_to(world.bin / ".debootstrap")
    try:
        proc = world.run()
    finally:
        _end_dockerd(world)
    assert proc.returncode == 0, proc.stderr
    assert "apt-get install -y -q docker.io" in world.calls()


def test_an_answering_engine_is_left_alone(world: World) -> None:
    world.docker_cli()
    (world.state / "up").touch()
    world.dockerd()
    proc = world.run()
    assert proc.returncode == 0, proc.stderr
    assert [c for c in world.calls() if not c.startswith("docker ")] == []  # no apt-get, no dockerd


@pytest.mark.parametrize(
    ("setup", "code", "words"),
    [
        ("no_client_not_root", 13, "no docker client on PATH"),
        ("not_root", 10, "this is not root"),
        ("no_apt", 11, "no apt-get to install them"),
        ("apt_fails", 11, "apt-get install docker.io debootstrap failed"),
        ("never_answers", 12, "did not answer within 1s"),
    ],
)
def test_each_failure_has_its_exit_code_and_says_why(tmp_path: Path, setup: str, code: int, words: str) -> None:
    world = World(tmp_path, root=setup not in ("no_client_not_root", "not_root"))
    if setup != "no_client_not_root":
        world.docker_cli()
    if setup == "apt_fails":
        world.apt_get(ok=False)
    if setup == "never_answers":
        world.dockerd(answers=False)
        _stub(world.bin, "debootstrap", "true")
    try:
        proc = world.run(wait=1)
    finally:
        _end_dockerd(world)
    assert proc.returncode == code, proc.stderr
    assert words in proc.stderr, proc.stderr


def test_dockerd_in_sbin_is_found_when_path_lacks_it(tmp_path: Path) -> None:
    # root with a user's PATH (no /usr/sbin): Debian's dockerd is installed, not on PATH.
    world = World(tmp_path, root=True)
    world.docker_cli()
    sbin = tmp_path / "sbin"
    sbin.mkdir()
    _stub(sbin, "dockerd", world.dockerd_body())
    _stub(world.bin, "debootstrap", "true")
    env = {
        "PATH": str(world.bin),
        "STUB_LOG": str(world.log),
        "DOCKERD_LOG": str(world.dockerd_log),
        "ENGINE_WAIT_SECS": "5",
        "ENGINE_SBIN_DIRS": str(sbin),
    }
    try:
        proc = subprocess.run(["/bin/bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    finally:
        _end_dockerd(world)
    assert proc.returncode == 0, proc.stderr
    assert not [c for c in world.calls() if c.startswith("apt-get")]
