"""Shared test harness: `snoozectl serve` as a subprocess on free ports, the scale test model package,
process-tree and repository inspection.

Used by the integration stack tests (auth on, ``models.toml``) and the reliability suite (``--no-auth``,
models published through the API).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from controlplane.api.client import ControlPlaneClient
from controlplane.child_processes import wait_gone
from controlplane.triton.launcher import STUB_NAME, free_port
from harness.probes import until

SNOOZECTL = str(Path(sys.executable).parent / "snoozectl")

# ------------------------------------------------------------------------------------------------
# The test model package: y = x * scale, x and y FP32 [dims]

MODEL_PY = '''
import ctypes
import os
import time

import numpy as np


class Model:
    """Knobs: ``crash="poison"`` exits on a request whose x[:, 0] is -1; ``crash="segv"|"exit"`` crashes
    once per ``crash_file`` created; ``marker`` (a file) logs predict calls that sleep, and a request whose
    x[:, 0] is -2 then stays 3 s in flight; ``ballast_mb`` is held (touched) after load; ``calls`` (a file)
    gets one line per row predict receives: its x[0] (to count executions); ``helper_secs``: load() forks a
    process that lives that long, as a model's data loader or tokenizer server would (it inherits the stub's
    open files)."""

    def __init__(self, scale=2.0, predict_sleep=0.0, load_sleep=0.0, load_error="", crash="", crash_file="",
                 ballast_mb=0, marker="", calls="", helper_secs=0.0):
        self.scale, self.predict_sleep, self.load_sleep = scale, predict_sleep, load_sleep
        self.load_error, self.crash, self.crash_file = load_error, crash, crash_file
        self.ballast_mb, self.marker, self.calls, self.helper_secs = ballast_mb, marker, calls, helper_secs

    def load(self, model_dir, device):
        time.sleep(self.load_sleep)
        if self.load_error == "memory":
            raise MemoryError("simulated: cannot allocate the weights")
        # Touched pages, so that the stub's RSS (the measured footprint) holds them.
        self.ballast = np.ones(self.ballast_mb * 1024 * 1024 // 8) if self.ballast_mb else None
        if self.helper_secs and os.fork() == 0:
            time.sleep(self.helper_secs)
            os._exit(0)

    def predict(self, inputs):
        x = inputs["x"]
        if self.calls:
            with open(self.calls, "a") as f:
                f.write("".join(f"{v:g}\\n" for v in x[:, 0]))
        if self.crash == "poison":
            if (x[:, 0] == -1).any():
                os._exit(1)  # the stub process dies in the middle of a request
        elif self.crash and self._triggered():
            if self.crash == "segv":
                ctypes.string_at(0)  # SIGSEGV: the stub process dies
            os._exit(3)
        hold = bool(self.marker) and (x[:, 0] == -2).any()  # a request that stays in flight for a while
        if self.predict_sleep or hold:
            if self.marker:
                with open(self.marker, "a") as f:
                    f.write("started\\n")
            time.sleep(max(self.predict_sleep, 3.0 if hold else 0.0))
        return {"y": (x * self.scale).astype(np.float32)}

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
    "ballast_mb": {"type": "int", "default": 0},
    "marker": {"type": "str", "default": ""},
    "calls": {"type": "str", "default": ""},
    "helper_secs": {"type": "float", "default": 0.0},
}


def write_package(
    folder: Path,
    *,
    dims: int = 2,
    params: dict[str, Any] | None = None,
    load_timeout_secs: float | None = None,
    request_timeout_secs: float | None = None,
    weights_mb: int = 0,
    warmup: bool = False,
) -> Path:
    """The test model (``y = x * scale``, x and y: FP32 [dims]); optional manifest ``params``,
    ``load_timeout_secs`` and ``request_timeout_secs``; an optional weights file of ``weights_mb``.
    Its predict has side effects (call logs, crash triggers, sleeps), so the load's warm-up inference is off
    unless ``warmup``: tests count and time its calls."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "snooze_model.py").write_text(textwrap.dedent(MODEL_PY))
    manifest: dict[str, Any] = {
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [dims]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [dims]}],
    }
    if params is not None:
        manifest["params"] = params
    manifest["params_schema"] = PARAMS_SCHEMA
    manifest["warmup"] = warmup
    if load_timeout_secs is not None:
        manifest["load_timeout_secs"] = load_timeout_secs
    if request_timeout_secs is not None:
        manifest["request_timeout_secs"] = request_timeout_secs
    (folder / "snooze_model.json").write_text(json.dumps(manifest))
    if weights_mb:
        chunk = os.urandom(1 << 20)
        with open(folder / "weights.bin", "wb") as f:
            for _ in range(weights_mb):
                f.write(chunk)
    return folder


# ------------------------------------------------------------------------------------------------
# Polling, processes, trees


def tree_digest(root: Path, *, skip: frozenset[str] = frozenset()) -> str:
    """Every path, kind, mode, link target and byte under ``root``, but files named in ``skip``."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.name in skip:
            continue
        rel = path.relative_to(root).as_posix()
        st = path.lstat()
        h.update(f"{rel}\0{st.st_mode}\0".encode())
        if path.is_symlink():
            h.update(os.readlink(path).encode())
        elif path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def is_alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def alive_pids(pids: Iterable[int]) -> list[int]:
    """The pids that still run (zombies count as gone)."""
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if is_alive(psutil.Process(pid)):
                found.append(pid)
    return found


def alive(processes: Iterable[psutil.Process]) -> list[psutil.Process]:
    """The ones still running (zombies count as gone)."""
    return [p for p in processes if is_alive(p)]


def _name(p: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return p.name()
    return ""


def until_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The first line ``proc`` writes to its stdout within ``timeout`` seconds ('' if it exits first)."""
    assert proc.stdout is not None
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    return lines[0].decode().strip() if lines else ""


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


# ------------------------------------------------------------------------------------------------
# `snoozectl serve` in a child process

_ADMIN: Any = object()  # "the admin key" default of Serve.api (None means no key)


TOPOLOGIES = ("embedded", "two_process")
WORKERS = ("in-stub", "preforked")  # where a custom model's code runs (the deployment's `worker`)


class Serve:
    """`snoozectl serve` as a subprocess (its own session) on free ports; restartable on the same ports
    and work dir. ``env`` is the whole environment of the child. With ``admin_key`` auth is on (the keys
    come from ``env``) and the control API calls send it; without, it runs ``--no-auth``. ``models``:
    a ``--models`` folder (models.toml).

    ``topology``: "embedded" (serve starts tritonserver as its child) or "two_process" (`snoozectl
    triton` runs tritonserver in a process of its own, and serve connects with --triton-url: the
    deployed topology of compose and Kubernetes, on one machine)."""

    def __init__(self, work_dir: Path, env: dict[str, str], *, models: Path | None = None,
                 admin_key: str | None = None, topology: str = "embedded") -> None:  # fmt: skip
        assert topology in TOPOLOGIES, topology
        self.work_dir = work_dir
        self.models_dir = models
        self.env = env
        self.admin_key = admin_key
        self.topology = topology
        self.http_port, self.grpc_port, self.api_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.triton_proc: subprocess.Popen[bytes] | None = None  # `snoozectl triton` (two_process)
        self.triton_urls: dict[str, Any] = {}
        self.log = work_dir.parent / f"{work_dir.name}.serve.log"
        self.triton_log = work_dir.parent / f"{work_dir.name}.triton.log"
        self.starts = 0
        self.seen: dict[int, psutil.Process] = {}  # every descendant ever observed

    def start_triton(self, timeout: float = 60.0) -> None:
        """Start `snoozectl triton` over this stack's repository (two_process); its URLs once live."""
        self.repository.mkdir(parents=True, exist_ok=True)
        cmd = [
            SNOOZECTL, "triton", "--model-repository", str(self.repository),
            "--work-dir", str(self.work_dir.parent / f"{self.work_dir.name}.triton"),
            "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--json",
            "--exit-timeout-secs", self.env.get("SNOOZE_TRITON_EXIT_TIMEOUT_SECS", "5"),
        ]  # fmt: skip
        with open(self.triton_log, "ab") as log:
            self.triton_proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=self.env,
                start_new_session=True,
            )  # fmt: skip
        assert self.triton_proc.stdout is not None
        line = until_line(self.triton_proc, timeout)
        if not line:
            raise AssertionError(f"snoozectl triton did not start:\n{self.triton_log.read_text(errors='replace')}")
        self.triton_urls = json.loads(line)

    @property
    def http_url(self) -> str:  # tritonclient form
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def repository(self) -> Path:
        return self.work_dir / "model_repository"

    @property
    def staging(self) -> Path:
        return self.work_dir / ".model_repository.staging"

    def start(self, timeout: float = 60.0, *, ready: bool = False, published: bool = True) -> float:
        """Start; wait until the control API (started last) answers /health/live (/health/ready with
        ``ready``), both gateway ports accept and (``published``) every ``--models`` package is published;
        seconds taken."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        started = time.monotonic()
        cmd = [
            SNOOZECTL, "serve", "--work-dir", str(self.work_dir),
            "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port), "--api-port", str(self.api_port),
        ]  # fmt: skip
        if self.topology == "two_process":
            if self.triton_proc is None or self.triton_proc.poll() is not None:
                self.start_triton()
            urls = self.triton_urls
            cmd += [
                "--triton-url", urls["http_url"], "--triton-grpc-url", urls["grpc_url"],
                "--triton-metrics-url", urls["metrics_url"], "--model-repository", str(self.repository),
            ]  # fmt: skip
        if self.models_dir is not None:
            cmd += ["--models", str(self.models_dir)]
        if self.admin_key is None:
            cmd.append("--no-auth")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True,
            )  # fmt: skip
        self.starts += 1
        health = f"{self.api_url}/health/{'ready' if ready else 'live'}"
        until(
            lambda: self._up(health, published),
            lambda: f"snoozectl serve to answer {health}:\n{self.log_tail()}",
            timeout,
        )
        self.descendants()
        return time.monotonic() - started

    def _up(self, health: str, published: bool = True) -> bool:
        """``health`` answers 200 and both gateway ports accept; fails at once if serve exited."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"snoozectl serve exited with {self.proc.returncode}:\n{self.log_tail()}")
        with contextlib.suppress(httpx.TransportError):
            return (
                httpx.get(health, timeout=2).status_code == 200
                and all(_accepts(p) for p in (self.http_port, self.grpc_port))
                and (not published or self._published())
            )
        return False

    def _published(self) -> bool:
        """``--models`` are published in the background after the API is live: every test starts once they are."""
        r = httpx.get(f"{self.api_url}/v1/publishing", headers=self._headers(), timeout=2)
        return r.status_code != 200 or not r.json().get("in_progress")

    def log_tail(self, lines: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def triton_log_tail(self, lines: int = 60) -> str:
        """The end of tritonserver's own log (its loads, unloads and stub errors): serve's child writes it into the
        work dir, `snoozectl triton`'s into its own (two_process)."""
        for folder in (self.work_dir / "triton", self.work_dir.parent / f"{self.work_dir.name}.triton"):
            with contextlib.suppress(OSError):
                return "\n".join((folder / "triton.log").read_text(errors="replace").splitlines()[-lines:])
        return ""

    # --- the process tree

    def descendants(self) -> list[psutil.Process]:
        """The stack's processes now: serve's descendants, and `snoozectl triton`'s with its own
        process (two_process); also remembered for the orphan checks."""
        children = []
        for proc in (self.proc, self.triton_proc):
            if proc is None or proc.poll() is not None:
                continue
            with contextlib.suppress(psutil.Error):
                children += psutil.Process(proc.pid).children(recursive=True)
                if proc is self.triton_proc:
                    children.append(psutil.Process(proc.pid))
        for p in children:
            self.seen.setdefault(p.pid, p)
        return children

    def tritonserver(self) -> psutil.Process | None:
        """The live tritonserver child, or None (dead and not yet restarted)."""
        found = [p for p in alive(self.descendants()) if _name(p) == "tritonserver"]
        return found[0] if found else None

    def stub_pids(self, model: str | None = None) -> list[int]:
        """Live python-backend stub pids (of one model): argv[1] is <repo>/<model>/<version>/model.py."""
        pids = []
        for p in self.descendants():
            with contextlib.suppress(psutil.Error):
                argv = p.cmdline()
                if argv and argv[0].endswith(STUB_NAME) and is_alive(p):
                    if model is None or (len(argv) > 1 and Path(argv[1]).parent.parent.name == model):
                        pids.append(p.pid)
        return sorted(pids)

    def journal_dirs(self) -> list[Path]:
        """Where Triton's stubs journal (and name their preforked workers): embedded, or two_process."""
        return [self.work_dir / "triton" / "journal", self.work_dir.parent / f"{self.work_dir.name}.triton" / "journal"]

    def worker_pids(self, model: str | None = None) -> list[int]:
        """Live preforked workers (of one model), from the notes their stubs write beside their journals."""
        return sorted(pid for pid, _ in self.workers(model))

    def workers(self, model: str | None = None) -> list[tuple[int, int]]:
        """(worker pid, its stub's pid) of live preforked workers (of one model)."""
        found = []
        for stub in self.stub_pids(model):
            with contextlib.suppress(OSError, ValueError, KeyError, psutil.Error):
                ticks = int(Path(f"/proc/{stub}/stat").read_text().rsplit(")", 1)[1].split()[19])
                for folder in self.journal_dirs():
                    note = folder / f"{stub}-{ticks}.worker"
                    if note.exists():
                        pid = int(json.loads(note.read_text())["pid"])
                        if is_alive(psutil.Process(pid)):
                            found.append((pid, stub))
        return found

    def noted_workers(self, model: str) -> list[int]:
        """Every preforked worker a stub of ``model`` ever noted (alive or not): to check they are gone."""
        pids = []
        for folder in self.journal_dirs():
            for note in folder.glob("*.worker") if folder.is_dir() else ():
                with contextlib.suppress(OSError, ValueError, KeyError):
                    raw = json.loads(note.read_text())
                    if raw.get("model") == model:
                        pids.append(int(raw["pid"]))
        return sorted(pids)

    def model_pids(self, model: str, worker: str = "in-stub") -> list[int]:
        """The processes that run the model's code: its stubs, or its preforked workers."""
        return self.worker_pids(model) if worker == "preforked" else self.stub_pids(model)

    def leftovers(self) -> list[psutil.Process]:
        """Live processes that belong to this stack: descendants seen, or naming its work dir."""
        me = os.getpid()
        found = {pid: p for pid, p in self.seen.items() if is_alive(p)}
        for p in psutil.process_iter():
            if p.pid != me and p.pid not in found and str(self.work_dir) in cmdline(p) and is_alive(p):
                found[p.pid] = p
        return list(found.values())

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

    def kill9(self) -> list[psutil.Process]:
        """SIGKILL the control plane alone (its children are left to fend for themselves); returns them."""
        assert self.proc is not None
        children = self.descendants()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        return children

    def stop(self, grace: float = 60) -> int | None:
        """SIGTERM (graceful), then SIGKILL of the process group and of every leftover; the exit code
        (None: it had to be killed, or never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.descendants()
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        with_kill = self.proc.poll() is None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.stop_triton()
        left = self.leftovers()  # tritonserver and Envoy run in sessions of their own
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        wait_gone(left, 10)
        return None if with_kill else self.proc.returncode

    def stop_triton(self) -> None:
        """Stop `snoozectl triton` (two_process): SIGTERM, then SIGKILL of its process group."""
        proc = self.triton_proc
        if proc is None:
            return
        if proc.poll() is None:
            self.descendants()
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    # --- control API

    def _headers(self) -> dict[str, str]:
        return {"X-API-Key": self.admin_key} if self.admin_key else {}

    def api(self, key: str | None = _ADMIN) -> ControlPlaneClient:
        """A control API client with ``key`` (default: the admin key; None: no key)."""
        return ControlPlaneClient(self.api_url, self.admin_key if key is _ADMIN else key, timeout=120)

    def publish(self, model_id: str, package: Path, *, timeout: float = 120, **deployment: Any) -> dict[str, Any]:
        r = httpx.post(
            f"{self.api_url}/v1/models:from-path",
            json={"id": model_id, "path": str(package), **deployment},
            headers=self._headers(),
            timeout=timeout,
        )
        assert r.status_code == 201, r.text
        return r.json()

    def models(self) -> dict[str, dict[str, Any]]:
        r = httpx.get(f"{self.api_url}/v1/models", headers=self._headers(), timeout=30)
        assert r.status_code == 200, r.text
        return {m["id"]: m for m in r.json()}

    def status(self, model_id: str) -> dict[str, Any]:
        r = httpx.get(f"{self.api_url}/v1/models/{model_id}", headers=self._headers(), timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["status"]

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the control plane's Prometheus metrics (0 when absent)."""
        return next(iter(self._samples(name, labels)), 0.0)

    def metric_total(self, name: str, **labels: str) -> float:
        """The sum of the samples whose labels include ``labels`` (a counter over every value of its other labels)."""
        return sum(self._samples(name, labels))

    def _samples(self, name: str, labels: dict[str, str]) -> list[float]:
        text = httpx.get(f"{self.api_url}/metrics", timeout=30).text
        return [
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        ]

    def snoozectl(self, *args: str, key: str | None = _ADMIN) -> subprocess.CompletedProcess[str]:
        """The CLI against this stack's control API, with ``key`` (default: the admin key)."""
        key = self.admin_key if key is _ADMIN else key
        env = {**os.environ, "SNOOZE_API_URL": self.api_url, "COLUMNS": "200"}  # tables unwrapped
        if key:
            env["SNOOZE_API_KEY"] = key
        return subprocess.run([SNOOZECTL, *args], capture_output=True, text=True, env=env, timeout=120)
