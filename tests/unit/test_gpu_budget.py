"""The GPU memory budget policy (pure): LRU victims per GPU, the errors, GPU out-of-memory wordings,
instance placement and need estimates. No GPU is involved: the policy takes numbers."""

from __future__ import annotations

import pytest

from controlplane.errors import UnavailableError
from controlplane.lifecycle.configs import rendered_config
from controlplane.lifecycle.memory.gpu_budget import (
    GpuResident,
    estimate_gpu_need,
    gpu_instances_per_device,
    plan_gpu_eviction,
    plan_gpu_oom_eviction,
)
from controlplane.lifecycle.memory.oom import is_cuda_oom, is_oom_error
from controlplane.lifecycle.memory.units import MIB


def resident(model: str, last_access: float, evictable: bool = True, **mib_by_gpu: int) -> GpuResident:
    """``resident("a", 10, gpu0=600)``: model a, last used at t=10, holding 600 MiB on GPU 0."""
    usage = {int(k.removeprefix("gpu")): v * MIB for k, v in mib_by_gpu.items()}
    return GpuResident(model=model, bytes_by_device=usage, last_access=last_access, evictable=evictable)


def mib(**by_gpu: int) -> dict[int, int]:
    return {int(k.removeprefix("gpu")): v * MIB for k, v in by_gpu.items()}


RESIDENTS = [
    resident("a", 10, gpu0=600),
    resident("b", 5, gpu0=300),
    resident("c", 1, gpu1=200),  # least recent of all, but on the other GPU
]


def test_no_budget_or_room_enough_evicts_nothing():
    assert plan_gpu_eviction("m", mib(gpu0=5000), RESIDENTS, None) == []
    assert plan_gpu_eviction("m", mib(gpu0=100), RESIDENTS, 1000) == []


def test_least_recently_used_on_the_needed_gpu_goes_first_and_only_as_many_as_needed():
    assert plan_gpu_eviction("m", mib(gpu0=300), RESIDENTS, 1000) == ["b"]
    assert plan_gpu_eviction("m", mib(gpu0=500), RESIDENTS, 1000) == ["b", "a"]


def test_models_in_use_are_never_victims():
    residents = [resident("a", 10, gpu0=600), resident("b", 5, evictable=False, gpu0=300)]
    assert plan_gpu_eviction("m", mib(gpu0=300), residents, 1000) == ["a"]


def test_a_victim_frees_every_gpu_it_holds():
    residents = [
        resident("d", 3, gpu0=400, gpu1=400),
        resident("e", 1, gpu1=500),  # older, but d's eviction already makes room on GPU 1
        resident("f", 0, evictable=False, gpu0=500),
    ]
    assert plan_gpu_eviction("m", mib(gpu0=300, gpu1=300), residents, 1000) == ["d"]
    assert plan_gpu_eviction("m", mib(gpu0=300, gpu1=600), residents, 1000) == ["e", "d"]


def test_a_prewarmed_model_nobody_used_goes_before_the_least_recently_used():
    residents = [
        resident("old", 1, gpu0=300),
        GpuResident("bet", {0: 300 * MIB}, last_access=50, evictable=True, prewarmed_unused=True),
    ]
    assert plan_gpu_eviction("m", mib(gpu0=500), residents, 1000) == ["bet"]
    assert plan_gpu_eviction("m", mib(gpu0=800), residents, 1000) == ["bet", "old"]
    assert plan_gpu_oom_eviction(mib(gpu0=100), residents) == ["bet"]


def test_ties_in_last_access_are_broken_by_name():
    residents = [resident("y", 5, gpu0=500), resident("x", 5, gpu0=500)]
    assert plan_gpu_eviction("m", mib(gpu0=100), residents, 1000) == ["x"]


def test_full_of_models_in_use_names_model_gpu_mib_holders_and_fix():
    residents = [resident("busy", 1, evictable=False, gpu1=800), resident("idle", 2, gpu1=100)]
    with pytest.raises(UnavailableError) as info:
        plan_gpu_eviction("m", mib(gpu1=300), residents, 1000)
    err = info.value
    assert err.message == (
        "GPU memory budget full on GPU 1: model 'm' needs about 300 MiB and 800 of 1000 MiB are held by "
        "models in use (busy)"
    )
    assert err.hint is not None and "SNOOZE_GPU_MEMORY_BUDGET_MB" in err.hint and "retry when they are idle" in err.hint
    assert err.retry_after == 5 and err.status_code == 503


def test_all_or_nothing_across_gpus():
    residents = [resident("a", 1, gpu0=900), resident("busy", 2, evictable=False, gpu1=900)]
    with pytest.raises(UnavailableError, match="on GPU 1: model 'm' needs about 200 MiB"):
        plan_gpu_eviction("m", mib(gpu0=200, gpu1=200), residents, 1000)


def test_more_than_the_whole_budget_is_refused_up_front():
    with pytest.raises(UnavailableError) as info:
        plan_gpu_eviction("big", mib(gpu0=1500), [], 1000)
    assert info.value.message == (
        "model 'big' needs about 1500 MiB on GPU 0, more than the whole GPU memory budget (1000 MiB per GPU)"
    )
    assert info.value.hint is not None and "SNOOZE_GPU_MEMORY_BUDGET_MB" in info.value.hint


def test_a_gpu_over_budget_that_the_model_does_not_need_is_left_alone():
    residents = [resident("a", 1, gpu1=1200)]  # the budget was lowered while a stayed loaded
    assert plan_gpu_eviction("m", {0: 100 * MIB, 1: 0}, residents, 1000) == []


def test_after_a_gpu_oom_idle_models_on_the_needed_gpus_go_until_the_need_is_freed():
    residents = [
        resident("a", 10, gpu0=600),
        resident("b", 5, gpu0=300),
        resident("c", 1, gpu1=200),
        resident("busy", 0, evictable=False, gpu0=5000),
    ]
    assert plan_gpu_oom_eviction(mib(gpu0=200), residents) == ["b"]
    assert plan_gpu_oom_eviction(mib(gpu0=800), residents) == ["b", "a"]
    assert plan_gpu_oom_eviction(mib(gpu0=5000), residents) == ["b", "a"]  # best effort: all that is idle there
    assert plan_gpu_oom_eviction({0: 0}, residents) == ["b"]  # need not known: one model
    assert plan_gpu_oom_eviction({}, residents) == ["c", "b"]  # placement not known: one per GPU
    assert plan_gpu_oom_eviction(mib(gpu2=100), residents) == []


# ---------------------------------------------------------------------------------------------
# GPU out-of-memory wordings


@pytest.mark.parametrize(
    "text",
    [
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total capacity)",
        "[snooze:oom] model 'm': load ran out of memory (OutOfMemoryError: CUDA out of memory. Tried to allocate)",
        "cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY",
        "cudaMalloc returned cudaErrorMemoryAllocation",
        "CUDA failure 2: out of memory ; GPU=0 ; hostname=h ; expr=cudaMalloc(&p, bytes);",
        "CUDA error cudaErrorMemoryAllocation:out of memory",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)",
        "[TRT] [E] 2: [virtualMemoryBuffer.cpp::resizePhysical::145] Error Code 2: OutOfMemory (no further info)",
        "[TRT] Requested amount of GPU memory (4294967296 bytes) could not be allocated.",
        "[E] [TRT] safeRuntime.cpp (25) - Cuda Error in allocate: 2 (out of memory)",
    ],
)
def test_gpu_out_of_memory_wordings(text):
    assert is_cuda_oom(text)


@pytest.mark.parametrize(
    "text", ["[snooze:oom] model 'm': load ran out of memory (MemoryError: )", "MemoryError: out of memory"]
)
def test_host_out_of_memory_is_not_gpu_out_of_memory(text):
    assert not is_cuda_oom(text)


@pytest.mark.parametrize(
    "text",
    ["Stub process 'm_0_0' is not healthy.", "[snooze:model_error] model 'm': load raised RuntimeError: CUDA broke"],
)
def test_other_errors_are_not_out_of_memory_even_on_a_gpu(text):
    assert not is_cuda_oom(text) and not is_cuda_oom(text, on_gpu=True)


ORT_ARENA = (
    "onnx runtime error 6: Non-zero status code returned while running Mul node. Status Message: "
    "bfc_arena.cc:368 onnxruntime::BFCArena::AllocateRawInternal Failed to allocate memory for requested buffer "
    "of size 2830172160"
)


def test_a_failure_that_does_not_name_its_device_counts_for_a_model_on_a_gpu():
    assert not is_cuda_oom(ORT_ARENA)
    assert is_cuda_oom(ORT_ARENA, on_gpu=True)
    assert is_cuda_oom("[snooze:oom] model 'm': load ran out of memory (MemoryError: )", on_gpu=True)


def test_every_gpu_wording_of_the_host_markers_is_also_gpu():
    """What the lifecycle's host OOM markers catch with a GPU in the text, is_cuda_oom catches too."""
    text = "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert is_oom_error(text) and is_cuda_oom(text)


# ---------------------------------------------------------------------------------------------
# placement and estimates

CONFIG = """
name: "m"
backend: "onnxruntime"
max_batch_size: 8
input [{{ name: "x", data_type: TYPE_FP32, dims: [2] }}]
output [{{ name: "y", data_type: TYPE_FP32, dims: [2] }}]
{groups}
"""


def placement(groups: str, devices: list[int]) -> dict[int, int]:
    return gpu_instances_per_device(rendered_config(CONFIG.format(groups=groups), where="test"), devices)


def test_instances_per_gpu_follow_tritons_instance_groups():
    assert placement("instance_group [{ kind: KIND_GPU, count: 2, gpus: [1] }]", [0, 1]) == {1: 2}
    assert placement("instance_group [{ kind: KIND_GPU }]", [0, 1]) == {0: 1, 1: 1}
    assert placement("instance_group [{ kind: KIND_CPU, count: 4 }]", [0, 1]) == {}
    assert placement("", [0]) == {0: 1}  # no group: KIND_AUTO, one instance per GPU
    assert placement("instance_group [{ kind: KIND_GPU, count: 2 }]", []) == {}
    two_groups = "instance_group [{ kind: KIND_GPU, gpus: [0] }, { kind: KIND_GPU, count: 3, gpus: [0, 1] }]"
    assert placement(two_groups, [0, 1]) == {0: 4, 1: 3}


def test_need_scales_the_last_measurement_per_instance():
    assert estimate_gpu_need({0: 3}, measured={0: 1000}, measured_instances={0: 2}) == {0: 1500}
    # a GPU it was never measured on takes the average per instance of the others
    assert estimate_gpu_need({0: 1, 1: 2}, measured={0: 600}, measured_instances={0: 2}) == {0: 300, 1: 600}
    assert estimate_gpu_need({0: 2}, per_instance_fallback=100) == {0: 200}
    assert estimate_gpu_need({0: 0, 1: 1}) == {1: 0}


@pytest.mark.parametrize("policy", ["lru", "gdsf"])
def test_the_gpu_budget_evicts_in_the_host_budgets_order(policy):
    """One eviction order for host and GPU memory: the unused pre-warms first, then gdsf or lru per the setting."""
    import asyncio
    from pathlib import Path

    from controlplane.lifecycle.memory.gpu import GpuMemory
    from controlplane.lifecycle.memory.host import MemoryBudget
    from controlplane.lifecycle.state import ModelRecord, ModelState
    from controlplane.settings import Settings
    from controlplane.spec import DeploymentSpec
    from controlplane.store import PublishedModel

    def record(model_id: str, touched: float) -> ModelRecord:
        dep = DeploymentSpec(id=model_id, path=Path("."))
        rec = ModelRecord(
            model_id, PublishedModel(model_id, Path("."), dep, "custom", "python", [], [], {}, {}, 60, 60)
        )
        rec.state, rec.access.touched = ModelState.READY, touched
        rec.memory.footprint, rec.memory.footprint_instances, rec.load.last_cold_start = 100 * MIB, 1, 0.5
        rec.memory.gpu_footprint, rec.memory.gpu_instances = {0: 300 * MIB}, 1
        return rec

    hot, cold, new = record("hot", 10.0), record("cold", 20.0), record("new", 0.0)  # hot: used less recently
    new.state, new.memory.gpu_footprint = ModelState.UNLOADED, None
    records = {r.id: r for r in (hot, cold, new)}

    class States:
        def values(self) -> list[ModelRecord]:
            return list(records.values())

        def get(self, model_id: str) -> ModelRecord | None:
            return records.get(model_id)

    async def pending() -> dict[str, float]:
        return {}

    settings = Settings(eviction_policy=policy, gpu_memory_budget_mb=1000)
    host = MemoryBudget(settings, States(), pending=pending)  # type: ignore[arg-type]
    host.accessed(hot, 50)
    host.accessed(cold, 1)
    gpu = GpuMemory(
        settings,
        States(),
        None,
        pending=pending,
        reader=object(),
        pid_map=object(),
        order=host.eviction_order,
    )
    plan = asyncio.run(gpu.plan_room(new, {0: 600 * MIB}))
    assert plan is not None
    first = [v.id for v in plan.victims]
    assert first == [r.id for r in host.eviction_order([hot, cold])][:1]
    assert first == (["hot"] if policy == "lru" else ["cold"])


def test_one_oom_classifier_for_the_stub_and_the_control_plane():
    """The stub classifies its own failures with the function the control plane reads Triton's errors with."""
    from controlplane.lifecycle.memory.oom import classify_oom
    from python_backend import errors as runtime_errors

    assert classify_oom is runtime_errors.classify_oom
    # a GPU-only wording the stub's check once missed: the model's failure is an out-of-memory, not its bug
    exc = RuntimeError("CUDNN_STATUS_ALLOC_FAILED")
    assert runtime_errors.is_oom(exc)
    assert runtime_errors.describe_failure(exc, "m", "predict", 4)[0] == runtime_errors.OOM
    assert classify_oom(runtime_errors.describe_failure(exc, "m", "predict", 4)[1]) == "gpu"
    assert runtime_errors.is_oom(MemoryError()) and not runtime_errors.is_oom(ValueError("bad shape"))
