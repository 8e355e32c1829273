"""Async load generation for KServe v2 endpoints: loopback only, bounded in count and time.

The request is built once and sent as raw bytes (gRPC: a serialized ModelInferRequest over a grpc.aio
channel with identity serializers; HTTP: a binary-tensor body over aiohttp; tritonclient.http's gevent
path is far too slow to measure a server with), so the client spends as little CPU as it can.

The generator runs in its own process (`LoadWorker`), never in the event loop of the stack it
measures: the parent sends one JSON job per line on stdin and reads one JSON result per line.

    python -m bench._load --worker      # what LoadWorker starts
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

LOOPBACK = ("127.0.0.1", "localhost")
INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
# One JSON line per job and per answer; a replay's answer lists every request.
LINE_LIMIT = 64 * 1024 * 1024


@dataclass
class LoadResult:
    requests: int  # successful
    errors: int
    seconds: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    first_error: str | None = None

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rps": round(self.rps, 1)}


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q / 100 * len(sorted_values)))]


def check_loopback(host: str) -> None:
    if host not in LOOPBACK:
        raise ValueError(f"load generation is for loopback targets only, not {host!r}")


async def drive(send: Callable[[], Awaitable[None]], concurrency: int, seconds: float, max_requests: int) -> LoadResult:
    """`concurrency` closed-loop workers until `seconds` pass or `max_requests` are issued."""
    latencies: list[float] = []
    errors = 0
    first_error: str | None = None
    issued = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal errors, issued, first_error
        while issued < max_requests and time.perf_counter() < deadline:
            issued += 1
            start = time.perf_counter()
            try:
                await send()
            except Exception as exc:  # noqa: BLE001 - counted and reported, the run goes on
                errors += 1
                first_error = first_error or f"{type(exc).__name__}: {str(exc)[:200]}"
                continue
            latencies.append((time.perf_counter() - start) * 1000)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    latencies.sort()
    p50, p90, p99, top = (round(percentile(latencies, q), 3) for q in (50, 90, 99, 100))
    return LoadResult(len(latencies), errors, elapsed, p50, p90, p99, top, first_error=first_error)


def infer_request_bytes(model: str, x: np.ndarray, input_name: str = "x") -> bytes:
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name=input_name, datatype="FP32", shape=list(x.shape))  # data in raw_input_contents
    request.raw_input_contents.append(x.astype(np.float32).tobytes())
    return request.SerializeToString()


def http_infer_body(x: np.ndarray, input_name: str = "x", output_name: str = "y") -> tuple[bytes, dict[str, str]]:
    import tritonclient.http as httpclient

    tensor = httpclient.InferInput(input_name, list(x.shape), "FP32")
    tensor.set_data_from_numpy(x.astype(np.float32), binary_data=True)
    outputs = [httpclient.InferRequestedOutput(output_name, binary_data=True)]
    body, json_size = httpclient.InferenceServerClient.generate_request_body([tensor], outputs=outputs)
    headers = {"Content-Type": "application/octet-stream"}
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    return body, headers


@dataclass
class Job:
    """One measurement. `target` is host:port (gRPC) or http://host:port (HTTP)."""

    protocol: str  # "grpc" | "http"
    target: str
    model: str
    concurrency: int
    seconds: float
    max_requests: int = 1_000_000
    shape: list[int] = field(default_factory=lambda: [1, 4])
    input_name: str = "x"
    output_name: str = "y"
    headers: dict[str, str] = field(default_factory=dict)  # HTTP headers / gRPC metadata
    warmup_secs: float = 0.0


async def run_job(job: Job) -> LoadResult:
    x = np.ones(job.shape, dtype=np.float32)
    async with contextlib.AsyncExitStack() as stack:
        send = await _open_sender(stack, job.protocol, job.target, job.model, job.concurrency, job.headers, x,
                                  job.input_name, job.output_name)  # fmt: skip
        if job.warmup_secs:
            await drive(send, job.concurrency, job.warmup_secs, job.max_requests)
        return await drive(send, job.concurrency, job.seconds, job.max_requests)


@dataclass
class AlternatingJob:
    """The same closed-loop load on several targets in turn, ``slice_secs`` each after ``slice_warmup_secs`` on
    the slice's own new connections: ``cycles`` cycles, the targets' order rotating by one from cycle to cycle.
    Targets compared within one cycle are measured seconds apart, so a co-tenant's burst or a drift of the machine
    lands on all of them alike. ``targets``: name -> host:port (gRPC) or http://host:port (HTTP);
    ``cpu_pids``: per target, part -> the pids whose user + system CPU each slice reads (the worker adds its own
    as "client")."""

    protocol: str
    targets: dict[str, str]
    model: str
    concurrency: int
    slice_secs: float
    cycles: int
    headers: dict[str, dict[str, str]] = field(default_factory=dict)  # per target
    cpu_pids: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    warmup_secs: float = 0.5  # per target, once, before the first cycle
    slice_warmup_secs: float = 0.05  # before each slice, on its new connections (not measured)
    first_cycle: int = 0  # the first cycle's number (its place in the rotation): a job can go on from another
    shape: list[int] = field(default_factory=lambda: [1, 4])
    input_name: str = "x"
    output_name: str = "y"


def _cpu_of(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


async def run_alternating(job: AlternatingJob) -> dict[str, Any]:
    """Per slice: its cycle, target, successful requests, errors, seconds, p50 and the CPU microseconds per
    successful request of each part."""
    x = np.ones(job.shape, dtype=np.float32)

    def sender(stack: contextlib.AsyncExitStack, name: str) -> Awaitable[Callable[[], Awaitable[None]]]:
        return _open_sender(stack, job.protocol, job.targets[name], job.model, job.concurrency,
                            job.headers.get(name, {}), x, job.input_name, job.output_name)  # fmt: skip

    for name in job.targets:
        async with contextlib.AsyncExitStack() as stack:
            send = await sender(stack, name)
            await drive(send, job.concurrency, job.warmup_secs, 1_000_000)
    names = list(job.targets)
    slices: list[dict[str, Any]] = []
    for cycle in range(job.first_cycle, job.first_cycle + job.cycles):
        for name in names[cycle % len(names) :] + names[: cycle % len(names)]:
            # New connections for every slice: which of Envoy's workers takes a connection is the kernel's
            # choice, so a lopsided split is one slice's noise, not a target's bias for the whole run.
            async with contextlib.AsyncExitStack() as stack:
                send = await sender(stack, name)
                await drive(send, job.concurrency, job.slice_warmup_secs, 1_000_000)
                parts = {**job.cpu_pids.get(name, {}), "client": [os.getpid()]}
                before = {part: _cpu_of(pids) for part, pids in parts.items()}
                result = await drive(send, job.concurrency, job.slice_secs, 1_000_000)
                after = {part: _cpu_of(pids) for part, pids in parts.items()}
            ok = result.requests
            slices.append(
                {
                    "cycle": cycle,
                    "target": name,
                    "requests": ok,
                    "errors": result.errors,
                    "first_error": result.first_error,
                    "seconds": round(result.seconds, 4),
                    "rps": round(result.rps, 1),
                    "p50_ms": result.p50_ms,
                    **({f"{p}_cpu_us": round((after[p] - before[p]) / ok * 1e6, 1) for p in parts} if ok else {}),
                }
            )
    return {"slices": slices}


async def _open_sender(
    stack: contextlib.AsyncExitStack,
    protocol: str,
    target: str,
    model: str,
    concurrency: int,
    headers: dict[str, str],
    x: np.ndarray,
    input_name: str = "x",
    output_name: str = "y",
) -> Callable[[], Awaitable[None]]:
    """One request to ``target`` over a channel (gRPC) or a session of ``concurrency`` connections (HTTP) that
    ``stack`` closes: the request is built once, sent as raw bytes."""
    if protocol == "grpc":
        import grpc

        check_loopback(target.rsplit(":", 1)[0])
        payload = infer_request_bytes(model, x, input_name)
        metadata = tuple((k.lower(), v) for k, v in headers.items())
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(target))
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(INFER_METHOD)

        async def send_grpc() -> None:
            await call(payload, metadata=metadata)

        return send_grpc
    if protocol == "http":
        import aiohttp

        check_loopback(target.split("//", 1)[-1].rsplit(":", 1)[0])
        body, all_headers = http_infer_body(x, input_name, output_name)
        all_headers.update(headers)
        url = f"{target}/v2/models/{model}/infer"
        connector = aiohttp.TCPConnector(limit=concurrency)
        session = await stack.enter_async_context(aiohttp.ClientSession(connector=connector))

        async def send_http() -> None:
            async with session.post(url, data=body, headers=all_headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}")

        return send_http
    raise ValueError(f"unknown protocol {protocol!r}")


@dataclass
class ReplayJob:
    """An open-loop trace over gRPC: request i goes to ``models[trace[i][1]]`` at ``trace[i][0]`` seconds after
    the start, whether or not the requests before it were answered (a cold start does not slow the arrivals)."""

    target: str  # host:port
    models: list[str]
    trace: list[tuple[float, int]]
    headers: dict[str, str] = field(default_factory=dict)
    shape: list[int] = field(default_factory=lambda: [1, 4])
    input_name: str = "x"
    timeout_secs: float = 120.0


async def run_replay(job: ReplayJob) -> dict[str, Any]:
    """Per request: [sent at (s after the start), model index, latency ms or None, error or None]; and how late
    the client fired its latest request behind the schedule (open loop on a busy machine)."""
    import grpc

    check_loopback(job.target.rsplit(":", 1)[0])
    x = np.ones(job.shape, dtype=np.float32)
    payloads = [infer_request_bytes(m, x, job.input_name) for m in job.models]
    metadata = tuple((k.lower(), v) for k, v in job.headers.items())
    records: list[list[Any]] = []
    late = 0.0
    async with grpc.aio.insecure_channel(job.target) as channel:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(INFER_METHOD)

        async def one(sent: float, index: int) -> None:
            try:
                await call(payloads[index], metadata=metadata, timeout=job.timeout_secs)
                records.append([round(sent, 4), index, round((time.perf_counter() - start - sent) * 1000, 3), None])
            except Exception as exc:  # noqa: BLE001 - counted and reported, the replay goes on
                records.append([round(sent, 4), index, None, f"{type(exc).__name__}: {str(exc)[:200]}"])

        tasks = []
        start = time.perf_counter()
        for offset, index in job.trace:
            delay = offset - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            sent = time.perf_counter() - start
            late = max(late, sent - offset)
            tasks.append(asyncio.create_task(one(sent, index)))
        await asyncio.gather(*tasks)
    records.sort(key=lambda r: r[0])
    return {"records": records, "max_late_ms": round(late * 1000, 1), "seconds": time.perf_counter() - start}


class LoadWorker:
    """The load generator in a child process (its own interpreter and GIL), driven job by job."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> LoadWorker:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench._load",
            "--worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=LINE_LIMIT,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        proc = self._proc
        if proc is not None and proc.returncode is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def run(self, job: Job) -> LoadResult:
        return LoadResult(**await self._ask(asdict(job), job.warmup_secs + job.seconds + 120))

    async def alternate(self, job: AlternatingJob) -> dict[str, Any]:
        """``run_alternating`` in the worker; its answer."""
        bound = len(job.targets) * (job.warmup_secs + job.cycles * (job.slice_warmup_secs + job.slice_secs + 2)) + 120
        return await self._ask(asdict(job), bound)

    async def replay(self, job: ReplayJob) -> dict[str, Any]:
        """``run_replay`` in the worker; its answer."""
        end = job.trace[-1][0] if job.trace else 0.0
        return await self._ask(asdict(job), end + job.timeout_secs + 60)

    async def _ask(self, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One job line out, one answer line back within ``timeout`` seconds."""
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        proc.stdin.write((json.dumps(job) + "\n").encode())
        await proc.stdin.drain()
        line = await asyncio.wait_for(proc.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(f"the load worker exited (code {await proc.wait()})")
        data = json.loads(line)
        if "exception" in data:
            raise RuntimeError(f"load worker: {data['exception']}")
        return data


def _worker_main() -> None:
    async def loop() -> None:
        reader = asyncio.StreamReader(limit=LINE_LIMIT)
        await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            try:
                job = json.loads(line)
                if "trace" in job:
                    out = await run_replay(ReplayJob(**job))
                elif "cycles" in job:
                    out = await run_alternating(AlternatingJob(**job))
                else:
                    out = asdict(await run_job(Job(**job)))
            except Exception as exc:  # noqa: BLE001 - sent back to the parent
                out = {"exception": f"{type(exc).__name__}: {exc}"}
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()

    asyncio.run(loop())


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        _worker_main()
    else:
        sys.exit("usage: python -m bench._load --worker  (driven by bench._load.LoadWorker)")
