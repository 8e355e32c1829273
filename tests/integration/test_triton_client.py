"""TritonAdminClient against the session's real tritonserver."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from controlplane.errors import NotFoundError, TritonError, TritonModelLoadError, UnavailableError
from controlplane.triton.client import TritonAdminClient, parse_pending_request_counts
from controlplane.triton.launcher import free_port
from harness.probes import grpc_infer

METRICS = """\
# HELP nv_inference_pending_request_count Instantaneous number of pending requests per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="a",version="1"} 3
nv_inference_pending_request_count{model="a",version="2"} 1
nv_inference_pending_request_count{version="1",model="b-2"} 0
nv_inference_count{model="a",version="1"} 17
"""


def test_parse_pending_request_counts():
    assert parse_pending_request_counts(METRICS) == {"a": 4.0, "b-2": 0.0}
    assert parse_pending_request_counts("") == {}


async def test_unreachable_triton_is_unavailable():
    async with TritonAdminClient(f"http://127.0.0.1:{free_port()}", timeout=2) as admin:
        assert not await admin.live()
        with pytest.raises(UnavailableError) as info:
            await admin.repository_index()
    assert info.value.status_code == 503 and info.value.retry_after == 1


@pytest.mark.integration
async def test_health_index_stats_config_metrics(embedded_triton, model_repo, write_tiny_model, triton_admin):
    assert await triton_admin.live() and await triton_admin.ready()
    name = write_tiny_model(model_repo, "client_tiny")
    assert {e.name: e.state for e in await triton_admin.repository_index()}.get(name) is None

    await triton_admin.load(name)
    assert await triton_admin.model_ready(name)
    entry = next(e for e in await triton_admin.repository_index() if e.name == name)
    assert (entry.version, entry.state) == ("1", "READY")
    assert [e.name for e in await triton_admin.repository_index(ready_only=True)].count(name) == 1

    before = time.time() * 1000
    for _ in range(3):
        grpc_infer(embedded_triton.grpc_url, name, np.ones((2, 2), dtype=np.float32))
    # Triton counts a request in its statistics after sending its response: the last one may lag a little.
    deadline = time.monotonic() + 10
    while (stats := await triton_admin.model_stats(name)).inference_count < 6 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert (stats.name, stats.version) == (name, "1")
    assert stats.inference_count == 6 and stats.execution_count == 3 and stats.success_count == 3
    assert before - 1000 <= stats.last_inference_ms <= time.time() * 1000 + 1000
    assert stats.queue_ns > 0 and stats.compute_infer_ns > 0 and stats.fail_count == 0

    config = await triton_admin.model_config(name)
    assert config["name"] == name and config["max_batch_size"] == 8

    assert (await triton_admin.pending_request_counts()).get(name) == 0.0
    assert f'model="{name}"' in await triton_admin.metrics_text()

    await triton_admin.unload(name)
    entry = next(e for e in await triton_admin.repository_index() if e.name == name)
    assert (entry.state, entry.reason) == ("UNAVAILABLE", "unloaded")
    with pytest.raises(NotFoundError):
        await triton_admin.model_stats(name)
    with pytest.raises(NotFoundError):
        await triton_admin.model_config(name)


@pytest.mark.integration
async def test_load_with_config_override_scales_instances(embedded_triton, model_repo, write_tiny_model, triton_admin):
    name = write_tiny_model(model_repo, "client_scaled")
    await triton_admin.load(name)
    assert len(embedded_triton.stub_pids(name)) == 1
    config = await triton_admin.model_config(name)
    config["instance_group"][0]["count"] = 3
    await triton_admin.load(name, config=config)
    # Triton may replace the whole instance set and retire the old stub ~1 s after the load answers.
    deadline = time.monotonic() + 10
    while len(embedded_triton.stub_pids(name)) != 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert len(embedded_triton.stub_pids(name)) == 3
    assert (await triton_admin.model_config(name))["instance_group"][0]["count"] == 3
    await triton_admin.unload(name)
    assert embedded_triton.stub_pids(name) == []


@pytest.mark.integration
async def test_load_failures_carry_tritons_reason(model_repo, write_tiny_model, triton_admin):
    with pytest.raises(TritonModelLoadError) as info:
        await triton_admin.load("client_no_such_model")
    assert info.value.model_name == "client_no_such_model" and "failed to poll" in info.value.reason

    name = write_tiny_model(model_repo, "client_broken", fail_init=True)
    with pytest.raises(TritonModelLoadError) as info:
        await triton_admin.load(name)
    assert "tiny model refuses to initialize" in info.value.reason
    assert info.value.status_code == 502 and info.value.to_dict()["code"] == "model_load_failed"
    assert not await triton_admin.model_ready(name)


@pytest.mark.integration
async def test_unload_wait_and_timeout(embedded_triton, model_repo, write_tiny_model, triton_admin):
    name = write_tiny_model(model_repo, "client_slow_finalize", finalize_sleep=3)
    await triton_admin.load(name)
    await triton_admin.unload(name, wait=False)
    with pytest.raises(TritonError, match="still UNLOADING"):
        await triton_admin.unload(name, timeout=0.5)
    await triton_admin.unload(name, timeout=30)
    assert embedded_triton.stub_pids(name) == []
