"""The pure parts of the lifecycle: OOM detection, load overrides, the autoscaling rule, status."""

from __future__ import annotations

import pytest

from controlplane.lifecycle import (
    GENERATION_PARAMETER,
    LoadWindow,
    ModelState,
    ModelStatus,
    autoscale_step,
    config_with_instances,
    is_oom_error,
    rendered_config,
)

CONFIG = """
name: "m"
backend: "python"
max_batch_size: 8
input [{ name: "x", data_type: TYPE_FP32, dims: [2] }]
output [{ name: "y", data_type: TYPE_FP32, dims: [2] }]
instance_group [{ kind: KIND_CPU, count: 1 }]
"""


@pytest.mark.parametrize(
    ("text", "oom"),
    [
        ("[snooze:oom] model 'm': load ran out of memory (MemoryError: x)", True),
        ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", True),
        ("MemoryError", True),
        ("[snooze:internal] model 'm': load raised RuntimeError: broken weights", False),
    ],
)
def test_is_oom_error(text, oom):
    assert is_oom_error(text) is oom


def test_config_with_instances_sets_the_count_and_leaves_the_input_alone():
    base = rendered_config(CONFIG, where="test")
    assert base["instance_group"] == [{"kind": "KIND_CPU", "count": 1}]
    scaled = config_with_instances(base, 3)
    assert scaled["instance_group"][0] == {"kind": "KIND_CPU", "count": 3}
    assert base["instance_group"][0]["count"] == 1 and "parameters" not in scaled
    assert config_with_instances({"name": "m"}, 2)["instance_group"] == [{"kind": "KIND_CPU", "count": 2}]


def test_replace_changes_a_parameter_every_time():
    first = config_with_instances(rendered_config(CONFIG, where="test"), 1, replace=True)
    second = config_with_instances(first, 1, replace=True)
    assert first["parameters"][GENERATION_PARAMETER] != second["parameters"][GENERATION_PARAMETER]


def step(window: LoadWindow, pending: float, instances: int, now: float) -> int:
    return autoscale_step(
        window, pending=pending, instances=instances, base=1, max_instances=4,
        threshold=4, window_secs=5, idle_timeout_secs=60, now=now,
    )


def test_scale_up_needs_the_queue_high_for_the_whole_window():
    w = LoadWindow()
    assert step(w, 10, 1, now=0) == 1
    assert step(w, 10, 1, now=4.9) == 1
    assert step(w, 10, 1, now=5) == 2  # doubles
    assert step(w, 10, 2, now=6) == 2  # 5 per instance: high again, a new window starts
    assert step(w, 3, 2, now=8) == 2  # dipped below: the window restarts
    assert step(w, 9, 2, now=9) == 2 and step(w, 9, 2, now=14) == 4
    assert step(LoadWindow(high_since=0), 100, 4, now=100) == 4  # max_instances


def test_scale_down_after_idle_timeout_over_n_of_low_load():
    w = LoadWindow()
    assert step(w, 0, 4, now=0) == 4
    assert step(w, 0, 4, now=14.9) == 4
    assert step(w, 0, 4, now=15) == 3  # 60 s / 4 instances
    assert step(w, 0, 3, now=16) == 3 and step(w, 0, 3, now=36) == 2  # 60 / 3
    assert step(w, 0, 1, now=1000) == 1  # never below the deployment's instances


def test_a_queue_between_the_thresholds_keeps_the_count():
    w = LoadWindow()
    for t in range(0, 100, 5):
        assert step(w, 6, 2, now=t) == 2  # 3 per instance: not high; 6 > 4 * (2 - 1) / 2: not low


def test_status_to_dict():
    status = ModelStatus("m", ModelState.READY, None, 2, 1.5, 300, 1024, "measured", 0.4, 1, 2, None)
    assert status.to_dict() == {
        "id": "m", "state": "ready", "reason": None, "instances": 2, "last_access": 1.5,
        "idle_timeout_secs": 300, "memory_bytes": 1024, "memory_source": "measured", "last_cold_start_secs": 0.4,
        "load_count": 1, "processes": 2, "last_crash": None, "gpu_memory_bytes": None, "keep_alive": None,
    }
