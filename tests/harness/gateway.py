"""The gateway end to end (tests/integration/gateway): real Envoy + real tritonserver + the activator, with
standard tritonclient clients. Its stack, packages and clients, shared by the scenario modules.

The activator runs in its own event loop in a background thread (as it runs in the control plane's
loop), so the tests can use the blocking ``tritonclient.http`` / ``tritonclient.grpc`` clients as
users do. The waker is the real ``LifecycleManager``; its sweeper is slowed down so that what these
tests see (wake-ups, dead-stub recovery) comes through the gateway's retry path.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import httpx
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from controlplane.gateway.activator import Activator
from controlplane.gateway.envoy import EnvoyGateway
from controlplane.lifecycle.manager import LifecycleManager
from controlplane.spec import DeploymentSpec, resolve
from controlplane.store import ModelStore
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.launcher import EmbeddedTriton
from harness.probes import until

API_KEY = "infer-key-123"
ADMIN_KEY = "admin-key-456"
WAKE_BUFFER = 256 * 1024
T = TypeVar("T")


MODEL_PY = """
import numpy as np


class Model:
    def __init__(self, scale=2.0):
        self.scale = scale

    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        return {"y": (inputs["x"] * self.scale).astype(np.float32)}
"""


class LoopThread:
    """An asyncio loop in a daemon thread: the activator's home, like the control plane's loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Stack:
    triton: EmbeddedTriton
    store: ModelStore
    lifecycle: LifecycleManager
    admin: TritonAdminClient
    gateway: EnvoyGateway
    loop: LoopThread
    package: Path
    raiser: Path
    activator: Activator

    def publish(self, name: str) -> str:
        self.store.publish(resolve(DeploymentSpec(id=name, path=self.package, max_batch_size=8)))
        return name

    def triton_ready(self, name: str) -> bool:
        return self.loop.run(self.admin.model_ready(name))

    def load_count(self, name: str) -> int:
        return self.lifecycle.status(name).load_count

    def recoveries(self, name: str) -> float:
        labels = {"model": name, "cause": "dead_stub"}
        return self.lifecycle.metrics.registry.get_sample_value("snooze_recoveries_total", labels) or 0

    def publish_raiser(self, name: str, message: str, calls: Path, exception: str = "RuntimeError",
                       worker: str = "in-stub") -> str:  # fmt: skip
        """A model whose predict logs its call to ``calls`` and raises ``exception(message)``."""
        params = {"message": message, "calls": str(calls), "exception": exception}
        spec = DeploymentSpec(id=name, path=self.raiser, max_batch_size=8, params=params, worker=worker)
        self.store.publish(resolve(spec))
        return name

    def http(self) -> httpclient.InferenceServerClient:
        return httpclient.InferenceServerClient(self.gateway.http_url.removeprefix("http://"))

    def grpc(self) -> grpcclient.InferenceServerClient:
        return grpcclient.InferenceServerClient(self.gateway.grpc_url)


def _write_package(folder: Path, source: str, **manifest: Any) -> Path:
    """A custom package with x -> y, FP32 [-1]: ``source`` as snooze_model.py, ``manifest`` added."""
    folder.mkdir()
    (folder / "snooze_model.py").write_text(textwrap.dedent(source))
    tensor = {"datatype": "FP32", "dims": [-1]}
    manifest = {"inputs": [{"name": "x", **tensor}], "outputs": [{"name": "y", **tensor}], **manifest}
    (folder / "snooze_model.json").write_text(json.dumps(manifest))
    return folder


RAISER_PY = """
class _Refusal(ValueError):
    snooze_error = "invalid_input"  # the duck-typed refusal (docs/packages.md), on a base class


class NegativeCounts(_Refusal):
    pass


class Model:
    def __init__(self, message="", calls="", exception="RuntimeError"):
        self.message, self.calls, self.exception = message, calls, exception

    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        with open(self.calls, "a") as f:
            f.write("call\\n")
        kinds = {"RuntimeError": RuntimeError, "SystemExit": SystemExit, "ValueError": ValueError,
                 "NegativeCounts": NegativeCounts}
        raise kinds[self.exception](self.message)
"""


async def _admin(triton: EmbeddedTriton) -> TritonAdminClient:
    return TritonAdminClient(triton.http_url, triton.metrics_url, timeout=60)


# Read-only: tritonclient.http's infer adds Inference-Header-Content-Length (an int) to the dict it is given, and one
# test doing that to a shared dict broke every later request of its worker. Pass dict(KEY) to infer.
KEY = MappingProxyType({"X-API-Key": API_KEY})
GRPC_KEY = MappingProxyType({"x-api-key": API_KEY})


def _x(rows: int = 2) -> np.ndarray:
    return np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)


def _stream_error(g: grpcclient.InferenceServerClient, model: str) -> str:
    """The error a stream's first request for ``model`` gets, through the stream's callback."""
    errors: list[Any] = []
    g.start_stream(callback=lambda result, error: errors.append(error), headers=GRPC_KEY)
    inp = grpcclient.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(_x(1))
    g.async_stream_infer(model, [inp])
    until(lambda: errors, "the stream's error")
    g.stop_stream()
    assert errors[0] is not None, "the stream answered without an error"
    return errors[0].message()


def _generate(stack: Stack, name: str, op: str, body: Any) -> httpx.Response:
    return httpx.post(f"{stack.gateway.http_url}/v2/models/{name}/{op}", json=body, headers=KEY, timeout=60)


def _successes(stack: Stack, name: str, at_least: int = 0) -> int:
    """Triton's count of successful requests for the model, once it reached ``at_least`` (5 s at most)."""
    counts: list[int] = []

    def reached() -> bool:
        counts.append(stack.loop.run(stack.admin.model_stats(name)).success_count)
        return counts[-1] >= at_least

    until(reached, lambda: f"{at_least} requests counted for {name} (Triton counts {counts[-1]})", 5, interval=0.05)
    return counts[-1]


REPEATER_PY = """
import time

import numpy as np


class Model:
    def __init__(self, log=""):
        self.log = log

    def load(self, model_dir, device):
        pass

    def _note(self, text):
        if self.log:
            with open(self.log, "a") as f:
                f.write(text + "\\n")

    def predict(self, inputs):
        # x = [n, mode, ...]: n responses of x * i; mode < 0 raises after two, mode > 0 sleeps that long
        x = inputs["x"]
        try:
            for i in range(1, int(x[0]) + 1):
                if x[1] < 0 and i == 3:
                    raise RuntimeError("the repeater failed after two")
                self._note(f"yield {i}")
                yield {"y": (x * i).astype(np.float32)}
                if x[1] > 0:
                    time.sleep(float(x[1]))
        finally:
            self._note("closed")
"""


def _publish_repeater(stack: Stack, repeater: Path, name: str, log: Path | None = None, worker: str = "in-stub") -> str:
    params = {"log": str(log)} if log else {}
    spec = DeploymentSpec(id=name, path=repeater, max_batch_size=0, params=params, worker=worker)
    stack.store.publish(resolve(spec))
    return name


WORKERS = ["in-stub", "preforked"]


ACCUMULATOR_PY = """
import numpy as np


class Model:
    def __init__(self, calls=""):
        self.calls = calls

    def load(self, model_dir, device):
        self.totals = {}

    def predict(self, inputs, sequence):
        if self.calls:
            with open(self.calls, "a") as f:
                f.write(f"{sequence.correlation_id}\\n")
        x = inputs["x"]
        total = x if sequence.start else self.totals[sequence.correlation_id] + x
        if sequence.end:
            self.totals.pop(sequence.correlation_id, None)
        else:
            self.totals[sequence.correlation_id] = total
        return {"y": total.astype(np.float32)}
"""
