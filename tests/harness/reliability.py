"""Fault-injection helpers: continuous traffic and its accounting (the `snoozectl serve` subprocess and
the test model package are ``harness.serve``'s).

Everything is black-box: the stack runs as users run it (`snoozectl serve` on free ports over a tmp
work dir), traffic goes through the Envoy gateway with the standard tritonclient clients, and the
state is read from the control API, the repository folder and the process tree.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc.aio as grpcaio
import tritonclient.http.aio as httpaio
from tritonclient.utils import InferenceServerException

from harness.probes import grpc_infer_async, http_infer_async
from harness.serve import Serve

ERROR_PAUSE = 0.05  # a client that got an error waits this long before its next request (no busy loop)

# ---------------------------------------------------------------------------------------------
# Traffic


@dataclass
class Result:
    model: str
    protocol: str
    started: float  # time.monotonic()
    ended: float
    ok: bool
    error: str = ""  # status code name / HTTP status and message
    client: int = 0  # which client sent it

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@dataclass
class Traffic:
    """Closed-loop clients (one request in flight each) through the gateway; every answer is checked.

    ``models`` maps model id -> the scale its answers must show (``y == x * scale``; None: any of
    ``scales``). Each request carries its own x, so a mixed-up answer is caught as well as an error.
    """

    serve: Serve
    models: dict[str, float | set[float]]
    grpc_clients: int = 4
    http_clients: int = 0
    timeout: float = 30.0
    pause: float = 0.0
    results: list[Result] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _counter: int = 0

    @property
    def clients(self) -> int:
        return self.grpc_clients + self.http_clients

    def start(self) -> Traffic:
        ids = list(self.models)
        for i in range(self.grpc_clients):
            self._tasks.append(asyncio.create_task(self._grpc_client(ids[i % len(ids)], i)))
        for i in range(self.http_clients):
            self._tasks.append(asyncio.create_task(self._http_client(ids[i % len(ids)], self.grpc_clients + i)))
        return self

    async def stop(self) -> list[Result]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.results

    def _next_x(self) -> np.ndarray:
        self._counter += 1
        return np.array([[self._counter, -0.5 * self._counter]], dtype=np.float32)

    def _check(self, model: str, x: np.ndarray, y: np.ndarray | None) -> str:
        expected = self.models[model]
        scales = expected if isinstance(expected, set) else {expected}
        if y is None or not any(np.array_equal(y, x * np.float32(s)) for s in scales):
            return f"WRONG ANSWER: x={x.tolist()} y={None if y is None else y.tolist()} scales={sorted(scales)}"
        return ""

    async def _grpc_client(self, model: str, n: int) -> None:
        client = grpcaio.InferenceServerClient(self.serve.grpc_url)
        try:
            while not self._stop.is_set():
                x = self._next_x()
                started = time.monotonic()
                try:
                    error = self._check(model, x, await grpc_infer_async(client, model, x, timeout=self.timeout))
                except InferenceServerException as e:
                    error = f"{e.status()}: {e.message()}"
                self.results.append(Result(model, "grpc", started, time.monotonic(), not error, error, n))
                await asyncio.sleep(self.pause if not error else max(self.pause, ERROR_PAUSE))
        finally:
            await client.close()

    async def _http_client(self, model: str, n: int) -> None:
        client = httpaio.InferenceServerClient(self.serve.http_url, conn_timeout=self.timeout)
        try:
            while not self._stop.is_set():
                x = self._next_x()
                started = time.monotonic()
                try:
                    error = self._check(model, x, await http_infer_async(client, model, x, timeout=self.timeout))
                except InferenceServerException as e:
                    error = f"{e.status()}: {e.message()}"
                except (TimeoutError, OSError) as e:  # aiohttp's connection errors are OSErrors
                    error = f"{type(e).__name__}: {e}"
                except Exception as e:  # aiohttp.ClientError and friends: record, do not stop the client
                    error = f"{type(e).__name__}: {e}"
                self.results.append(Result(model, "http", started, time.monotonic(), not error, error, n))
                await asyncio.sleep(self.pause if not error else max(self.pause, ERROR_PAUSE))
        finally:
            await client.close()


def summary(results: list[Result], model: str | None = None) -> dict[str, Any]:
    chosen = [r for r in results if model is None or r.model == model]
    failed = [r for r in chosen if not r.ok]
    return {
        "total": len(chosen),
        "failed": len(failed),
        "max_seconds": round(max((r.seconds for r in chosen), default=0.0), 3),
        "errors": sorted({r.error[:160] for r in failed}),
    }


def in_flight_at(results: list[Result], moment: float, model: str | None = None) -> int:
    return sum(1 for r in results if r.started <= moment <= r.ended and (model is None or r.model == model))


def report(name: str, **numbers: Any) -> None:
    """Print a scenario's measured result (shown with pytest -s; also appended to a summary file)."""
    line = f"[reliability] {name}: " + ", ".join(f"{k}={v}" for k, v in numbers.items())
    print(line)
    out = os.environ.get("SNOOZE_RELIABILITY_REPORT")
    if out:
        with open(out, "a", encoding="utf-8") as f:
            f.write(line + "\n")


# ---------------------------------------------------------------------------------------------
# One request


async def infer_once(serve: Serve, model: str, protocol: str, x: np.ndarray, timeout: float = 60) -> np.ndarray | str:
    """One request through the gateway: the output ``y``, or the error as '<status>: <message>'."""
    try:
        if protocol == "grpc":
            return await grpc_infer_async(serve.grpc_url, model, x, timeout=timeout)
        return await http_infer_async(serve.http_url, model, x, timeout=timeout)
    except InferenceServerException as e:
        return f"{e.status()}: {e.message()}"


async def infer_error(serve: Serve, model: str, protocol: str, timeout: float = 60) -> tuple[str, float]:
    """The error a single request (x = ones) gets, which must fail, and how long it took."""
    started = time.monotonic()
    answer = await infer_once(serve, model, protocol, np.ones((1, 2), dtype=np.float32), timeout)
    if not isinstance(answer, str):
        raise AssertionError(f"a request to {model} succeeded")
    return answer, time.monotonic() - started
