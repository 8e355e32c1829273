"""Density: how many models stay loaded at once in a memory budget, and what the machine then holds.

    .venv/bin/python -m bench.density [--only tiny-in-stub ...] [--rounds 2]

Per kind (a fresh embedded stack each, ``SNOOZE_MEMORY_BUDGET_MB`` set, idle timeouts long): N models published,
then requested one after another, round-robin (``rounds`` times): every request past the budget evicts. After
each answer: how many models are loaded, and the proportional memory (Pss, psutil) of the Triton tree
(tritonserver, its stubs, their preforked workers and the preloaded parents): what the machine holds. Reported:
the most models loaded at once, those per GiB of budget, the tree's peak Pss against the budget, errors.

Kinds: custom models with a numpy ballast of 1 MiB (tiny), 40 MiB and 150 MiB touched at load, in the stub and
preforked; copies of the ONNX example (examples/models/onnx-mlp, onnxruntime backend). Beside them the floor:
one hand-written python-backend model (numpy, no snoozeml runtime) on Triton alone, its stub's Pss and RSS and
what tritonserver grew by when it loaded.

The measurement reads only /proc (psutil), so the same file runs against an older checkout (``--code`` names
it in the output) for a before/after on one machine state.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.common import EXAMPLES, fp32, gateway_urls, serving_stack, write_package

MIB = 1024 * 1024

BALLAST_PY = """
import numpy as np


class Model:
    def load(self, model_dir, device):
        self.ballast = np.ones({ballast_mb} * 1024 * 1024 // 8)  # touched: resident in the model's process

    def predict(self, inputs):
        return {{"y": (inputs["x"] * 2).astype(np.float32)}}
"""

# name -> (models, ballast MiB or None for ONNX, budget MiB, worker)
KINDS: dict[str, tuple[int, int | None, float, str]] = {
    "tiny-in-stub": (16, 1, 240, "in-stub"),
    "tiny-preforked": (16, 1, 240, "preforked"),
    "40mib-in-stub": (16, 40, 480, "in-stub"),
    "40mib-preforked": (16, 40, 480, "preforked"),
    "150mib-in-stub": (8, 150, 800, "in-stub"),
    "150mib-preforked": (8, 150, 800, "preforked"),
    "onnx": (16, None, 240, "in-stub"),
}

HANDWRITTEN_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "x").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", (x * 2).astype(np.float32))]))
        return out
"""

HANDWRITTEN_CONFIG = """
name: "floor"
backend: "python"
max_batch_size: 0
input [{ name: "x" data_type: TYPE_FP32 dims: [1, 2] }]
output [{ name: "y" data_type: TYPE_FP32 dims: [1, 2] }]
instance_group [{ kind: KIND_CPU count: 1 }]
"""


def _memory(pids: list[int]) -> tuple[int, int]:
    """(Pss, RSS) of these processes, bytes."""
    pss = rss = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            info = psutil.Process(pid).memory_full_info()
            pss, rss = pss + info.pss, rss + info.rss
    return pss, rss


def _tree_pids(stack: Any) -> list[int]:
    from controlplane.lifecycle.workers import parents

    server = stack.triton_process.processes().server()
    if server is None:
        return []
    pids = [server.pid]
    with contextlib.suppress(psutil.Error):
        pids += [p.pid for p in server.children(recursive=True)]
    for parent in parents(stack.lifecycle.journal_dir):  # preforked: the parents and the workers they forked
        with contextlib.suppress(psutil.Error):
            pids += [parent.pid, *(c.pid for c in psutil.Process(parent.pid).children(recursive=True))]
    return sorted(set(pids))


async def _kind(root: Path, name: str, rounds: int) -> dict[str, Any]:
    import tritonclient.http.aio as httpclient

    count, ballast, budget_mb, worker = KINDS[name]
    entries = []
    for i in range(count):
        if ballast is None:
            path = EXAMPLES / "onnx-mlp"
        else:
            src = BALLAST_PY.format(ballast_mb=ballast)
            path = write_package(root / "packages" / f"d{i:02d}", src, [fp32("x", 2)], [fp32("y", 2)], warmup=False)
        entry: dict[str, Any] = {"id": f"d{i:02d}", "path": path, "idle_timeout_secs": 3600}
        if worker == "preforked":
            entry["worker"] = "preforked"
        entries.append(entry)
    load_start = os.getloadavg()
    errors: list[str] = []
    most, peak_pss, peak_rss, at_most = 0, 0, 0, 0
    t0 = time.perf_counter()
    async with serving_stack(root / "stack", entries, memory_budget_mb=budget_mb, allow_local_paths=True) as stack:
        url = gateway_urls(stack)["http"].removeprefix("http://")
        from bench.common import API_KEY

        client = httpclient.InferenceServerClient(url, conn_timeout=120)
        headers = {"x-api-key": API_KEY}
        # the ONNX example takes 'input' [batch, 4]; the custom models 'x' [1, 2]
        name_shape = ("x", [1, 2]) if ballast is not None else ("input", [1, 4])
        try:
            for _ in range(rounds):
                for e in entries:
                    try:
                        inp = httpclient.InferInput(name_shape[0], name_shape[1], "FP32")
                        inp.set_data_from_numpy(np.ones(name_shape[1], np.float32))
                        await client.infer(e["id"], [inp], headers=headers)
                    except Exception as exc:  # noqa: BLE001 - an error is a result here
                        errors.append(f"{e['id']}: {type(exc).__name__}: {exc}"[:200])
                    loaded = sum(1 for s in stack.lifecycle.statuses() if s.state.value == "ready")
                    pss, rss = await asyncio.to_thread(_memory, _tree_pids(stack))
                    if loaded > most or (loaded == most and pss > at_most):
                        most, at_most = loaded, pss
                    peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
        finally:
            await client.close()
        runtime = stack.lifecycle.runtime()
    return {
        "kind": name,
        "models": count,
        "worker": worker,
        "ballast_mib": ballast,
        "budget_mib": budget_mb,
        "most_loaded_at_once": most,
        "loaded_per_gib_of_budget": round(most / (budget_mb / 1024), 1),
        "tree_pss_at_most_mib": round(at_most / MIB, 1),
        "peak_tree_pss_mib": round(peak_pss / MIB, 1),
        "peak_tree_rss_mib": round(peak_rss / MIB, 1),
        "pss_within_budget": peak_pss <= budget_mb * MIB,
        "errors": len(errors),
        "error_examples": errors[:3],
        "triton_server_mib": round(runtime.get("triton_server_bytes", 0) / MIB, 1),
        "wall_s": round(time.perf_counter() - t0, 1),
        "load_average_start": [round(v, 2) for v in load_start],
        "load_average_end": [round(v, 2) for v in os.getloadavg()],
    }


async def floor(root: Path) -> dict[str, Any]:
    """One hand-written python-backend model on Triton alone: what its stub holds, what tritonserver grew by."""
    from controlplane.triton.client import TritonAdminClient
    from controlplane.triton.launcher import EmbeddedTriton

    repo = root / "floor-repo"
    (repo / "floor" / "1").mkdir(parents=True)
    (repo / "floor" / "config.pbtxt").write_text(textwrap.dedent(HANDWRITTEN_CONFIG).lstrip())
    (repo / "floor" / "1" / "model.py").write_text(textwrap.dedent(HANDWRITTEN_PY).lstrip())
    with EmbeddedTriton(repo, root / "floor-work") as triton:
        processes = triton.processes()
        server = processes.server()
        assert server is not None
        before, _ = _memory([server.pid])
        async with TritonAdminClient(triton.http_url) as admin:
            await admin.load("floor")
        await asyncio.sleep(1.0)
        stubs = processes.stubs("floor")
        after, _ = _memory([server.pid])
        stub_pss, stub_rss = _memory([s.pid for s in stubs])
        private = 0
        for s in stubs:
            with contextlib.suppress(psutil.Error):
                private += psutil.Process(s.pid).memory_full_info().uss
    return {
        "stub_pss_mib": round(stub_pss / MIB, 1),
        "stub_rss_mib": round(stub_rss / MIB, 1),
        "stub_uss_mib": round(private / MIB, 1),
        "tritonserver_growth_pss_mib": round((after - before) / MIB, 1),
        "tritonserver_pss_mib": round(after / MIB, 1),
    }


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", action="append", choices=sorted(KINDS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-floor", action="store_true")
    parser.add_argument("--code", default="", help="a label for the code under test (before/after)")
    args = parser.parse_args()
    results: dict[str, Any] = {"code": args.code, "python": sys.executable, "kinds": []}
    with tempfile.TemporaryDirectory(prefix="snooze-density-") as tmp:
        for name in args.only or list(KINDS):
            here = Path(tmp) / name
            here.mkdir()
            results["kinds"].append(await _kind(here, name, args.rounds))
            print(json.dumps(results["kinds"][-1]), flush=True)
            shutil.rmtree(here, ignore_errors=True)
        if not args.no_floor:
            results["floor"] = await floor(Path(tmp))
            print(json.dumps({"floor": results["floor"]}), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    asyncio.run(main())
