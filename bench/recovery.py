"""Recovery after a model process dies, per topology, same run.

Two stacks side by side, cycles interleaved: "embedded" (tritonserver as serve's child) and
"two_process" (`snoozectl triton` in a process of its own, serve with --triton-url: the compose and
Kubernetes topology on one machine). Per cycle and topology, on a small numpy model:

- idle kill: SIGKILL the model's process while it is idle and send one gRPC request through the
  gateway at once. ``answered`` is that request's latency (it meets the dead process, Triton answers
  "not healthy" after its own wait of about a second, the activator has the model recovered and sends
  the request again); ``recovered`` is kill -> the model READY on a new process (lifecycle status).
- poison: a request makes the process exit (os._exit in predict). ``error`` is how long its client
  waits for the "died while running this request" error; ``serving_again`` is that send -> the first
  successful request after it (requests sent back to back once the error arrived).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from bench.common import API_KEY, fp32, serving_stack, summary, write_package

MODEL = "crashy"
SOURCE = """
import os

import numpy as np


class Model:
    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        x = inputs["x"]
        if (x[:, 0] == -1).any():
            os._exit(1)
        return {"y": (x * 2).astype(np.float32)}
"""
TOPOLOGIES = ("embedded", "two_process")


@contextlib.asynccontextmanager
async def _stack(root: Path, topology: str) -> AsyncIterator[Any]:
    """The crashy model served by `snoozectl serve` in this process; two_process: over a `snoozectl triton`."""
    package = write_package(root / "pkg", SOURCE, [fp32("x", 4)], [fp32("y", 4)])
    overrides: dict[str, Any] = {"log_level": "error"}
    triton = None
    if topology == "two_process":
        repository = root / "work" / "model_repository"
        repository.mkdir(parents=True, exist_ok=True)
        triton = subprocess.Popen(
            [str(Path(sys.executable).parent / "snoozectl"), "triton", "--model-repository", str(repository),
             "--work-dir", str(root / "triton"), "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
             "--exit-timeout-secs", "5", "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        assert triton.stdout is not None
        urls = json.loads(await asyncio.to_thread(triton.stdout.readline))
        overrides |= {
            "triton_url": urls["http_url"],
            "triton_grpc_url": urls["grpc_url"],
            "triton_metrics_url": urls["metrics_url"],
            "model_repository": repository,
        }
    try:
        async with serving_stack(root, [{"id": MODEL, "path": package}], **overrides) as stack:
            yield stack
    finally:
        if triton is not None:
            triton.send_signal(signal.SIGTERM)
            await asyncio.to_thread(triton.wait, 60)


async def _infer(client: grpcaio.InferenceServerClient, value: float) -> float:
    """Latency of one request; raises InferenceServerException on an error answer."""
    x = grpcaio.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.full((1, 4), value, np.float32))
    started = time.perf_counter()
    await client.infer(MODEL, [x], headers={"x-api-key": API_KEY}, client_timeout=60)
    return time.perf_counter() - started


async def _ready_after(stack: Any, loads: int, timeout: float = 30) -> None:
    deadline = time.perf_counter() + timeout
    while True:
        status = stack.lifecycle.status(MODEL)
        if status.state == "ready" and status.load_count > loads and stack.lifecycle.states.get(MODEL).op is None:
            return
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{MODEL} not recovered: {status}")
        await asyncio.sleep(0.01)


async def _idle_kill(stack: Any, client: grpcaio.InferenceServerClient) -> dict[str, float]:
    await _infer(client, 1.0)
    rec = stack.lifecycle.states.get(MODEL)
    loads = rec.load.load_count
    killed = time.perf_counter()
    os.kill(rec.procs.stubs[0].pid, signal.SIGKILL)
    answered = await _infer(client, 1.0)
    await _ready_after(stack, loads)
    return {"answered": answered, "recovered": rec.load.ready_at - (time.time() - (time.perf_counter() - killed))}


async def _poison(stack: Any, client: grpcaio.InferenceServerClient) -> dict[str, float]:
    await _infer(client, 1.0)
    sent = time.perf_counter()
    try:
        await _infer(client, -1.0)
        raise AssertionError("the poison request succeeded")
    except InferenceServerException as e:
        if "died while running this request" not in (e.message() or ""):
            raise
    error = time.perf_counter() - sent
    while True:
        try:
            await _infer(client, 1.0)
            break
        except InferenceServerException:
            await asyncio.sleep(0.005)
    return {"error": error, "serving_again": time.perf_counter() - sent}


async def run(root: Path, *, cycles: int) -> dict[str, Any]:
    samples: dict[str, dict[str, list[float]]] = {t: {} for t in TOPOLOGIES}
    async with contextlib.AsyncExitStack() as stacks:
        clients = {}
        for topology in TOPOLOGIES:
            stack = await stacks.enter_async_context(_stack(root / topology, topology))
            clients[topology] = (stack, grpcaio.InferenceServerClient(f"127.0.0.1:{stack.settings.grpc_port}"))
        try:
            for _ in range(cycles):
                for topology in TOPOLOGIES:  # interleaved: both see the same machine load
                    stack, client = clients[topology]
                    for name, value in {**await _idle_kill(stack, client), **await _poison(stack, client)}.items():
                        samples[topology].setdefault(name, []).append(value)
        finally:
            for _, client in clients.values():
                await client.close()
    return {
        "cycles": cycles,
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "topologies": {t: {k: summary(v) for k, v in s.items()} for t, s in samples.items()},
    }
