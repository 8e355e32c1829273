"""Cold start: first-response latency of a sleeping model through the gateway vs Triton's own load time.

Each cycle unloads the model through the lifecycle manager (as an idle unload would), then sends one
HTTP inference through the snoozeml gateway on an already open connection: Triton answers 404, Envoy
retries to the activator, which loads the model (single flight) and forwards. Triton's load time is the
duration of the very `TritonAdminClient.load` call the lifecycle makes for that request (the admin
client is wrapped with a timer), so overhead = first response - Triton load, per cycle.

After each cold request the model is pre-warmed (loaded by the lifecycle with no request waiting, as the
adaptive keep-alive does; the load runs the config's warm-up inference) and its first request is timed against
the warm requests that follow. The torch example runs three ways (``bench.common.TORCH_VARIANTS``): in its
stub, in a preforked worker (forked from a parent that has imported torch) and as its ONNX export; a small
torch conv net (``bench.common.CONV_VARIANTS``) in its stub and preforked. For those, the memory a loaded
model holds is measured too, for one copy and for ``memory_copies`` copies loaded together: as the
lifecycle accounts it and as the kernel does (PSS of the stubs, workers and preloaded parents).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.common import (
    API_KEY,
    CONV_VARIANTS,
    EXAMPLES,
    TORCH_VARIANTS,
    conv_variant_entries,
    gateway_urls,
    model_memory,
    serving_stack,
    summary,
    torch_variant_entries,
    wait_state,
)
from controlplane.dtypes import parse_dtype

MODELS = {
    "numpy-linear": "numpy custom model (examples/models/numpy-linear)",
    "torch-mlp": "torch custom model, torch imported in load() (examples/models/torch-mlp), in its stub",
    "torch-mlp-preforked": "the same torch model in a worker forked from a parent that preloaded torch",
    "torch-mlp-onnx": "the same torch model exported to ONNX, python-backend onnxruntime runner",
    "onnx-mlp": "ONNX model, python-backend onnxruntime runner on the embedded target (examples/models/onnx-mlp)",
    **CONV_VARIANTS,
}
WARM_REQUESTS = 5  # warm requests timed after each pre-warmed first request
# A pre-warm runs ahead of the request it expects (the adaptive keep-alive's lead); the first request comes
# this long after the load, and a warm request after the same idle gap is timed as its control: any request
# after an idle gap pays the wake-ups of the threads on its path (client, Envoy, Triton, the stub), warm or not.
PREWARM_LEAD_SECS = 0.5
MAX_BATCH = 8  # the deployment default
Request = tuple[bytes, dict[str, str]]  # an HTTP inference body and its headers


def _request(model: Any) -> Request:
    import tritonclient.http as httpclient

    tensors = []
    for t in model.inputs:
        shape = [1, *[d if d > 0 else 1 for d in t.dims]]
        dt = parse_dtype(t.datatype)
        data = np.full(shape, b"snooze", dtype=object) if dt.wire == "BYTES" else np.ones(shape, dtype=dt.numpy)
        tensor = httpclient.InferInput(t.name, shape, dt.wire)
        tensor.set_data_from_numpy(data, binary_data=True)
        tensors.append(tensor)
    body, json_size = httpclient.InferenceServerClient.generate_request_body(tensors)
    headers = {"Content-Type": "application/octet-stream", "X-API-Key": API_KEY}
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    return body, headers


def _entries(root: Path, models: list[str], memory_copies: int) -> list[dict[str, Any]]:
    torch = [m for m in models if m in TORCH_VARIANTS]
    variants = torch_variant_entries(root, MAX_BATCH, torch, idle_timeout_secs=3600) if torch else {}
    variants.update(conv_variant_entries(max_batch_size=MAX_BATCH, idle_timeout_secs=3600))
    entries = []
    for m in models:
        entries.append({"id": m, **variants[m]} if m in variants else {"id": m, "path": EXAMPLES / m})
        entries[-1]["idle_timeout_secs"] = 3600
    for m in torch:  # copies for the memory of several loaded at once
        entries += [{**variants[m], "id": f"{m}-copy{i}"} for i in range(2, memory_copies + 1)]
    return entries


async def _memory(stack: Any, models: list[str], copies: int) -> dict[str, Any]:
    """Memory of each torch variant loaded alone: one copy, then ``copies`` copies (nothing else loaded)."""
    out: dict[str, Any] = {}
    everything = [s.id for s in stack.lifecycle.statuses()]
    for model in [m for m in models if m in TORCH_VARIANTS]:
        group = [model] + [f"{model}-copy{i}" for i in range(2, copies + 1)]
        row: dict[str, Any] = {}
        for n in (1, copies):
            for other in everything:
                await stack.lifecycle.unload(other)
            for m in group[:n]:
                await stack.lifecycle.ensure_ready(m)
            await asyncio.sleep(0.5)  # let the loads' page faults settle
            row[f"{n}_loaded"] = model_memory(stack, group[:n])
        out[model] = row
    for other in everything:
        await stack.lifecycle.unload(other)
    return out


async def _unloaded(stack: Any, model: str) -> None:
    await stack.lifecycle.unload(model)
    await wait_state(stack, model, "unloaded", 60)


async def _cold(
    stack: Any, http: aiohttp.ClientSession, base: str, model: str, request: Request, loads: list[tuple[str, float]]
) -> tuple[float, float]:
    """One cold request through the gateway: its first response, and the one Triton load it caused."""
    await _unloaded(stack, model)
    async with http.get(f"{base}/v2/health/live") as r:  # the connection is open before timing
        await r.read()
    await asyncio.sleep(0.2)
    loads.clear()
    body, headers = request
    start = time.perf_counter()
    async with http.post(f"{base}/v2/models/{model}/infer", data=body, headers=headers) as r:
        await r.read()
        status = r.status
    first = time.perf_counter() - start
    if status != 200:
        raise RuntimeError(f"cold request to {model} answered HTTP {status}")
    mine = [secs for name, secs in loads if name == model]
    if len(mine) != 1:
        raise RuntimeError(f"expected one Triton load of {model} per cold request, saw {loads}")
    return first, mine[0]


async def _direct(
    stack: Any, http: aiohttp.ClientSession, triton: str, model: str, request: Request, load: Callable[..., Any]
) -> tuple[float, float]:
    """The fair baseline for a first response, straight to Triton: its own load plus the first inference of a fresh
    python stub (tens of ms in Triton itself). (load and first inference, first inference) in seconds."""
    await _unloaded(stack, model)
    async with http.get(f"{triton}/v2/health/live") as r:  # open, as the gateway's is
        await r.read()
    body, headers = request
    direct_start = time.perf_counter()
    await load(model)
    loaded = time.perf_counter()
    async with http.post(f"{triton}/v2/models/{model}/infer", data=body, headers=headers) as r:
        await r.read()
    direct = time.perf_counter() - direct_start
    first_infer = time.perf_counter() - loaded
    await stack.lifecycle.sweep()  # adopt the model loaded behind its back
    return direct, first_infer


async def _prewarmed(stack: Any, http: aiohttp.ClientSession, base: str, model: str, request: Request) -> list[float]:
    """A pre-warm: the lifecycle loads the model with no request waiting (the load runs the config's warm-up
    inference), then the first request, a few warm ones and one more after a gap, through the gateway."""
    await _unloaded(stack, model)
    await stack.lifecycle.load(model)
    async with http.get(f"{base}/v2/health/live") as r:  # the same open connection as the warm ones
        await r.read()
    await asyncio.sleep(PREWARM_LEAD_SECS)
    body, headers = request
    timed = []
    for i in range(2 + WARM_REQUESTS):
        if i == 1 + WARM_REQUESTS:
            await asyncio.sleep(PREWARM_LEAD_SECS)  # the control: warm, after the same gap
        start = time.perf_counter()
        async with http.post(f"{base}/v2/models/{model}/infer", data=body, headers=headers) as r:
            await r.read()
        timed.append(time.perf_counter() - start)
    return timed


def _sample(cold: tuple[float, float], direct: tuple[float, float], timed: list[float]) -> dict[str, float]:
    (first, load), (direct_total, first_infer) = cold, direct
    return {
        "prewarmed_first_s": timed[0],
        "warm_s": sorted(timed[1:-1])[len(timed[1:-1]) // 2],
        "warm_after_gap_s": timed[-1],
        "first_response_s": first,
        "triton_load_s": load,
        "overhead_s": first - load,
        "direct_load_and_first_infer_s": direct_total,
        "direct_load_s": direct_total - first_infer,
        "direct_first_infer_s": first_infer,
        "overhead_vs_direct_s": first - direct_total,
    }


async def run(
    root: Path, *, cycles: int, models: list[str], memory_copies: int = 5, warmup_cycle: bool = True
) -> dict[str, Any]:
    """``warmup_cycle``: run one uncounted cycle first (page cache, the stubs' imports); off in --quick, whose
    figures are a smoke test's, not a measurement."""
    load_start = [round(v, 2) for v in os.getloadavg()]
    entries = _entries(root, models, memory_copies)
    async with serving_stack(root / "stack", entries) as stack:
        admin = stack.admin
        loads: list[tuple[str, float]] = []
        real_load = admin.load

        async def timed_load(name: str, *args: Any, **kw: Any) -> None:
            start = time.perf_counter()
            try:
                await real_load(name, *args, **kw)
            finally:
                loads.append((name, time.perf_counter() - start))

        admin.load = timed_load  # the instance the lifecycle calls
        base = gateway_urls(stack)["http"]
        triton = stack.triton_process.http_url
        requests = {m: _request(stack.store.get(m)) for m in models}
        samples: dict[str, list[dict[str, float]]] = {m: [] for m in models}
        # Two clients, one connection each: the gateway's stays open across a cycle's direct calls to Triton
        # (with one shared connection, the first request after a pre-warm paid a new connection and the
        # warm ones did not).
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http,
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as direct_http,
        ):
            first_counted = 1 if warmup_cycle else 0  # a warm-up cycle 0 warms the page cache and imports: not counted
            for cycle in range(first_counted + cycles):
                for model in models:
                    cold = await _cold(stack, http, base, model, requests[model], loads)
                    direct = await _direct(stack, direct_http, triton, model, requests[model], real_load)
                    timed = await _prewarmed(stack, http, base, model, requests[model])
                    if cycle >= first_counted:
                        samples[model].append(_sample(cold, direct, timed))
        admin.load = real_load
        memory = await _memory(stack, models, memory_copies)
    return {
        "cycles": cycles,
        "warmup_cycle": warmup_cycle,
        "protocol": "HTTP through the gateway (Envoy 404 retry -> activator)",
        "load_average": {"start": load_start, "end": [round(v, 2) for v in os.getloadavg()]},
        "models": {model: _model_summary(model, rows) for model, rows in samples.items()},
        "memory": memory,
        "memory_copies": memory_copies,
    }


def _model_summary(model: str, rows: list[dict[str, float]]) -> dict[str, Any]:
    first = summary([r["first_response_s"] for r in rows])
    load = summary([r["triton_load_s"] for r in rows])
    overhead = summary([r["overhead_s"] for r in rows])
    direct = summary([r["direct_load_and_first_infer_s"] for r in rows])
    decomposition = {
        key: summary([r[key] for r in rows if key in r])
        for key in ("direct_load_s", "direct_first_infer_s", "overhead_vs_direct_s")
    }
    overhead_direct = summary([r["overhead_vs_direct_s"] for r in rows])
    prewarmed, warm = summary([r["prewarmed_first_s"] for r in rows]), summary([r["warm_s"] for r in rows])
    warm_gap = summary([r["warm_after_gap_s"] for r in rows])
    return {
        "description": MODELS.get(model, model),
        "first_response_s": first,
        "triton_load_s": load,
        "overhead_s": overhead,
        "direct_load_and_first_infer_s": direct,
        "overhead_vs_direct_s": overhead_direct,
        "decomposition_s": decomposition,
        "prewarmed_first_s": prewarmed,
        "warm_s": warm,
        "prewarmed_first_vs_warm": round(prewarmed["median"] / warm["median"], 2) if warm else None,
        "warm_after_gap_s": warm_gap,
        "prewarm_lead_s": PREWARM_LEAD_SECS,
        "first_response_vs_triton_load": round(first["median"] / load["median"], 3) if load else None,
        "samples": [{k: round(v, 4) for k, v in r.items()} for r in rows],
    }
