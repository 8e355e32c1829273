"""Doze: a preforked model's first response from doze, against from unloaded and warm, and what each level holds.

Per cycle and model, in a rotating order of the three levels (interleaved, so that drift in the machine's load
falls on all of them alike), one HTTP inference through the gateway on an open connection, after a short idle gap:

- ``warm``: the model awake (the control: any request after an idle gap pays its hops' thread wake-ups);
- ``doze``: the lifecycle told its stub to doze (``LifecycleManager.dozing.doze``: the worker ended), then the
  request: the stub forks a worker from the preloaded parent, runs ``load()`` in it, then the request;
- ``unloaded``: unloaded through the lifecycle, then the request: 404 from Triton, the activator loads it.

Memory (PSS) of the model's stubs and workers awake and dozing (unloaded holds no process), and the preloaded
parents' PSS beside them. ``load()`` in this process is the floor a wake from doze cannot go under.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.coldstart import Request, _request
from bench.common import CONV_PACKAGE, EXAMPLES, gateway_urls, serving_stack, summary, wait_state, write_package

LEVELS = ("warm", "doze", "unloaded")
GAP_SECS = 0.5  # idle before each timed request
WEIGHTS_MIB = 100

WEIGHTS_PY = """
import os

import numpy as np


class Model:
    def load(self, model_dir, device):
        self.w = np.load(os.path.join(model_dir, "weights.npy"))  # 100 MiB read from the package

    def predict(self, inputs):
        return {"y": inputs["x"] * float(self.w[0])}
"""


def _weights_package(folder: Path) -> Path:
    tensor = {"datatype": "FP32", "dims": [4]}
    write_package(folder, WEIGHTS_PY, [{"name": "x", **tensor}], [{"name": "y", **tensor}], load_timeout_secs=120)
    np.save(folder / "weights.npy", np.ones(WEIGHTS_MIB * 2**20 // 8))
    return folder


def _entries(root: Path, models: list[str]) -> list[dict[str, Any]]:
    """``models``: names of the bench's own, or ``name=folder`` for any package (a model it has not seen)."""
    given = {m: Path(m.split("=", 1)[1]) for m in models if "=" in m}
    paths = {
        **given,
        "numpy-linear": EXAMPLES / "numpy-linear",
        "torch-mlp": EXAMPLES / "torch-mlp",
        "torch-conv": CONV_PACKAGE,
        "weights-100mib": root / "weights-100mib",
        "onnx-mlp": EXAMPLES / "onnx-mlp",  # the onnxruntime runner in a worker (the parent's spare imported it)
    }
    if "weights-100mib" in models:
        _weights_package(paths["weights-100mib"])
    return [
        {"id": _name(m), "path": paths[m], "worker": "preforked", "idle_timeout_secs": 3600, "max_batch_size": 8}
        for m in models
    ]


def _name(model: str) -> str:
    return model.split("=", 1)[0]


def _in_process_load(package: Path, params: dict[str, Any], repeats: int) -> float:
    """Median seconds of ``Model(**params).load()`` in this process (its imports done once before)."""
    spec = importlib.util.spec_from_file_location(f"doze_bench_{package.name}", package / "snooze_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(package))
    try:
        spec.loader.exec_module(module)
        module.Model(**params).load(str(package), "cpu")  # imports and first-time costs, not counted
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            module.Model(**params).load(str(package), "cpu")
            times.append(time.perf_counter() - start)
    finally:
        sys.path.remove(str(package))
    return statistics.median(times)


def _load_floor(package: Path, repeats: int) -> float:
    """``load()`` in this process: a custom package's, or for an ONNX package its session, in a fresh interpreter
    that has imported onnxruntime (as the preloaded parent's spare worker has, prefork_parent.py)."""
    if (package / "snooze_model.py").exists():
        params = json.loads((package / "snooze_model.json").read_text()).get("params") or {}
        return _in_process_load(package, params, repeats)
    code = (
        "import time, numpy, onnxruntime as ort; t = time.perf_counter(); "
        f"ort.InferenceSession({str(package / 'model.onnx')!r}); print(time.perf_counter() - t)"
    )
    runs = [
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
        for _ in range(repeats)
    ]
    return statistics.median(runs)


def _pss(pids: list[int]) -> int:
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().pss
        except psutil.Error:
            pass
    return total


def _held(stack: Any, model: str) -> dict[str, float]:
    """PSS (MiB) of the model's stubs and of its live workers, and of the preloaded parents."""
    from controlplane.lifecycle.workers import parents, workers_of

    journal = stack.lifecycle.journal_dir
    stubs = stack.triton_process.processes().stubs(model)
    workers = workers_of(journal, stubs)
    return {
        "stubs_mib": round(_pss([s.pid for s in stubs]) / 2**20, 1),
        "workers_mib": round(_pss([w.pid for w in workers]) / 2**20, 1),
        "parents_mib": round(_pss([p.pid for p in parents(journal)]) / 2**20, 1),
        "accounted_mib": round((stack.lifecycle.status(model).memory_bytes or 0) / 2**20, 1),
    }


def _stub_wake(stack: Any, model: str) -> tuple[float, float]:
    """The last wake from doze as the model's stub timed it (``python_backend/doze.py``'s state answer): its ask for
    the control plane's room, and the whole wake; of the stub that woke last (the others' figures are older)."""
    from controlplane.triton.stub_control import SocketStubControl

    control = SocketStubControl(stack.lifecycle.journal_dir)
    states = [control.state(s) for s in stack.triton_process.processes().stubs(model)]
    woken = [st for st in states if st.get("last_wake_secs") is not None]
    if not woken:
        raise RuntimeError(f"{model}: no stub says it woke from doze")
    last = max(woken, key=lambda st: int(st["wakes"]))
    return float(last["last_ask_secs"] or 0.0), float(last["last_wake_secs"])


async def _to_level(stack: Any, model: str, level: str, http: aiohttp.ClientSession, base: str, req: Request) -> None:
    if level == "unloaded":
        await stack.lifecycle.unload(model)
        await wait_state(stack, model, "unloaded", 60)
        return
    await stack.lifecycle.ensure_ready(model)
    rec = stack.lifecycle.states.get(model)
    if level == "warm":
        await _post(http, base, model, req)  # awake (a dozing stub wakes here)
        return
    if not rec.doze.dozing and not await stack.lifecycle.dozing.doze(rec):
        raise RuntimeError(f"{model}: its stub did not doze")


async def _post(http: aiohttp.ClientSession, base: str, model: str, req: Request) -> float:
    body, headers = req
    start = time.perf_counter()
    async with http.post(f"{base}/v2/models/{model}/infer", data=body, headers=headers) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{model}: HTTP {r.status}")
    return time.perf_counter() - start


async def run(
    root: Path, models: list[str], cycles: int, load_repeats: int = 5, churn: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``churn``: also the churn trace (``bench/churn.py``'s parameters, the default policy) twice, its models in
    their stubs and then preforked (they doze when idle), after the levels."""
    result = await _levels(root, models, cycles, load_repeats)
    if churn:
        from bench import churn as trace

        result["churn"] = {}
        for worker in ("in-stub", "preforked"):
            phase = await trace.run(root / f"churn-{worker}", policies=("gdsf",), worker=worker, **churn)
            result["churn"][worker] = {"settings": phase["settings"], **phase["policies"]["gdsf"]}
    return result


async def _levels(root: Path, models: list[str], cycles: int, load_repeats: int) -> dict[str, Any]:

    load_average = {"start": [round(x, 2) for x in os.getloadavg()]}
    entries = _entries(root, models)
    times: dict[str, dict[str, list[float]]] = {m: {lv: [] for lv in LEVELS} for m in models}
    # the stub's own account of each wake from doze: its ask for room, and the whole wake (the ask, fork, load())
    stub_times: dict[str, dict[str, list[float]]] = {m: {"ask": [], "wake": []} for m in models}
    memory: dict[str, dict[str, Any]] = {}
    # doze_after_secs far above a cycle: only the bench dozes the models (LifecycleManager.dozing.doze)
    async with serving_stack(root, entries, doze_after_secs=3000, sweep_interval_secs=1.0) as stack:
        base = gateway_urls(stack)["http"]
        requests = {m: _request(stack.store.get(_name(m))) for m in models}
        async with aiohttp.ClientSession() as http:
            for m in models:  # one uncounted cycle: the parents start, the first loads' page faults
                for level in LEVELS:
                    await _to_level(stack, _name(m), level, http, base, requests[m])
                    await _post(http, base, _name(m), requests[m])
            for cycle in range(cycles):
                for i, m in enumerate(models):
                    order = LEVELS[(cycle + i) % 3 :] + LEVELS[: (cycle + i) % 3]
                    for level in order:
                        await _to_level(stack, _name(m), level, http, base, requests[m])
                        async with http.get(f"{base}/v2/health/live") as r:  # the connection is open
                            await r.read()
                        await asyncio.sleep(GAP_SECS)
                        times[m][level].append(await _post(http, base, _name(m), requests[m]))
                        if level == "doze":
                            ask, wake = await asyncio.to_thread(_stub_wake, stack, _name(m))
                            stub_times[m]["ask"].append(ask)
                            stub_times[m]["wake"].append(wake)
            for m in models:
                await _to_level(stack, _name(m), "warm", http, base, requests[m])
                await asyncio.sleep(0.5)
                awake = _held(stack, _name(m))
                await _to_level(stack, _name(m), "doze", http, base, requests[m])
                await asyncio.sleep(0.5)
                memory[m] = {"awake": awake, "dozing": _held(stack, _name(m))}
                await _to_level(stack, _name(m), "unloaded", http, base, requests[m])
        package_of = {m: Path(e["path"]) for m, e in zip(models, entries, strict=True)}
    load_average["end"] = [round(x, 2) for x in os.getloadavg()]
    result: dict[str, Any] = {"cycles": cycles, "gap_secs": GAP_SECS, "load_average": load_average, "models": {}}
    for m in models:
        result["models"][_name(m)] = {
            **{f"{lv}_s": summary(times[m][lv]) for lv in LEVELS},
            "stub_ask_s": summary(stub_times[m]["ask"]),
            "stub_wake_s": summary(stub_times[m]["wake"]),
            "load_in_process_s": round(_load_floor(package_of[m], load_repeats), 4),
            "memory": memory[m],
        }
    return result
