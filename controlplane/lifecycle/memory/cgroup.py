"""The container's own count: the memory cgroup tritonserver runs in, its limit and its usage.

The kernel OOM-kills on the cgroup's count, not on any sum of per-process figures, so where the control plane can
read Triton's cgroup (embedded; docker compose with ``pid: "service:triton"``; a Kubernetes pod with a shared
process namespace) it is the ceiling: the default budget is its limit less a headroom, and each sweep evicts when
its usage passes that, whatever the per-model sums say.

Which cgroup: ``/proc/<triton pid>/cgroup`` names it (``0::<path>`` on cgroup v2; ``N:memory:<path>`` on v1), under
``/sys/fs/cgroup`` (v2) or ``/sys/fs/cgroup/memory`` (v1). In a container with its own cgroup namespace the path
reads ``/`` and ``/sys/fs/cgroup`` is the container's own; a path that does not exist here (another cgroup
namespace) falls back to that root, where the files are the container's.

Usage is the working set: ``memory.current`` (v2) or ``memory.usage_in_bytes`` (v1) less the inactive file pages
(``memory.stat``), which the kernel reclaims before it OOM-kills; what kubelet evicts pods on. The page cache of
model files just read would otherwise count as held.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.lifecycle.memory.units import MIB

log = logging.getLogger("snoozeml.lifecycle")

# A limit at or above this is "no limit" (v1 writes LONG_MAX rounded down to a page: 9223372036854771712).
_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class CgroupMemory:
    """One reading of a memory cgroup."""

    path: Path  # the cgroup's folder under /sys
    version: int  # 1 or 2
    limit: int | None  # bytes; None: no limit
    usage: int  # the working set: usage less inactive file pages


def cgroup_dir(pid: int, proc_root: Path = Path("/proc"), sys_root: Path = Path("/sys")) -> tuple[Path, int] | None:
    """The folder of the memory cgroup process ``pid`` runs in, and the cgroup version; None when not readable."""
    try:
        lines = (proc_root / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    base = sys_root / "fs" / "cgroup"
    for line in lines:  # v1's memory controller first: on a hybrid host the v2 line holds no memory controller
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier != "0" and "memory" in controllers.split(","):
            return _existing(base / "memory", path, "memory.limit_in_bytes"), 1
    for line in lines:
        if line.startswith("0::"):
            return _existing(base, line[3:], "memory.max"), 2
    return None


def _existing(root: Path, path: str, probe: str) -> Path:
    here = root / path.lstrip("/")
    return here if (here / probe).exists() else root


def read_cgroup(where: tuple[Path, int]) -> CgroupMemory | None:
    """The cgroup's limit and working set now; None when its files cannot be read (no memory controller)."""
    path, version = where
    names = ("memory.max", "memory.current") if version == 2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    try:
        raw_limit = (path / names[0]).read_text().strip()
        usage = int((path / names[1]).read_text())
    except (OSError, ValueError):
        return None
    limit = None if raw_limit == "max" or not raw_limit.isdigit() or int(raw_limit) >= _UNLIMITED else int(raw_limit)
    return CgroupMemory(path, version, limit, max(usage - _inactive_file(path, version), 0))


def _inactive_file(path: Path, version: int) -> int:
    key = "inactive_file" if version == 2 else "total_inactive_file"
    try:
        for line in (path / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def headroom_bytes(limit: int, headroom_mb: float | None) -> int:
    """What the budget leaves free below the cgroup's limit: ``SNOOZE_MEMORY_HEADROOM_MB``, else 10% of the limit
    (the control plane, Envoy and the kernel's own charges share the container; a load grows before it is
    measured)."""
    return int(headroom_mb * MIB) if headroom_mb is not None else limit // 10


class TritonCgroup:
    """Triton's memory cgroup, found through tritonserver's pid (looked up again when the server changes)."""

    def __init__(
        self,
        server_pid: Callable[[], int | None],
        *,
        proc_root: Path = Path("/proc"),
        sys_root: Path = Path("/sys"),
    ) -> None:
        self._server_pid = server_pid
        self.proc_root = proc_root
        self.sys_root = sys_root
        self._found: tuple[int, tuple[Path, int] | None] | None = None  # (pid, where) as last looked up

    @classmethod
    def of(cls, processes: Any, sys_root: Path = Path("/sys")) -> TritonCgroup:
        """The cgroup of the tritonserver that ``processes`` (a ``TritonProcesses``) sees."""

        def pid() -> int | None:
            server = processes.server()
            return server.pid if server is not None else None

        return cls(pid, proc_root=processes.proc_root, sys_root=sys_root)

    def read(self) -> CgroupMemory | None:
        """The cgroup's limit and working set now; None where tritonserver or its cgroup cannot be seen."""
        pid = self._server_pid()
        if pid is None:
            return None
        if self._found is None or self._found[0] != pid:
            self._found = (pid, cgroup_dir(pid, self.proc_root, self.sys_root))
        where = self._found[1]
        return read_cgroup(where) if where is not None else None
