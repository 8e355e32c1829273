"""Fault-injection helpers: a `snoozectl serve` subprocess, the test model package, continuous traffic.

Everything is black-box: the stack runs as users run it (`snoozectl serve` on free ports over a tmp
work dir), traffic goes through the Envoy gateway with the standard tritonclient clients, and the
state is read from the control API, the repository folder and the process tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import tritonclient.grpc.aio as grpcaio
import tritonclient.http.aio as httpaio
from tritonclient.utils import InferenceServerException

from controlplane.triton.launcher import STUB_NAME, free_port

SNOOZECTL = str(Path(sys.executable).parent / "snoozectl")
DEADLINE = 60.0  # generous: a 2-core machine running a whole stack
ERROR_PAUSE = 0.05  # a client that got an error waits this long before its next request (no busy loop)

MODEL_PY = '''
import ctypes
import os
import time


class Model:
    def __init__(self, scale=2.0, predict_sleep=0.0, load_sleep=0.0, load_error="", crash="", crash_file=""):
        self.scale, self.predict_sleep, self.load_sleep = scale, predict_sleep, load_sleep
        self.load_error, self.crash, self.crash_file = load_error, crash, crash_file

    def load(self, model_dir, device):
        time.sleep(self.load_sleep)
        if self.load_error == "memory":
            raise MemoryError("simulated: cannot allocate the weights")

    def predict(self, inputs):
        if self.crash and self._triggered():
            if self.crash == "segv":
                ctypes.string_at(0)  # SIGSEGV: the stub process dies
            os._exit(3)
        time.sleep(self.predict_sleep)
        return {"y": inputs["x"] * self.scale}

    def _triggered(self):
        try:
            os.unlink(self.crash_file)  # one crash per trigger file
            return True
        except OSError:
            return False
'''

PARAMS_SCHEMA = {
    "scale": {"type": "float", "default": 2.0},
    "predict_sleep": {"type": "float", "default": 0.0},
    "load_sleep": {"type": "float", "default": 0.0},
    "load_error": {"type": "str", "default": ""},
    "crash": {"type": "str", "default": ""},
    "crash_file": {"type": "str", "default": ""},
}


def write_package(folder: Path, *, load_timeout_secs: float | None = None, weights_mb: int = 0) -> Path:
    """The reliability test model (``y = x * scale``, x: FP32 [2]); optional weights file of ``weights_mb``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "snooze_model.py").write_text(textwrap.dedent(MODEL_PY))
    manifest: dict[str, Any] = {
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
        "params_schema": PARAMS_SCHEMA,
    }
    if load_timeout_secs is not None:
        manifest["load_timeout_secs"] = load_timeout_secs
    (folder / "snooze_model.json").write_text(json.dumps(manifest))
    if weights_mb:
        chunk = os.urandom(1 << 20)
        with open(folder / "weights.bin", "wb") as f:
            for _ in range(weights_mb):
                f.write(chunk)
    return folder


async def until(predicate: Callable[[], bool], what: str, timeout: float = DEADLINE, every: float = 0.1) -> float:
    """Poll ``predicate`` (blocking calls run in a thread); seconds it took."""
    started = time.monotonic()
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() - started < timeout, f"timed out after {timeout:g}s waiting for {what}"
        await asyncio.sleep(every)
    return time.monotonic() - started


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


class Serve:
    """`snoozectl serve --no-auth` as a subprocess on free ports; restartable on the same ports and work dir."""

    def __init__(self, work_dir: Path, env: dict[str, str] | None = None) -> None:
        self.work_dir = work_dir
        self.http_port, self.grpc_port, self.api_port = free_port(), free_port(), free_port()
        self.env = {**os.environ, "SNOOZE_SWEEP_INTERVAL_SECS": "0.5", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = work_dir.parent / f"{work_dir.name}.serve.log"
        self.starts = 0

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def repository(self) -> Path:
        return self.work_dir / "model_repository"

    @property
    def staging(self) -> Path:
        return self.work_dir / ".model_repository.staging"

    def start(self, timeout: float = DEADLINE) -> float:
        """Start and wait until the control API (started last) and both gateway ports answer; seconds taken."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        started = time.monotonic()
        cmd = [
            SNOOZECTL, "serve", "--no-auth", "--work-dir", str(self.work_dir),
            "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port), "--api-port", str(self.api_port),
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.starts += 1
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"snoozectl serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.api}/health/live", timeout=2).status_code == 200 and all(
                    _accepts(p) for p in (self.http_port, self.grpc_port)
                ):
                    return time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise AssertionError(f"snoozectl serve not up within {timeout:g}s:\n{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, lines: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def children(self) -> list[psutil.Process]:
        if self.proc is None or self.proc.poll() is not None:
            return []
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.proc.pid).children(recursive=True)
        return []

    def tritonserver(self) -> psutil.Process | None:
        """The live tritonserver child, or None (dead and not yet restarted)."""
        found = [p for p in alive(self.children()) if _name(p) == "tritonserver"]
        return found[0] if found else None

    def stubs(self, model: str | None = None) -> list[int]:
        """Live python-backend stub pids (of one model): argv[1] is <repo>/<model>/<version>/model.py."""
        pids = []
        for p in self.children():
            with contextlib.suppress(psutil.Error):
                argv = p.cmdline()
                if argv and argv[0].endswith(STUB_NAME) and p.status() != psutil.STATUS_ZOMBIE:
                    if model is None or (len(argv) > 1 and Path(argv[1]).parent.parent.name == model):
                        pids.append(p.pid)
        return sorted(pids)

    def kill9(self) -> list[psutil.Process]:
        """SIGKILL the control plane alone (its children are left to fend for themselves); returns them."""
        assert self.proc is not None
        children = self.children()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        return children

    def stop(self) -> None:
        """SIGTERM (graceful), SIGKILL if it hangs; then make sure no process it started is left."""
        if self.proc is None:
            return
        children = self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        for p in children:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(children, timeout=10)

    def rss(self) -> dict[str, int]:
        """Resident bytes of the control plane process and of the Triton process tree (server + stubs)."""
        assert self.proc is not None
        cp = psutil.Process(self.proc.pid).memory_info().rss
        triton = self.tritonserver()
        assert triton is not None, "tritonserver is not running"
        tree = 0
        for p in [triton, *triton.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                tree += p.memory_info().rss
        return {"control_plane": cp, "triton_tree": tree}

    # --- control API (auth off)

    def publish(self, model_id: str, package: Path, *, timeout: float = 120, **deployment: Any) -> dict[str, Any]:
        r = httpx.post(
            f"{self.api}/v1/models:from-path",
            json={"id": model_id, "path": str(package), **deployment},
            timeout=timeout,
        )
        assert r.status_code == 201, r.text
        return r.json()

    def models(self) -> dict[str, dict[str, Any]]:
        r = httpx.get(f"{self.api}/v1/models", timeout=30)
        assert r.status_code == 200, r.text
        return {m["id"]: m for m in r.json()}

    def status(self, model_id: str) -> dict[str, Any]:
        r = httpx.get(f"{self.api}/v1/models/{model_id}", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["status"]

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the control plane's Prometheus metrics (0 when absent)."""
        text = httpx.get(f"{self.api}/metrics", timeout=30).text
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def _name(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return p.name()
    return ""


def alive(processes: Iterable[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in processes:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


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
                inp = grpcaio.InferInput("x", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                started = time.monotonic()
                try:
                    r = await client.infer(model, [inp], client_timeout=self.timeout)
                    error = self._check(model, x, r.as_numpy("y"))
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
                inp = httpaio.InferInput("x", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                started = time.monotonic()
                try:
                    r = await asyncio.wait_for(client.infer(model, [inp]), self.timeout)
                    error = self._check(model, x, r.as_numpy("y"))
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
