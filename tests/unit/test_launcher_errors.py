"""Error paths of the embedded launcher: every missing piece names itself and its fix."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from controlplane.errors import SnoozeError, TritonLaunchError
from controlplane.triton import embedded_dist, launcher
from controlplane.triton.embedded_dist import (
    EmbeddedTritonDist,
    detect_backends,
    find_embedded_triton,
    prepare_backend_dir,
)
from controlplane.triton.launcher import EmbeddedTriton


def _touch(path: Path, text: str = "", executable: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if executable:
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def fake_dist(tmp_path, monkeypatch) -> Path:
    """A site-packages folder shaped like the nvidia-pytriton wheel, with a stub for Python 3.11 only."""
    site = tmp_path / "site-packages"
    root = site / "pytriton" / "tritonserver"
    _touch(root / "bin" / "tritonserver", executable=True)
    _touch(root / "backends" / "python" / "libtriton_python.so")
    _touch(root / "backends" / "python" / "triton_python_backend_utils.py", "# utils\n")
    _touch(root / "backends" / "python" / "__pycache__" / "triton_python_backend_utils.cpython-311.pyc")
    _touch(root / "python_backend_stubs" / "3.11" / "triton_python_backend_stub", "stub", executable=True)
    (site / "nvidia_pytriton.libs").mkdir()
    monkeypatch.setattr(embedded_dist, "_ldd_missing", lambda binary, library_path: [])
    monkeypatch.setattr(embedded_dist, "_ldconfig_libs", lambda: {"libpython3.11.so.1.0"})
    monkeypatch.setattr(embedded_dist.sysconfig, "get_config_var", lambda name: str(tmp_path / "no-libdir"))
    monkeypatch.setattr(embedded_dist.os, "confstr", lambda name: "glibc 2.36")
    monkeypatch.setattr(embedded_dist.platform, "machine", lambda: "x86_64")
    return site / "pytriton"


def test_fake_dist_is_found(fake_dist):
    dist = find_embedded_triton(fake_dist, "3.11")
    assert dist.stub.parent.name == "3.11" and dist.libpython_dir is None
    assert dist.library_path() == str(fake_dist.parent / "nvidia_pytriton.libs")


def test_errors_are_snooze_errors_with_hints():
    err = TritonLaunchError("boom", hint="fix it")
    assert isinstance(err, SnoozeError) and err.status_code == 500
    assert err.to_dict() == {"error": "boom", "code": "triton_launch_failed", "hint": "fix it"}


def test_pytriton_not_installed(monkeypatch):
    monkeypatch.setattr(embedded_dist.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(embedded_dist.os, "confstr", lambda name: "glibc 2.36")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(TritonLaunchError, match="nvidia-pytriton package is not installed") as info:
        find_embedded_triton()
    assert info.value.hint == "pip install 'snoozeml[embedded]'"


def test_wrong_machine(fake_dist, monkeypatch):
    monkeypatch.setattr(embedded_dist.platform, "machine", lambda: "aarch64")
    with pytest.raises(TritonLaunchError, match="Linux x86_64 only.*aarch64") as info:
        find_embedded_triton(fake_dist, "3.11")
    assert "docker compose" in info.value.hint


@pytest.mark.parametrize("glibc", ["glibc 2.31", "glibc 2.34", ""])
def test_glibc_too_old(fake_dist, monkeypatch, glibc):
    monkeypatch.setattr(embedded_dist.os, "confstr", lambda name: glibc)
    with pytest.raises(TritonLaunchError, match="needs glibc >= 2.35"):
        find_embedded_triton(fake_dist, "3.11")


def test_no_stub_for_this_python(fake_dist):
    with pytest.raises(TritonLaunchError) as info:
        find_embedded_triton(fake_dist, "3.9")
    assert "no python backend stub for Python 3.9" in info.value.message
    assert "available: 3.11" in info.value.message


def test_missing_binary_names_the_file(fake_dist):
    (fake_dist / "tritonserver" / "bin" / "tritonserver").unlink()
    with pytest.raises(TritonLaunchError, match="tritonserver binary is missing: .*bin/tritonserver") as info:
        find_embedded_triton(fake_dist, "3.11")
    assert "pip install" in info.value.hint


def test_no_libpython_anywhere(fake_dist, monkeypatch):
    monkeypatch.setattr(embedded_dist, "_ldconfig_libs", lambda: set())
    with pytest.raises(TritonLaunchError, match="no libpython3.11.so found") as info:
        find_embedded_triton(fake_dist, "3.11")
    assert "apt-get install libpython3.11" in info.value.hint and "--enable-shared" in info.value.hint


def test_libpython_in_libdir_goes_on_library_path(fake_dist, tmp_path, monkeypatch):
    libdir = tmp_path / "pylib"
    _touch(libdir / "libpython3.11.so.1.0")
    monkeypatch.setattr(embedded_dist, "_ldconfig_libs", lambda: set())
    monkeypatch.setattr(embedded_dist.sysconfig, "get_config_var", lambda name: str(libdir))
    dist = find_embedded_triton(fake_dist, "3.11")
    assert dist.libpython_dir == libdir
    assert dist.library_path().endswith(os.pathsep + str(libdir))


def test_stub_cannot_load_libpython(fake_dist, monkeypatch):
    monkeypatch.setattr(embedded_dist, "_ldd_missing", lambda binary, library_path: ["libpython3.11.so.1.0"])
    with pytest.raises(TritonLaunchError, match="cannot load libpython3.11.so.1.0") as info:
        find_embedded_triton(fake_dist, "3.11")
    assert "apt-get install libpython3.11" in info.value.hint


def test_prepare_backend_dir_is_idempotent_and_keeps_exec_bit(fake_dist, tmp_path):
    dist = find_embedded_triton(fake_dist, "3.11")
    work = tmp_path / "work"
    backends = prepare_backend_dir(work, dist)
    assert backends == work / "backends"
    files = sorted(p.name for p in (backends / "python").iterdir())
    assert files == ["libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"]
    stub = backends / "python" / "triton_python_backend_stub"
    assert os.access(stub, os.X_OK)
    inode = stub.stat().st_ino
    assert prepare_backend_dir(work, dist) == backends
    assert stub.stat().st_ino == inode  # unchanged files are not rewritten
    assert detect_backends(backends) == {"python"}
    assert detect_backends(tmp_path / "nowhere") == set()


def test_start_reports_exit_with_log_tail(fake_dist, tmp_path):
    dist = find_embedded_triton(fake_dist, "3.11")
    server = _touch(tmp_path / "tritonserver", "#!/bin/sh\nfor i in $(seq 1 60); do echo line $i; done\nexit 3\n", True)
    fake = EmbeddedTritonDist(server, dist.libs_dir, dist.python_backend_dir, dist.stub, "3.11", None)
    (tmp_path / "repo").mkdir()
    triton = EmbeddedTriton(tmp_path / "repo", tmp_path / "work", dist=fake)
    with pytest.raises(TritonLaunchError) as info:
        triton.start(timeout=10)
    message = info.value.message
    assert "exited with code 3" in message and str(triton.log_file) in message
    assert "line 60" in message and "line 21\n" in message and "line 20\n" not in message  # the last 40 lines
    assert not triton.is_running()


def test_start_refuses_a_missing_repository(fake_dist, tmp_path):
    dist = find_embedded_triton(fake_dist, "3.11")
    triton = EmbeddedTriton(tmp_path / "missing", tmp_path / "work", dist=dist)
    with pytest.raises(TritonLaunchError, match="missing is not a folder"):
        triton.start()


def test_environment_puts_libs_and_env_bin_first(fake_dist, tmp_path, monkeypatch):
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/other")
    dist = find_embedded_triton(fake_dist, "3.11")
    env = EmbeddedTriton(tmp_path, tmp_path / "work", http_port=1, grpc_port=2, metrics_port=3, dist=dist).environment()
    assert env["LD_LIBRARY_PATH"] == f"{dist.libs_dir}{os.pathsep}/opt/other"
    assert env["PATH"].split(os.pathsep)[0] == str(Path(launcher.sys.executable).parent)
