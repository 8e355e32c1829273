"""The embedded target: the ``tritonserver`` binary and python backend shipped in the nvidia-pytriton wheel.

``EmbeddedTriton`` runs the server in its own process group so that its python-backend stubs never
outlive it; ``embedded_dist.py`` finds and checks the pieces it runs (``find_embedded_triton()``) and
builds the backend folder with the stub matching this interpreter (``prepare_backend_dir()``).

Python-backend stub command line (observed on tritonserver 2.51)::

    <backend-dir>/python/triton_python_backend_stub <repo>/<model>/<version>/model.py <shm-region>
        <shm-default-bytes> <shm-growth-bytes> <tritonserver-pid> <backend-dir>/python <ipc-handle>
        <model>_<group>_<instance> DEFAULT

One stub process per model instance, a direct child of tritonserver in its process group. The
instance name (``tiny_0_0``, ``tiny_0_1``) is built from the instance group's name, which a config
may set, so ``stub_pids`` matches a model by the model file's folder in argv[1] instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil

from controlplane.child_processes import kill_group, log_tail, spawn, stop_group, wait_gone
from controlplane.errors import TritonLaunchError
from controlplane.triton.defer_shim import build_defer_shim, with_preload
from controlplane.triton.embedded_dist import EmbeddedTritonDist, find_embedded_triton, prepare_backend_dir
from controlplane.triton.journal import HEADER_FORWARD_ARGS, JOURNAL_ENV, prepare_journal_dir, remove_stale
from controlplane.triton.processes import STUB_NAME, TritonProcesses
from python_backend.bls_wake import TIMEOUT_ENV as BLS_WAKE_TIMEOUT_ENV
from python_backend.doze import ADMIT_TIMEOUT_ENV as DOZE_ADMIT_TIMEOUT_ENV
from python_backend.doze import DEFAULT_ADMIT_TIMEOUT_SECS

LOG_TAIL_LINES = 40
SHM_DIR = "/dev/shm"


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


# Ports handed out by free_port in any process on this machine during the last PORT_HOLD_SECS: one
# empty file per port. Another process choosing in the same window (a parallel test worker, a bench
# subprocess, a second stack) skips them, so two servers are not given one port before either binds.
PORT_CLAIMS = Path(os.environ.get("SNOOZE_PORT_CLAIMS_DIR", "/tmp/snoozeml-port-claims"))
PORT_HOLD_SECS = 300.0


def _claim(port: int) -> bool:
    """Claim ``port`` for this caller unless another claimed it within PORT_HOLD_SECS."""
    path = PORT_CLAIMS / str(port)
    try:
        PORT_CLAIMS.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        return True
    except FileExistsError:
        with contextlib.suppress(OSError):
            if time.time() - path.stat().st_mtime > PORT_HOLD_SECS:
                os.utime(path)  # a stale claim: take it over
                return True
        return False
    except OSError:
        return True  # no claims folder to write (read-only /tmp): the bind check alone


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago and that no other caller was given recently, chosen
    below the kernel's ephemeral range.

    Between this call and the server's bind, any outgoing connection may be given an ephemeral
    port; picking outside that range keeps such connections from taking the port meanwhile."""
    low = _ephemeral_range()[0]
    candidates = random.sample(range(max(1024, low - 12000), low), 64) if low > 2048 else []
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        if _claim(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def doze_admit_bound(wake_queue_timeout_secs: float) -> float:
    """The stubs' bound on a wake from doze's ask for room: past the control plane's own wait for memory (the wake
    queue's bound), so that it answers first."""
    return max(DEFAULT_ADMIT_TIMEOUT_SECS, wake_queue_timeout_secs + 5.0)


class EmbeddedTriton:
    """One tritonserver process over a model repository, in explicit model-control mode."""

    def __init__(
        self,
        model_repository: Path,
        work_dir: Path,
        *,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        host: str = "127.0.0.1",
        extra_args: list[str] | tuple[str, ...] = (),
        log_file: Path | None = None,
        shm_default_byte_size: int = 1 << 20,
        shm_growth_byte_size: int = 1 << 20,
        stub_timeout_secs: int = 30,
        exit_timeout_secs: int = 10,
        dist: EmbeddedTritonDist | None = None,
        journal_dir: Path | None = None,
        admin_header: str | None = None,
        admin_key: str | None = None,
        defer_shim: bool = True,
        bls_wake_timeout_secs: float | None = None,
        doze_admit_timeout_secs: float | None = None,
    ) -> None:
        self.model_repository = Path(model_repository).resolve()
        self.work_dir = Path(work_dir).resolve()
        self.host = host
        self.http_port = http_port or free_port(host)
        self.grpc_port = grpc_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.extra_args = list(extra_args)
        self.log_file = Path(log_file) if log_file else self.work_dir / "triton.log"
        self.shm_default_byte_size = shm_default_byte_size
        self.shm_growth_byte_size = shm_growth_byte_size
        self.stub_timeout_secs = stub_timeout_secs
        self.exit_timeout_secs = exit_timeout_secs
        self.dist = dist
        # Where its python stubs journal the requests they run (controlplane/triton/journal.py).
        self.journal_dir = Path(journal_dir).resolve() if journal_dir else self.work_dir / "journal"
        # The bound of a BLS call that wakes its callee (python_backend/bls_wake.py); None: the stubs' default.
        self.bls_wake_timeout_secs = bls_wake_timeout_secs
        # How long a wake from doze waits for the control plane's room (python_backend/doze.py); None: its default.
        self.doze_admit_timeout_secs = doze_admit_timeout_secs
        # The model-repository API restricted to requests with this header, as in the deployed stacks.
        self.admin_header = admin_header
        self.admin_key = admin_key
        # Preload defer_send.c: Triton's HTTP frontend otherwise loses streamed responses (defer_shim.py).
        self.defer_shim = defer_shim
        self.preload: Path | None = None
        # Names this server's /dev/shm regions, so that stop() can remove those a crash leaves behind.
        self.shm_region_prefix = f"snooze_{uuid.uuid4().hex[:8]}_"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """``host:port``, the form tritonclient.grpc expects."""
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}"

    def command(self, backend_dir: Path) -> list[str]:
        assert self.dist is not None
        backend_config = [
            f"shm-default-byte-size={self.shm_default_byte_size}",
            f"shm-growth-byte-size={self.shm_growth_byte_size}",
            f"stub-timeout-seconds={self.stub_timeout_secs}",
            f"shm-region-prefix-name={self.shm_region_prefix}",
        ]
        return [
            str(self.dist.tritonserver),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backend_dir}",
            "--model-control-mode=explicit",
            "--disable-auto-complete-config",
            "--strict-readiness=false",
            f"--exit-timeout-secs={self.exit_timeout_secs}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            "--allow-metrics=true",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            *(f"--backend-config=python,{kv}" for kv in backend_config),
            *HEADER_FORWARD_ARGS,
            *self.restricted_api_args(),
            *self.extra_args,
        ]

    def restricted_api_args(self) -> list[str]:
        if not self.admin_key:
            return []
        rule = f"model-repository:{self.admin_header or 'snooze-admin'}={self.admin_key}"
        return [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]

    def environment(self) -> dict[str, str]:
        """The server's environment: bundled libraries and this environment's ``bin/`` first."""
        assert self.dist is not None
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (self.dist.library_path(), env.get("LD_LIBRARY_PATH")) if p)
        env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.executable).parent), env.get("PATH")) if p)
        env[JOURNAL_ENV] = str(self.journal_dir)  # also where the stubs find the BLS wake route (its socket)
        # The stubs' bytecode goes beside, not into the model repository: a __pycache__ written into a model's
        # folder by its first load is a change of its files to Triton, which then loads it anew (a second set of
        # instances, the first ended) when the next load names it, an ensemble's over it included.
        env.setdefault("PYTHONPYCACHEPREFIX", str(self.work_dir / "pycache"))
        if self.bls_wake_timeout_secs is not None:
            env[BLS_WAKE_TIMEOUT_ENV] = f"{self.bls_wake_timeout_secs:g}"
        if self.doze_admit_timeout_secs is not None:
            env[DOZE_ADMIT_TIMEOUT_ENV] = f"{self.doze_admit_timeout_secs:g}"
        return with_preload(env, self.preload)

    def start(self, timeout: float = 60) -> None:
        """Launch tritonserver and wait until it is live; on failure raise with the log's tail."""
        if self.is_running():
            raise TritonLaunchError(f"tritonserver is already running (pid {self.pid})")
        self.dist = self.dist or find_embedded_triton()
        if not self.model_repository.is_dir():
            raise TritonLaunchError(
                f"model repository {self.model_repository} is not a folder", hint="create it or fix the path"
            )
        backend_dir = prepare_backend_dir(self.work_dir, self.dist)
        if self.defer_shim and self.preload is None:
            self.preload = build_defer_shim(self.work_dir)
        self._clean_up_after_previous_run()
        prepare_journal_dir(self.journal_dir)
        remove_stale(self.journal_dir)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.command(backend_dir)
        with open(self.log_file, "ab") as log:
            self._log_offset = log.tell()
            self._proc = spawn(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                cwd=self.work_dir,
                start_new_session=True,
            )
        self._write_run_file()
        self._wait_live(timeout)

    @property
    def run_file(self) -> Path:
        """Pid, start time and shm prefix of the server this work dir runs (removed by ``stop()``)."""
        return self.work_dir / "tritonserver.run.json"

    def _write_run_file(self) -> None:
        assert self._proc is not None
        try:
            created = psutil.Process(self._proc.pid).create_time()
        except psutil.Error:
            created = None
        record = {"pid": self._proc.pid, "create_time": created, "shm_region_prefix": self.shm_region_prefix}
        tmp = self.run_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, self.run_file)

    def _clean_up_after_previous_run(self) -> None:
        """A run that was not stopped (the control plane was killed) can leave its tritonserver, its
        stubs (if the server outlived the control plane) and its /dev/shm regions: remove them."""
        try:
            record = json.loads(self.run_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        pid, created = record.get("pid"), record.get("create_time")
        try:
            proc = psutil.Process(int(pid))
            if created is not None and abs(proc.create_time() - float(created)) < 0.01:  # not a reused pid
                kill_group(proc.pid)
                wait_gone([proc], 10)
        except (psutil.Error, TypeError, ValueError):
            pass
        # Stubs outlive a killed server (reparented, some for good): those of its process group whose
        # binary is this work dir's stub.
        with contextlib.suppress(TypeError, ValueError):
            leftovers = [p for p in _stubs_under(self.work_dir) if _pgid(p.pid) == int(pid)]
            for p in leftovers:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            wait_gone(leftovers, 10)
        prefix = str(record.get("shm_region_prefix") or "")
        if prefix.startswith("snooze_"):
            for region in Path(SHM_DIR).glob(f"{prefix}*"):
                region.unlink(missing_ok=True)
        self.run_file.unlink(missing_ok=True)

    def _wait_live(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    code = self._proc.returncode if self._proc else None
                    raise self._failure(f"tritonserver exited with code {code} during start-up")
                # Our process must own the port: a live answer could come from another server.
                if self._listening_on(self.http_port):
                    try:
                        if http.get(f"{self.http_url}/v2/health/live").status_code == 200:
                            return
                    except httpx.TransportError:
                        pass
                time.sleep(0.05)
        self.stop()
        raise self._failure(f"tritonserver was not live on {self.http_url} within {timeout:.0f}s")

    def _listening_on(self, port: int) -> bool:
        try:
            conns = psutil.Process(self.pid).net_connections(kind="tcp")
        except (psutil.Error, TypeError):
            return False
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)

    def _failure(self, what: str) -> TritonLaunchError:
        return TritonLaunchError(
            f"{what}; last lines of {self.log_file}:\n{self.log_tail()}",
            hint="read the log above; a port in use or a broken install are the usual causes",
        )

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines this run wrote to the log file."""
        return log_tail(self.log_file, self._log_offset, lines)

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def end_leftovers(self) -> None:
        """After tritonserver exited: SIGKILL what is left of its process group (its stubs, and processes a
        model forked). They inherited its client connections (Triton's sockets are not close-on-exec), so
        while one lives, a request Envoy or the control plane sends over such a connection waits for an
        answer that never comes, instead of failing at once."""
        if self._proc is not None and self._proc.poll() is not None:
            kill_group(self._proc.pid)

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM, wait, then SIGKILL the whole process group; returns once no process of it is left."""
        proc = self._proc
        if proc is None:
            return
        timeout = self.exit_timeout_secs + 5 if timeout is None else timeout
        children = self._children()
        stop_group(proc, timeout)
        # Stubs left behind (server killed) are reparented; make sure they are gone, zombies included.
        _, alive = wait_gone(children, 5)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        _, alive = wait_gone(alive, 5)
        alive = [p for p in alive if _is_live(p)]
        if alive:
            raise TritonLaunchError(f"processes of tritonserver {proc.pid} survived SIGKILL: {[p.pid for p in alive]}")
        # A graceful stop unlinks the stubs' regions; after a crash or SIGKILL they would stay.
        for region in Path(SHM_DIR).glob(f"{self.shm_region_prefix}*"):
            region.unlink(missing_ok=True)
        with contextlib.suppress(OSError, ValueError):
            if json.loads(self.run_file.read_text(encoding="utf-8")).get("pid") == proc.pid:
                self.run_file.unlink()

    def restart(self, timeout: float = 60) -> None:
        self.stop()
        self.start(timeout)

    def _children(self) -> list[psutil.Process]:
        if not self.is_running():
            return []
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def processes(self) -> TritonProcesses:
        """Its processes (the server and its python-backend stubs), as the lifecycle sees them."""
        return TritonProcesses(server_pid=lambda: self.pid if self.is_running() else None)

    def process_tree_rss(self) -> int:
        """Resident memory in bytes of tritonserver and all its children (the stubs); 0 when stopped."""
        return self.processes().tree_rss()

    def stub_pids(self, model_name: str | None = None) -> list[int]:
        """Pids of the python-backend stubs, all or those of one model (one stub per instance)."""
        return [stub.pid for stub in self.processes().stubs(model_name)]

    def __enter__(self) -> EmbeddedTriton:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _is_live(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _stubs_under(work_dir: Path) -> list[psutil.Process]:
    """Python-backend stub processes started from ``<work_dir>/backends``."""
    prefix = str(Path(work_dir) / "backends") + os.sep
    found = []
    for p in psutil.process_iter(["cmdline"]):
        argv = p.info.get("cmdline") or []
        if argv and argv[0].startswith(prefix) and argv[0].endswith(STUB_NAME):
            found.append(p)
    return found
