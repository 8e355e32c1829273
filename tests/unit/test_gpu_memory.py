"""GPU memory measurement: the NVML reader, NVML pids mapped through /proc NSpid, per-model sums, load deltas.

No GPU is on the machines these tests run on, so NVML is injected at its boundary: ``FakeNvml``
stands in for the ``pynvml`` module and answers as NVML would. The PID-namespace tests use real
files in a folder standing in for /proc (``proc_root``). The ``gpu``-marked tests at the end use
the real pynvml on a machine with a GPU and are skipped elsewhere.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from controlplane.lifecycle.memory.gpu_memory import (
    PROC_PID_INIT_INO,
    GpuDevice,
    GpuLoadDelta,
    NvmlPidMap,
    NvmlReader,
    parse_triton_gpu_memory,
    per_model_gpu_bytes,
    read_nspid,
)

MIB = 1024 * 1024
GIB = 1024 * MIB
INIT_NS = f"pid:[{PROC_PID_INIT_INO}]"


class FakeNvml:
    """Stands in for the pynvml module (no GPU here): the calls NvmlReader makes, with NVML's shapes."""

    class NVMLError(Exception):
        pass

    def __init__(self, gpus: list[dict], *, init_error: str | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict:
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle: dict) -> str | bytes:
        return handle["uuid"]

    def nvmlDeviceGetMemoryInfo(self, handle: dict) -> SimpleNamespace:
        if "memory_error" in handle:
            raise self.NVMLError(handle["memory_error"])
        return SimpleNamespace(total=handle["total"], used=handle["used"], free=handle["total"] - handle["used"])

    def _list(self, handle: dict, kind: str) -> list[SimpleNamespace]:
        if f"{kind}_error" in handle:
            raise self.NVMLError(handle[f"{kind}_error"])
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in handle.get(kind, [])]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: dict) -> list[SimpleNamespace]:
        return self._list(handle, "compute")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: dict) -> list[SimpleNamespace]:
        return self._list(handle, "graphics")

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: dict) -> list[SimpleNamespace]:
        return self._list(handle, "mps")


def two_gpus() -> list[dict]:
    return [
        {
            "uuid": "GPU-aaaa",
            "total": 80 * GIB,
            "used": 4 * GIB,
            "compute": [(200, 1 * GIB), (300, 2 * GIB), (400, 512 * MIB)],  # 400: tritonserver itself
        },
        {
            "uuid": b"GPU-bbbb",
            "total": 80 * GIB,
            "used": 2 * GIB,
            "compute": [(201, 1 * GIB), (200, 256 * MIB)],
            "graphics": [(200, 256 * MIB)],  # a C+G process is listed twice for one allocation
        },
    ]


# ---------------------------------------------------------------------------------------------
# NvmlReader


def test_reader_lists_devices_and_processes_of_every_gpu():
    reader = NvmlReader(FakeNvml(two_gpus()))
    assert reader.devices() == [
        GpuDevice(index=0, uuid="GPU-aaaa", total_bytes=80 * GIB, used_bytes=4 * GIB),
        GpuDevice(index=1, uuid="GPU-bbbb", total_bytes=80 * GIB, used_bytes=2 * GIB),
    ]
    uses = reader.processes()
    assert uses is not None and reader.unavailable is None
    assert [(u.device_index, u.device_uuid, u.pid, u.used_bytes) for u in uses] == [
        (0, "GPU-aaaa", 200, 1 * GIB),
        (0, "GPU-aaaa", 300, 2 * GIB),
        (0, "GPU-aaaa", 400, 512 * MIB),
        (1, "GPU-bbbb", 200, 256 * MIB),
        (1, "GPU-bbbb", 201, 1 * GIB),
    ]


def test_reader_adds_mps_clients_and_keeps_the_known_figure_of_a_process_listed_twice():
    gpus = [{"uuid": "GPU-a", "total": GIB, "used": GIB, "compute": [(7, None)], "mps": [(7, 300 * MIB), (8, MIB)]}]
    uses = NvmlReader(FakeNvml(gpus)).processes()
    assert uses is not None
    assert [(u.pid, u.used_bytes) for u in uses] == [(7, 300 * MIB), (8, MIB)]


def test_reader_ignores_a_graphics_list_the_gpu_does_not_support():
    gpus = [{"uuid": "GPU-a", "total": GIB, "used": GIB, "compute": [(7, MIB)], "graphics_error": "Not Supported"}]
    uses = NvmlReader(FakeNvml(gpus)).processes()
    assert uses is not None and [(u.pid, u.used_bytes) for u in uses] == [(7, MIB)]


def test_reader_without_per_process_figures_on_one_gpu_says_so_with_none():
    gpus = two_gpus()
    gpus[1]["compute_error"] = "Insufficient Permissions"
    assert NvmlReader(FakeNvml(gpus)).processes() is None


def test_reader_skips_a_gpu_whose_memory_cannot_be_read():
    gpus = two_gpus()
    gpus[0]["memory_error"] = "GPU is lost"
    assert [d.uuid for d in NvmlReader(FakeNvml(gpus)).devices()] == ["GPU-bbbb"]


def test_reader_without_a_driver_sees_no_gpu_and_says_why():
    reader = NvmlReader(FakeNvml(two_gpus(), init_error="NVML Shared Library Not Found"))
    assert reader.devices() == [] and reader.processes() == []
    assert reader.unavailable == "no GPU visible: NVML did not start (NVML Shared Library Not Found)"
    reader.close()  # nothing was started: nothing to shut down


def test_reader_without_nvidia_ml_py_sees_no_gpu_and_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # what an environment without the package imports
    reader = NvmlReader()
    assert reader.devices() == [] and reader.processes() == []
    assert reader.unavailable is not None
    assert "no GPU visible" in reader.unavailable and "nvidia-ml-py" in reader.unavailable
    assert "snoozeml[gpu]" in reader.unavailable


def test_reader_shuts_nvml_down_once():
    nvml = FakeNvml(two_gpus())
    reader = NvmlReader(nvml)
    reader.devices()
    reader.close()
    reader.close()
    assert nvml.shutdowns == 1


def test_reader_on_this_machine_never_raises():
    """The real pynvml (or its absence) here: either GPUs are listed, or none with a reason."""
    reader = NvmlReader()
    devices = reader.devices()
    if devices:
        pytest.skip("a GPU is visible: the gpu-marked tests cover it")
    assert reader.processes() == []
    assert reader.unavailable is not None and reader.unavailable.startswith("no GPU visible: ")


# ---------------------------------------------------------------------------------------------
# NVML pids -> our pids through NSpid (fake /proc folders of real files)


def fake_process(proc: Path, pid: int | str, nspid: list[int], ns: str) -> None:
    folder = proc / str(pid)
    (folder / "ns").mkdir(parents=True)
    first = nspid[0]
    tabs = "\t".join(str(p) for p in nspid)
    (folder / "status").write_text(f"Name:\tpython\nTgid:\t{first}\nPid:\t{first}\nNStgid:\t{tabs}\nNSpid:\t{tabs}\n")
    os.symlink(ns, folder / "ns" / "pid")  # a real ns link reads "pid:[<inode>]" too


def test_read_nspid(tmp_path):
    fake_process(tmp_path, 9, [9, 4, 1], INIT_NS)
    assert read_nspid(tmp_path / "9" / "status") == [9, 4, 1]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "status").write_text("Name:\tpython\nPid:\t5\n")  # kernels before 4.1
    assert read_nspid(tmp_path / "old" / "status") is None
    assert read_nspid(tmp_path / "gone" / "status") is None


def test_in_the_initial_namespace_nvml_pids_are_ours(tmp_path):
    fake_process(tmp_path, "self", [100], INIT_NS)
    fake_process(tmp_path, 200, [200], INIT_NS)
    fake_process(tmp_path, 300, [300, 7], "pid:[4026532999]")  # a stub in a container: NVML gives 300 too
    pids = NvmlPidMap(proc_root=tmp_path)
    assert pids.reason is None
    assert pids.visible_pid(200) == 200
    assert pids.visible_pid(300) == 300
    assert pids.visible_pid(999) is None  # exited since NVML listed it


def test_in_a_container_without_the_hosts_proc_nothing_is_guessed(tmp_path):
    own = "pid:[4026532001]"
    fake_process(tmp_path, "self", [1], own)
    fake_process(tmp_path, 200, [200], own)  # our pid 200 is not the host's pid 200
    pids = NvmlPidMap(proc_root=tmp_path)
    assert pids.visible_pid(200) is None
    assert pids.reason is not None
    assert own in pids.reason and "hostPID: true" in pids.reason and "pid: host" in pids.reason


def test_in_a_container_with_the_hosts_proc_nspid_maps_host_pids_of_our_namespace(tmp_path):
    own, other = "pid:[4026532001]", "pid:[4026532002]"
    proc, host = tmp_path / "proc", tmp_path / "host_proc"
    fake_process(proc, "self", [42], own)
    fake_process(host, "self", [5000, 42], own)  # our depth below the host: 1
    fake_process(host, 6001, [6001, 57], own)  # a stub of ours: pid 57 here
    fake_process(host, 6002, [6002, 57], other)  # pid 57 of another container
    fake_process(host, 6003, [6003, 58, 3], "pid:[4026532003]")  # nested below ours
    fake_process(host, 6004, [6004], INIT_NS)  # a host process
    pids = NvmlPidMap(proc_root=proc, host_proc_root=host)
    assert pids.reason is None
    assert pids.visible_pid(6001) == 57
    assert [pids.visible_pid(p) for p in (6002, 6003, 6004, 6005)] == [None, None, None, None]


def test_a_host_proc_without_nspid_cannot_map(tmp_path):
    proc, host = tmp_path / "proc", tmp_path / "host_proc"
    fake_process(proc, "self", [42], "pid:[4026532001]")
    (host / "self").mkdir(parents=True)
    (host / "self" / "status").write_text("Name:\tpython\n")
    pids = NvmlPidMap(proc_root=proc, host_proc_root=host)
    assert pids.visible_pid(42) is None
    assert pids.reason is not None and "NSpid" in pids.reason and str(host) in pids.reason


def test_pid_map_on_this_machines_proc():
    """The real /proc: in the initial namespace this process maps to itself, elsewhere a reason is given."""
    pids = NvmlPidMap()
    if pids.reason is None:
        assert pids.visible_pid(os.getpid()) == os.getpid()
    else:
        assert "PID namespace" in pids.reason and pids.visible_pid(os.getpid()) is None


# ---------------------------------------------------------------------------------------------
# per-model sums


def init_namespace_proc(root: Path, pids: list[int]) -> NvmlPidMap:
    fake_process(root, "self", [100], INIT_NS)
    for pid in pids:
        fake_process(root, pid, [pid], INIT_NS)
    return NvmlPidMap(proc_root=root)


def test_per_model_gpu_bytes_sums_each_models_processes_per_gpu(tmp_path):
    pids = init_namespace_proc(tmp_path, [200, 201, 300, 400])
    reader = NvmlReader(FakeNvml(two_gpus()))
    by_model = per_model_gpu_bytes({"a": [200, 201], "b": [300], "cpu-only": [500]}, reader, pids)
    assert by_model == {"a": {0: 1 * GIB, 1: 1 * GIB + 256 * MIB}, "b": {0: 2 * GIB}, "cpu-only": {}}


def test_per_model_gpu_bytes_is_none_when_nvml_pids_cannot_be_mapped(tmp_path):
    fake_process(tmp_path, "self", [1], "pid:[4026532001]")
    for pid in (200, 201, 300):
        fake_process(tmp_path, pid, [pid], "pid:[4026532001]")
    pids = NvmlPidMap(proc_root=tmp_path)
    reader = NvmlReader(FakeNvml(two_gpus()))
    assert per_model_gpu_bytes({"a": [200, 201], "b": [300]}, reader, pids) is None


def test_per_model_gpu_bytes_without_gpu_processes_is_zero_everywhere_even_unmapped(tmp_path):
    fake_process(tmp_path, "self", [1], "pid:[4026532001]")
    gpus = [{"uuid": "GPU-a", "total": GIB, "used": 0}]
    by_model = per_model_gpu_bytes({"a": [5]}, NvmlReader(FakeNvml(gpus)), NvmlPidMap(proc_root=tmp_path))
    assert by_model == {"a": {}}


def test_per_model_gpu_bytes_is_none_when_nvml_hides_a_models_figure(tmp_path):
    pids = init_namespace_proc(tmp_path, [200, 300])
    gpus = [{"uuid": "GPU-a", "total": GIB, "used": GIB, "compute": [(200, None), (300, MIB)]}]
    assert per_model_gpu_bytes({"a": [200]}, NvmlReader(FakeNvml(gpus)), pids) is None
    # a hidden figure of a process that is no model's does not matter
    assert per_model_gpu_bytes({"b": [300]}, NvmlReader(FakeNvml(gpus)), pids) == {"b": {0: MIB}}


def test_per_model_gpu_bytes_is_none_when_the_reader_cannot_list_processes(tmp_path):
    pids = init_namespace_proc(tmp_path, [200])
    gpus = two_gpus()
    gpus[0]["compute_error"] = "Insufficient Permissions"
    assert per_model_gpu_bytes({"a": [200]}, NvmlReader(FakeNvml(gpus)), pids) is None


# ---------------------------------------------------------------------------------------------
# device totals around a load


def test_load_delta_is_the_rise_per_gpu_matched_by_uuid_and_clamped():
    before = [GpuDevice(0, "GPU-a", 80 * GIB, 1 * GIB), GpuDevice(1, "GPU-b", 80 * GIB, 5 * GIB)]
    delta = GpuLoadDelta(before)
    after = [
        GpuDevice(1, "GPU-a", 80 * GIB, 3 * GIB),  # same GPU under another index: matched by UUID
        GpuDevice(0, "GPU-b", 80 * GIB, 4 * GIB),  # something else freed memory meanwhile
        GpuDevice(2, "GPU-c", 80 * GIB, 9 * GIB),  # not seen before the load
    ]
    assert delta.added(after) == {1: 2 * GIB}


TRITON_METRICS = """\
# HELP nv_inference_count Number of inferences performed
nv_inference_count{model="m",version="1"} 12
# HELP nv_gpu_memory_total_bytes GPU total memory, in bytes
# TYPE nv_gpu_memory_total_bytes gauge
nv_gpu_memory_total_bytes{gpu_uuid="GPU-bbbb"} 16945512448.000000
nv_gpu_memory_total_bytes{gpu_uuid="GPU-aaaa"} 16945512448.000000
# HELP nv_gpu_memory_used_bytes GPU used memory, in bytes
# TYPE nv_gpu_memory_used_bytes gauge
nv_gpu_memory_used_bytes{gpu_uuid="GPU-bbbb"} {used_b}
nv_gpu_memory_used_bytes{gpu_uuid="GPU-aaaa"} {used_a}
# HELP nv_gpu_power_usage GPU power usage in watts
nv_gpu_power_usage{gpu_uuid="GPU-aaaa"} 55.137000
"""


def triton_text(used_a: str, used_b: str) -> str:
    return TRITON_METRICS.replace("{used_a}", used_a).replace("{used_b}", used_b)


def test_parse_triton_gpu_memory_numbers_gpus_by_uuid_or_by_nvml_index():
    text = triton_text("974913536.000000", "0.000000")
    assert parse_triton_gpu_memory(text) == [
        GpuDevice(0, "GPU-aaaa", 16945512448, 974913536),
        GpuDevice(1, "GPU-bbbb", 16945512448, 0),
    ]
    by_nvml = parse_triton_gpu_memory(text, {"GPU-aaaa": 1, "GPU-bbbb": 0})
    assert [(d.index, d.uuid) for d in by_nvml] == [(1, "GPU-aaaa"), (0, "GPU-bbbb")]
    assert parse_triton_gpu_memory('nv_inference_count{model="m"} 1\n') == []


def test_load_delta_from_tritons_metric():
    delta = GpuLoadDelta(parse_triton_gpu_memory(triton_text("1000000000.000000", "5.0e8")))
    after = parse_triton_gpu_memory(triton_text("1734217728.000000", "5.0e8"))
    assert delta.added(after) == {0: 734217728}


# ---------------------------------------------------------------------------------------------
# a real GPU


@pytest.mark.gpu
def test_real_nvml_lists_the_gpus():  # pragma: no cover - GPU machines
    reader = NvmlReader()
    devices = reader.devices()
    if not devices:
        pytest.skip(f"needs an NVIDIA GPU: {reader.unavailable}")
    assert [d.index for d in devices] == list(range(len(devices)))
    for d in devices:
        assert d.uuid.startswith(("GPU-", "MIG-")) and d.total_bytes > 0 and 0 <= d.used_bytes <= d.total_bytes
    uses = reader.processes()
    assert uses is None or all(u.device_index < len(devices) for u in uses)
    reader.close()


@pytest.mark.gpu
def test_real_nvml_attributes_this_processes_cuda_memory():  # pragma: no cover - GPU machines
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    reader = NvmlReader()
    before = GpuLoadDelta(reader.devices())
    block = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    # summed over the GPUs: CUDA's device numbering need not be NVML's
    assert sum(before.added(reader.devices()).values()) >= 256 * MIB
    pids = NvmlPidMap()
    by_model = per_model_gpu_bytes({"this test": [os.getpid()]}, reader, pids)
    if by_model is None:
        pytest.skip(f"no per-process figures here: {pids.reason}")
    assert sum(by_model["this test"].values()) >= 256 * MIB
    del block
    reader.close()
