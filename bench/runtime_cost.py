"""What snoozeml's python-backend runtime adds per request: the numpy example rendered by snoozeml vs a
hand-written `TritonPythonModel` calling the same `predict` (no validation, no time limit, no journal),
both loaded in one embedded Triton, batch-1 requests over gRPC straight to Triton. A third model, the same
rendering with request_timeout_secs null, shows what the watchdog that enforces the limit costs.

Interleaved rounds (the order rotates), repeated, medians of per-round values: at concurrency 1 the added
cost is 1/rps(runtime) - 1/rps(hand-written); at concurrency 32 the throughput ratio. Requests carry the
gateway's request-id header, as they do in production, so the runtime journals a real id. Before Triton
starts, both models' execute() in-process (bench/_execute_micro.py): the runtime's own Python cost, and
how much of it is the watchdog that request_timeout_secs needs.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from bench._load import Job, LoadWorker
from bench.common import EXAMPLES, ROOT
from controlplane.render import VERSION, embedded_target
from controlplane.spec import DeploymentSpec, resolve
from controlplane.store import render_repository
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.journal import REQUEST_ID_HEADER
from controlplane.triton.launcher import EmbeddedTriton
from python_backend.spec import SPEC_FILE

MODEL = "numpy-linear"
RUNTIME = "rt-runtime"
NO_LIMIT = "rt-runtime-nolimit"
HANDWRITTEN = "rt-handwritten"
MODELS = (HANDWRITTEN, RUNTIME, NO_LIMIT)
MAX_BATCH = 32
CONCURRENCY = (1, 32)
TARGET_ADDED_MS_C1 = 0.05
TARGET_RATIO_C32 = 0.95

# The same Model class (copied next to it), its predict called straight from execute: what a careful
# author writes by hand for a dynamically batched model.
HANDWRITTEN_PY = """
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from snooze_model import Model  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.model = Model(scale={scale!r})
        self.model.load(os.path.dirname(os.path.abspath(__file__)), "cpu")

    def execute(self, requests):
        xs = [pb_utils.get_input_tensor_by_name(r, "x").as_numpy() for r in requests]
        x = xs[0] if len(xs) == 1 else np.concatenate(xs)
        y = self.model.predict({{"x": x}})["y"]
        responses, start = [], 0
        for part in xs:
            end = start + len(part)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", y[start:end])]))
            start = end
        return responses
"""


def build_repository(repo: Path) -> dict[str, Any]:
    """The runtime model rendered by snoozeml (with and without a time limit), and the hand-written one
    with the same config.pbtxt."""
    spec, no_limit = (
        resolve(DeploymentSpec(id=name, path=EXAMPLES / MODEL, max_batch_size=MAX_BATCH))
        for name in (RUNTIME, NO_LIMIT)
    )
    render_repository([spec, no_limit], repo, embedded_target())
    # snoozeml's manifest requires a limit; a runtime spec may have none (as a hand-edited one would).
    runtime_json = repo / NO_LIMIT / VERSION / SPEC_FILE
    runtime_json.write_text(json.dumps({**json.loads(runtime_json.read_text()), "request_timeout_secs": None}))
    hand = repo / HANDWRITTEN
    (hand / "1").mkdir(parents=True)
    config = (repo / RUNTIME / "config.pbtxt").read_text()
    (hand / "config.pbtxt").write_text(config.replace(f'name: "{RUNTIME}"', f'name: "{HANDWRITTEN}"'))
    shutil.copy(EXAMPLES / MODEL / "snooze_model.py", hand / "1" / "snooze_model.py")
    scale = spec.params.get("scale", 1.0)
    (hand / "1" / "model.py").write_text(textwrap.dedent(HANDWRITTEN_PY.format(scale=scale)).lstrip())
    return {"request_timeout_secs": spec.package.manifest.request_timeout_secs, "scale": scale}


def execute_micro(repo: Path) -> dict[str, Any]:
    """bench/_execute_micro.py in a fresh interpreter: this process's threads and imports must not count."""
    cmd = [sys.executable, "-m", "bench._execute_micro", str(repo), RUNTIME, HANDWRITTEN, NO_LIMIT]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


async def _measure(worker: LoadWorker, admin: TritonAdminClient, job: Job) -> dict[str, Any]:
    before = await admin.model_stats(job.model)
    r = await worker.run(job)
    after = await admin.model_stats(job.model)
    inferences = max(1, after.inference_count - before.inference_count)
    executions = max(1, after.execution_count - before.execution_count)
    return {
        "rps": round(r.rps, 1),
        "p50_ms": r.p50_ms,
        "errors": r.errors,
        "first_error": r.first_error,
        "mean_executed_batch": round(inferences / executions, 2),
        # Triton's per-request compute_infer: the stub's execute as the backend sees it, free of client noise.
        "compute_infer_ms": round((after.compute_infer_ns - before.compute_infer_ns) / inferences / 1e6, 4),
    }


def _med(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def _versus(model: str, concurrency: int, rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """`model` against the hand-written one, per round (both measured in it), then the median."""
    out: dict[str, Any] = {
        "rps": _med([r[model]["rps"] for r in rounds]),
        "ratio": _med([r[model]["rps"] / r[HANDWRITTEN]["rps"] for r in rounds]),
        "compute_added_ms": _med([r[model]["compute_infer_ms"] - r[HANDWRITTEN]["compute_infer_ms"] for r in rounds]),
        "mean_executed_batch": _med([r[model]["mean_executed_batch"] for r in rounds]),
    }
    if concurrency == 1:  # closed loop, one request in flight: 1/rps is the time per request
        out["added_ms"] = _med([1000 / r[model]["rps"] - 1000 / r[HANDWRITTEN]["rps"] for r in rounds])
        # the same from median latencies: steadier when other processes stall a round now and then
        out["added_p50_ms"] = _med([r[model]["p50_ms"] - r[HANDWRITTEN]["p50_ms"] for r in rounds])
    return out


def _summarise(concurrency: int, rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    runtime = _versus(RUNTIME, concurrency, rounds)
    return {
        "handwritten_rps": _med([r[HANDWRITTEN]["rps"] for r in rounds]),
        "runtime_rps": runtime.pop("rps"),
        **runtime,
        "no_limit": _versus(NO_LIMIT, concurrency, rounds),
        "errors": sum(r[m]["errors"] for r in rounds for m in MODELS),
        "rounds": rounds,
    }


async def run(root: Path, *, seconds: float, pairs: int, warmup: float) -> dict[str, Any]:
    repo = root / "repo"
    facts = build_repository(repo)
    results: dict[str, Any] = {
        "model": f"examples/models/{MODEL} (x @ W, 4 -> 3 floats): rendered by snoozeml vs hand-written",
        "settings": {
            "seconds": seconds,
            "pairs": pairs,
            "max_batch_size": MAX_BATCH,
            "request_timeout_secs": facts["request_timeout_secs"],
            "request_id_header": True,
            "client": "grpc.aio direct to Triton, separate process",
        },
        "load_average_start": [round(v, 2) for v in os.getloadavg()],
    }
    results["execute_inprocess"] = await asyncio.to_thread(execute_micro, repo)
    header = {REQUEST_ID_HEADER: "bench-0123456789abcdef"}
    with EmbeddedTriton(repo, root / "work") as triton:
        async with TritonAdminClient(triton.http_url) as admin, LoadWorker() as worker:
            for model in MODELS:
                await admin.load(model)
            for concurrency in CONCURRENCY:
                rounds = []
                for i in range(pairs):
                    order = MODELS[i % len(MODELS) :] + MODELS[: i % len(MODELS)]  # none always first
                    pair = {}
                    for model in order:
                        job = Job(
                            "grpc",
                            triton.grpc_url,
                            model,
                            concurrency,
                            seconds,
                            shape=[1, 4],
                            headers=header,
                            warmup_secs=warmup,
                        )
                        pair[model] = await _measure(worker, admin, job)
                    rounds.append(pair)
                results[f"c{concurrency}"] = _summarise(concurrency, rounds)
    results["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    added, ratio = results["c1"]["added_ms"], results["c32"]["ratio"]
    results["targets"] = {
        "added_ms_c1_max": TARGET_ADDED_MS_C1,
        "ratio_c32_min": TARGET_RATIO_C32,
        "added_ms_c1_met": added <= TARGET_ADDED_MS_C1,
        "ratio_c32_met": ratio >= TARGET_RATIO_C32,
    }
    return results
