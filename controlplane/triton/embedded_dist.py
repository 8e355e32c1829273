"""The embedded target's pieces: the ``tritonserver`` binary and python backend shipped in the nvidia-pytriton
wheel, found and checked (platform, glibc, libpython, the stub matching this interpreter) before anything
runs, and the backend folder ``EmbeddedTriton`` (``launcher.py``) points tritonserver at."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from controlplane.errors import TritonLaunchError
from controlplane.triton.processes import STUB_NAME

MIN_GLIBC = (2, 35)
INSTALL_HINT = "pip install 'snoozeml[embedded]'"


@dataclass(frozen=True)
class EmbeddedTritonDist:
    """Where the pieces of the embedded Triton live."""

    tritonserver: Path
    libs_dir: Path
    python_backend_dir: Path
    stub: Path
    python_version: str
    libpython_dir: Path | None  # the interpreter's own libpython folder, put on LD_LIBRARY_PATH

    def library_path(self) -> str:
        dirs = [self.libs_dir] + ([self.libpython_dir] if self.libpython_dir else [])
        return os.pathsep.join(str(d) for d in dirs)


def _glibc_version() -> tuple[int, int] | None:
    try:
        value = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        return None
    m = re.fullmatch(r"glibc (\d+)\.(\d+).*", value)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _check_platform() -> None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        raise TritonLaunchError(
            f"the embedded Triton (nvidia-pytriton wheel) runs on Linux x86_64 only; this is "
            f"{sys.platform} {platform.machine()}",
            hint="run the compose target (the official Triton image) instead: docker compose up",
        )
    glibc = _glibc_version()
    if glibc is None or glibc < MIN_GLIBC:
        found = ".".join(map(str, glibc)) if glibc else "no glibc"
        raise TritonLaunchError(
            f"the embedded Triton needs glibc >= {MIN_GLIBC[0]}.{MIN_GLIBC[1]}; this system has {found}",
            hint="use a newer distribution (e.g. Ubuntu 22.04+) or the compose target (official image)",
        )


def _pytriton_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonLaunchError("the nvidia-pytriton package is not installed", hint=INSTALL_HINT)
    return Path(next(iter(spec.submodule_search_locations)))


def _require(path: Path, what: str) -> Path:
    if not path.exists():
        raise TritonLaunchError(
            f"{what} is missing: {path} does not exist (broken nvidia-pytriton install?)",
            hint=f"reinstall it: pip install --force-reinstall 'nvidia-pytriton>=0.7,<0.8' ({INSTALL_HINT})",
        )
    return path


def _ldconfig_libs() -> set[str]:
    """Library names the system loader knows (``ldconfig -p``); empty if ldconfig is unavailable."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {line.split()[0] for line in out.splitlines()[1:] if line.strip()}


def _ldd_missing(binary: Path, library_path: str) -> list[str]:
    """Libraries ``ldd`` reports as "not found" for ``binary``; empty if ldd is unavailable."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return []
    env = dict(os.environ, LD_LIBRARY_PATH=library_path)
    try:
        out = subprocess.run([ldd, str(binary)], capture_output=True, text=True, timeout=30, env=env).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split("=>")[0].strip() for line in out.splitlines() if "not found" in line]


def _libpython_hint(version: str) -> str:
    return (
        f"install the Python shared library, e.g. `apt-get install libpython{version}`, "
        f"or build Python with --enable-shared (pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared)"
    )


def _find_libpython(version: str) -> Path | None:
    """The folder holding this interpreter's libpython, or None if only the system loader has one."""
    libdir = sysconfig.get_config_var("LIBDIR")
    names = {f"libpython{version}.so.1.0", f"libpython{version}.so"}
    if libdir and any((Path(libdir) / n).exists() for n in names):
        return Path(libdir)
    if names & _ldconfig_libs():
        return None
    raise TritonLaunchError(
        f"no libpython{version}.so found (looked in LIBDIR {libdir} and `ldconfig -p`): the python "
        f"backend stub embeds Python {version} and cannot start without it",
        hint=_libpython_hint(version),
    )


def find_embedded_triton(pytriton_dir: Path | None = None, python_version: str | None = None) -> EmbeddedTritonDist:
    """Locate and check the embedded Triton for this interpreter; raise ``TritonLaunchError`` with the fix."""
    _check_platform()
    root = (pytriton_dir or _pytriton_dir()) / "tritonserver"
    version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    tritonserver = _require(root / "bin" / "tritonserver", "the tritonserver binary")
    libs_dir = _require(root.parent.parent / "nvidia_pytriton.libs", "the bundled library folder")
    backend_dir = _require(root / "backends" / "python", "the python backend")
    _require(backend_dir / "libtriton_python.so", "the python backend library")
    stubs = root / "python_backend_stubs"
    stub = stubs / version / STUB_NAME
    if not stub.exists():
        available = sorted(p.parent.name for p in stubs.glob(f"*/{STUB_NAME}"))
        raise TritonLaunchError(
            f"nvidia-pytriton has no python backend stub for Python {version} ({stub} does not exist; "
            f"available: {', '.join(available) or 'none'})",
            hint=f"run snoozeml with one of the Python versions {', '.join(available) or 'it supports'}",
        )
    dist = EmbeddedTritonDist(tritonserver, libs_dir, backend_dir, stub, version, _find_libpython(version))
    missing = _ldd_missing(stub, dist.library_path())
    if any("libpython" in m for m in missing):
        raise TritonLaunchError(
            f"the python backend stub {stub} cannot load {', '.join(missing)}", hint=_libpython_hint(version)
        )
    if missing:
        raise TritonLaunchError(
            f"the python backend stub {stub} cannot load {', '.join(missing)}",
            hint=f"install the missing system libraries, or reinstall nvidia-pytriton ({INSTALL_HINT})",
        )
    return dist


def _copy_if_changed(src: Path, dst: Path) -> None:
    """Copy with mode and mtime; skip identical files; replace atomically (a running stub stays intact)."""
    if dst.exists():
        s, d = src.stat(), dst.stat()
        if s.st_size == d.st_size and s.st_mtime_ns == d.st_mtime_ns:
            return
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def prepare_backend_dir(work_dir: Path, dist: EmbeddedTritonDist | None = None) -> Path:
    """Fill ``<work_dir>/backends/python/`` with the python backend and this interpreter's stub.

    Returns ``<work_dir>/backends``, the folder to pass as ``--backend-directory``.
    """
    dist = dist or find_embedded_triton()
    backends = Path(work_dir) / "backends"
    target = backends / "python"
    target.mkdir(parents=True, exist_ok=True)
    for src in dist.python_backend_dir.iterdir():
        if src.is_file():
            _copy_if_changed(src, target / src.name)
    _copy_if_changed(dist.stub, target / STUB_NAME)
    return backends


def detect_backends(backend_dir: Path) -> set[str]:
    """Names of the backends in a Triton backend folder (sub-folders holding a ``libtriton_*.so``)."""
    backend_dir = Path(backend_dir)
    if not backend_dir.is_dir():
        return set()
    return {d.name for d in backend_dir.iterdir() if d.is_dir() and any(d.glob("libtriton_*.so"))}
