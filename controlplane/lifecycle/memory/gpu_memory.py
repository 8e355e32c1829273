"""GPU memory per model and per device: NVML reads, NVML pids mapped to ours, deltas around a load.

Two ways to measure what a model holds on each GPU:

1. **Per process** (``per_model_gpu_bytes``): NVML lists the processes using each GPU with their
   memory. A python-backend model's processes (its stubs, and preforked workers) are known to the
   process-observation layer, so their NVML entries add up to the model's memory per device. This
   needs NVML pids that can be mapped to the pids the control plane sees (below), and NVML to report
   per-process memory at all (``usedGpuMemory`` is "not available" under Windows WDDM and for
   unprivileged readers of MIG devices). It cannot split the memory of ``tritonserver`` itself among
   the models of in-process backends (onnxruntime, TensorRT).
2. **Per load** (``GpuLoadDelta``): device-wide used memory (NVML's device totals, or Triton's
   ``nv_gpu_memory_used_bytes{gpu_uuid=...}`` metric) sampled before and after a load; the rise is
   the model's. Only sound while loads are serialised (one at a time) and nothing else on the GPU
   grows meanwhile; it clamps at 0. Triton refreshes its GPU metrics every ``--metrics-interval-ms``
   (2000 ms by default), so the "after" sample from Triton must be taken one interval after the load.

PID namespaces: what can be mapped, and why
-------------------------------------------
The NVIDIA driver does not know PID namespaces: NVML reports every process by its pid in the
initial (host) PID namespace, also when asked from inside a container (NVIDIA's nvidia-docker#1483,
#179). The control plane knows its models' processes by the pids of its own namespace.

``/proc/<pid>/status`` has ``NSpid:``, the process's pid in each PID namespace it belongs to, from
the namespace of *that /proc mount* inward to the process's own. So it can translate an outer pid
to an inner one, never an inner one to an outer one: from a container's own /proc no line names a
host pid, and a host pid from NVML cannot be matched there. Matching NVML's number against the
inner entries ("NSpid contains the NVML pid") would be wrong: host pid 57 and a container's pid 57
are different processes. What can be mapped:

- The control plane in the initial PID namespace (embedded, two processes on a host, or a container
  run with ``pid: host`` / ``hostPID: true``): NVML pids are its pids; Triton's stubs in a nested
  namespace are still seen by their host pid, the outermost NSpid entry, which is what NVML reports.
  Whether this is the initial namespace is told by ``/proc/self/ns/pid``: the kernel gives the
  initial PID namespace the fixed inode number 0xEFFFFFFC (``PROC_PID_INIT_INO``); and /proc must be
  this namespace's own (NSpid of ``/proc/self`` has one entry).
- The control plane in its own namespace, with the host's /proc mounted read-only somewhere
  (``host_proc_root``): ``<host_proc>/self`` resolves to this process, whose NSpid there has one
  entry per namespace level, so its length gives our depth ``d`` below the host. A process with host
  pid N whose NSpid (in the host's /proc) has ``d + 1`` entries and whose ``ns/pid`` is ours has our
  pid ``NSpid[d]``. Processes of other containers fail the namespace test and stay unmapped. Setting
  ``host_proc_root`` asserts that the folder is the host's /proc; reading a process's ``ns/pid``
  needs ptrace-read access to it (the same uid is enough), and where it is refused the pid stays
  unmapped.
- Anything else (compose's ``pid: "service:triton"``, Kubernetes' ``shareProcessNamespace``
  without the host's /proc): cannot be mapped. ``NvmlPidMap.reason`` says why, and the caller falls
  back to per-load deltas. A pid that cannot be mapped is never guessed.

That NVML reports host pids is NVIDIA's statement, not measured here (no GPU on the development
machines). Should a driver translate pids to the caller's namespace, a container without the host's
/proc would fall back to deltas needlessly, and ``host_proc_root`` would map wrongly.

No code here raises when there is no GPU: a missing ``nvidia-ml-py`` or driver gives a reader with
no devices and ``unavailable`` set to why.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("snoozeml.gpu")

# The kernel's fixed inode number of the initial PID namespace (include/linux/proc_ns.h).
PROC_PID_INIT_INO = 0xEFFFFFFC
GPU_EXTRA_HINT = "pip install 'snoozeml[gpu]' (nvidia-ml-py) on a machine with the NVIDIA driver"


@dataclass(frozen=True)
class GpuDevice:
    index: int  # NVML's index, as nvidia-smi shows it
    uuid: str
    total_bytes: int
    used_bytes: int  # device-wide: every process, not only models


@dataclass(frozen=True)
class GpuProcessUse:
    device_index: int
    device_uuid: str
    pid: int  # as NVML reports it: a pid of the initial (host) PID namespace
    used_bytes: int | None  # None: NVML cannot tell (WDDM, MIG without privileges)


class GpuProcessReader(Protocol):
    """What the accounting needs from NVML; tests inject a fake at this boundary."""

    def devices(self) -> list[GpuDevice]:
        """The visible GPUs; [] when none is visible."""
        ...

    def processes(self) -> list[GpuProcessUse] | None:
        """Processes using each GPU; [] when no GPU is visible, None when per-process use cannot be read."""
        ...


class NvmlReader:
    """``GpuProcessReader`` on NVML through ``pynvml`` (package ``nvidia-ml-py``), imported on first use.

    ``nvml`` replaces the pynvml module (tests, where no GPU is). Without the package or the driver
    the reader sees no GPU and ``unavailable`` says why; it never raises for that.
    """

    def __init__(self, nvml: Any = None) -> None:
        self._nvml = nvml
        self._started = False
        self.unavailable: str | None = None

    def _start(self) -> Any | None:
        if self._started:
            return self._nvml
        if self.unavailable is not None:
            return None
        nvml = self._nvml
        if nvml is None:
            try:
                nvml = importlib.import_module("pynvml")  # the gpu extra: not there on a CPU machine
            except ImportError:
                self.unavailable = f"no GPU visible: nvidia-ml-py is not installed ({GPU_EXTRA_HINT})"
                return None
        try:
            nvml.nvmlInit()
        except Exception as e:  # no library, no driver, no device: NVML says which
            self.unavailable = f"no GPU visible: NVML did not start ({e})"
            return None
        self._nvml, self._started = nvml, True
        return nvml

    def close(self) -> None:
        if self._started:
            self._started = False
            try:
                self._nvml.nvmlShutdown()
            except Exception as e:  # shutting down must not fail the caller's own shutdown
                log.warning("NVML shutdown failed: %s", e)

    def _handles(self, nvml: Any) -> list[tuple[int, Any, str]]:
        found = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            found.append((index, handle, _text(nvml.nvmlDeviceGetUUID(handle))))
        return found

    def devices(self) -> list[GpuDevice]:
        nvml = self._start()
        if nvml is None:
            return []
        devices = []
        try:
            handles = self._handles(nvml)
        except Exception as e:  # a GPU fell off the bus, the driver went away: nothing to count
            log.warning("NVML could not list the GPUs: %s", e)
            return []
        for index, handle, uuid in handles:
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as e:  # one broken GPU must not hide the others
                log.warning("NVML could not read the memory of GPU %d (%s): %s", index, uuid, e)
                continue
            devices.append(GpuDevice(index=index, uuid=uuid, total_bytes=int(info.total), used_bytes=int(info.used)))
        return devices

    def processes(self) -> list[GpuProcessUse] | None:
        nvml = self._start()
        if nvml is None:
            return []
        try:
            handles = self._handles(nvml)
        except Exception as e:
            log.warning("NVML could not list the GPUs: %s", e)
            return None
        uses: list[GpuProcessUse] = []
        for index, handle, uuid in handles:
            try:
                found = _device_processes(nvml, handle)
            except Exception as e:  # per-process figures missing on one GPU make every total wrong
                log.warning("NVML could not list the processes of GPU %d (%s): %s", index, uuid, e)
                return None
            uses.extend(GpuProcessUse(index, uuid, pid, used) for pid, used in sorted(found.items()))
        return uses


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _device_processes(nvml: Any, handle: Any) -> dict[int, int | None]:
    """pid -> used bytes on one GPU, from the compute list and (where the GPU has them) the graphics
    and MPS lists; a process in several lists (type C+G) holds one allocation, so it counts once."""
    found: dict[int, int | None] = {}
    lists = [nvml.nvmlDeviceGetComputeRunningProcesses(handle)]
    for optional in ("nvmlDeviceGetGraphicsRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses"):
        query = getattr(nvml, optional, None)
        if query is None:
            continue
        try:
            lists.append(query(handle))
        except Exception as e:  # compute-only GPUs may not support these lists; compute is what CUDA uses
            log.debug("NVML %s: %s", optional, e)
    for procs in lists:
        for p in procs:
            used = None if p.usedGpuMemory is None else int(p.usedGpuMemory)
            if p.pid not in found or found[p.pid] is None:
                found[p.pid] = used
            elif used is not None:
                found[p.pid] = max(found[p.pid] or 0, used)
    return found


# ---------------------------------------------------------------------------------------------
# NVML pids -> our pids


def read_nspid(status_file: Path) -> list[int] | None:
    """The ``NSpid:`` entries of a ``/proc/<pid>/status`` file; None when it cannot be read or has none."""
    try:
        text = status_file.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("NSpid:"):
            try:
                return [int(field) for field in line.split()[1:]] or None
            except ValueError:
                return None
    return None


def _pid_namespace(proc: Path) -> str | None:
    """``pid:[<inode>]`` of a /proc/<pid> folder's PID namespace; None when it cannot be read."""
    try:
        return os.readlink(proc / "ns" / "pid")
    except OSError:
        return None


class NvmlPidMap:
    """Maps NVML pids (initial PID namespace) to the pids this process sees; see the module docstring.

    ``proc_root`` is this process's /proc; ``host_proc_root``, where given, is the host's /proc
    mounted inside a container. Tests pass folders of real files standing in for both.
    """

    def __init__(self, proc_root: Path = Path("/proc"), host_proc_root: Path | None = None) -> None:
        self.proc_root = proc_root
        self.host_proc_root = host_proc_root
        self._decided = False
        self._host: Path | None = None  # the /proc to read NVML pids in
        self._depth = 0  # how many namespace levels this process is below the host
        self._own_ns: str | None = None
        self._reason: str | None = None

    @property
    def reason(self) -> str | None:
        """Why NVML pids cannot be mapped here; None when they can."""
        self._decide()
        return self._reason

    def _decide(self) -> None:
        if self._decided:
            return
        self._decided = True
        self._own_ns = _pid_namespace(self.proc_root / "self")
        if self._own_ns is None:
            self._reason = f"cannot read {self.proc_root}/self/ns/pid: this process's PID namespace is unknown"
            return
        if self.host_proc_root is not None:
            chain = read_nspid(self.host_proc_root / "self" / "status")
            if chain is None:
                self._reason = (
                    f"{self.host_proc_root}/self/status has no NSpid line: not a /proc mount, or a kernel before 4.1"
                )
                return
            self._host, self._depth = self.host_proc_root, len(chain) - 1
            return
        own = read_nspid(self.proc_root / "self" / "status")
        if self._own_ns == f"pid:[{PROC_PID_INIT_INO}]" and own is not None and len(own) == 1:
            self._host, self._depth = self.proc_root, 0
            return
        self._reason = (
            f"the control plane runs in its own PID namespace ({self._own_ns}); NVML reports host pids, which "
            "/proc's NSpid lines of this namespace never name; run it in the host's PID namespace "
            "(compose `pid: host`, Kubernetes `hostPID: true`) for per-process figures"
        )

    def visible_pid(self, nvml_pid: int) -> int | None:
        """The pid this process knows NVML's ``nvml_pid`` by; None when it is not ours to see or cannot be told."""
        self._decide()
        if self._host is None:
            return None
        chain = read_nspid(self._host / str(nvml_pid) / "status")
        if chain is None or chain[0] != nvml_pid:
            return None  # gone, or this /proc is not the namespace NVML counts in
        if self._depth == 0:
            return nvml_pid  # we live in the initial namespace: NVML's pids are ours
        if len(chain) != self._depth + 1 or _pid_namespace(self._host / str(nvml_pid)) != self._own_ns:
            return None  # another container's process, or one nested below ours
        return chain[self._depth]


def per_model_gpu_bytes(
    pids_by_model: Mapping[str, Iterable[int]], reader: GpuProcessReader, pid_map: NvmlPidMap
) -> dict[str, dict[int, int]] | None:
    """``{model: {device_index: bytes}}`` from NVML's per-process figures; ``{}`` for a model with no GPU memory.

    ``pids_by_model``: each model's processes (stubs, workers) as this process sees them; only models
    whose GPU memory lives in processes of their own (python backend), since what an in-process backend
    holds is inside tritonserver's figure, which no model owns. None when
    per-process figures cannot be had here (no mapping of NVML pids, or NVML without per-process
    memory): measure each load with ``GpuLoadDelta`` instead.
    """
    uses = reader.processes()
    if uses is None:
        return None
    result: dict[str, dict[int, int]] = {model: {} for model in pids_by_model}
    if not uses:
        return result
    if pid_map.reason is not None:
        return None
    owner = {pid: model for model, pids in pids_by_model.items() for pid in pids}
    for use in uses:
        pid = pid_map.visible_pid(use.pid)
        model = None if pid is None else owner.get(pid)
        if model is None:
            continue  # tritonserver itself, other programs, other containers
        if use.used_bytes is None:
            return None
        per_device = result[model]
        per_device[use.device_index] = per_device.get(use.device_index, 0) + use.used_bytes
    return result


# ---------------------------------------------------------------------------------------------
# Device totals around a load


class GpuLoadDelta:
    """What one load added on each GPU: device-wide used memory before it, compared with after it.

    Matches devices by UUID (indices can differ between readers); a GPU that freed memory meanwhile
    counts 0, and GPUs the load did not grow are left out.
    """

    def __init__(self, before: Iterable[GpuDevice]) -> None:
        self._before = {d.uuid: d.used_bytes for d in before}

    def added(self, after: Iterable[GpuDevice]) -> dict[int, int]:
        grown = {}
        for d in after:
            if d.uuid in self._before and d.used_bytes > self._before[d.uuid]:
                grown[d.index] = d.used_bytes - self._before[d.uuid]
        return grown


_TRITON_GPU_MEMORY_RE = re.compile(r"^nv_gpu_memory_(used|total)_bytes\{([^}]*)\}\s+(\S+)", re.MULTILINE)
_UUID_LABEL_RE = re.compile(r'gpu_uuid="([^"]*)"')


def parse_triton_gpu_memory(metrics_text: str, index_of_uuid: Mapping[str, int] | None = None) -> list[GpuDevice]:
    """The GPUs in Triton's Prometheus text, from ``nv_gpu_memory_{used,total}_bytes{gpu_uuid=...}``.

    Triton labels GPUs by UUID only. ``index_of_uuid`` (from ``NvmlReader.devices()``) gives them
    NVML's indices; without it they are numbered in UUID order, stable labels that need not match
    nvidia-smi's.
    """
    used: dict[str, int] = {}
    total: dict[str, int] = {}
    for kind, labels, value in _TRITON_GPU_MEMORY_RE.findall(metrics_text):
        uuid = _UUID_LABEL_RE.search(labels)
        if uuid is None:
            continue
        try:
            number = int(float(value))
        except ValueError:
            continue
        (used if kind == "used" else total)[uuid.group(1)] = number
    uuids = sorted(used)
    indices = index_of_uuid or {uuid: i for i, uuid in enumerate(uuids)}
    return [
        GpuDevice(index=indices[uuid], uuid=uuid, total_bytes=total.get(uuid, 0), used_bytes=used[uuid])
        for uuid in uuids
        if uuid in indices
    ]
