"""`snoozectl serve`: wire Triton, the lifecycle manager, the activator, Envoy and the control API
together, start them in dependency order and stop them in reverse.

Shutdown: the first SIGINT/SIGTERM lets live sequences end while the gateway still admits (a stateful
model's state would be lost), then stops admitting new requests at the gateway, lets in-flight ones
finish (both bounded by one ``shutdown_grace_secs``), then stops Envoy, the control API, the activator,
the lifecycle manager and Triton; a second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from rich.console import Console

from controlplane.child_processes import kill_group
from controlplane.errors import SnoozeError
from controlplane.metrics import SnoozeMetrics
from controlplane.modes import AuthMode
from controlplane.publishing import Publishing, publish_all
from controlplane.render import TritonTarget, embedded_target, target_by_name
from controlplane.servers import EmbeddedUvicorn, wait_started
from controlplane.settings import Settings
from controlplane.spec import DeploymentSpec, discover, entry_point_deployments
from controlplane.store import ModelStore
from controlplane.triton.client import TritonAdminClient, wait_for_triton
from controlplane.triton.embedded_dist import detect_backends
from controlplane.triton.journal import JOURNAL_ENV
from controlplane.triton.launcher import EmbeddedTriton, doze_admit_bound
from controlplane.triton.processes import TritonProcesses

if TYPE_CHECKING:  # start() imports them where it builds them; here only for the annotations
    from controlplane.gateway.activator import Activator
    from controlplane.gateway.envoy import EnvoyGateway
    from controlplane.lifecycle.manager import LifecycleManager

log = logging.getLogger("snoozeml.stack")


class ServingStack:
    def __init__(self, settings: Settings, models_dir: Path | None = None, *, console: Console | None = None) -> None:
        self.settings = settings
        self.models_dir = models_dir
        self.console = console or Console(stderr=True)
        self.metrics = SnoozeMetrics()
        self.triton_process: EmbeddedTriton | None = None
        self.store: ModelStore | None = None
        self.admin: TritonAdminClient | None = None
        self.lifecycle: LifecycleManager | None = None
        self.activator: Activator | None = None
        self.gateway: EnvoyGateway | None = None
        self._api: EmbeddedUvicorn | None = None
        self._api_task: asyncio.Task[None] | None = None
        self._force = asyncio.Event()
        self.publishing = Publishing()
        self._publisher: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        from controlplane.api.app import create_app
        from controlplane.api.services import ControlPlaneServices
        from controlplane.gateway.activator import Activator
        from controlplane.gateway.bls_wake import wake_socket_path
        from controlplane.lifecycle.manager import LifecycleManager

        s = self.settings
        s.work_dir.mkdir(parents=True, exist_ok=True)
        s.repository.mkdir(parents=True, exist_ok=True)
        # The store's catalog and the packages are read while Triton starts (10,000 models: 1-1.7 s and 0.4-0.5 s,
        # measured, which a restart paid after Triton's start before anything was live).
        reading = asyncio.create_task(asyncio.to_thread(self._read_models))
        try:
            http_url, grpc_url, metrics_url, target = await self._start_triton()
        except BaseException:
            with contextlib.suppress(BaseException):
                await reading  # a thread is not cancelled: it ends first (seconds at most)
            raise
        self.store, planned = await reading
        self.store.target = target  # what Triton serves, known once it started: publishing renders for it
        # Packages from the models folder and from installed distributions' `snoozeml.models` entry points: planned
        # now, published in the background once the gateway and the API are live (``_publish``).
        self.publishing.plan(planned)
        self.admin = TritonAdminClient(http_url, metrics_url, headers=s.triton_headers())
        processes, journal_dir = await self._observe_triton(http_url)
        self.lifecycle = LifecycleManager(
            s,
            self.store,
            self.admin,
            triton_process=self.triton_process,
            processes=processes,
            journal_dir=journal_dir,
            metrics=self.metrics,
        )
        await self.lifecycle.start()
        self.activator = Activator(
            self.lifecycle,
            self.store,
            s,
            triton_http_url=http_url,
            triton_grpc_url=grpc_url,
            wake_socket=wake_socket_path(journal_dir) if journal_dir is not None else None,
            publishing=self.publishing,
        )
        await self.activator.start()
        if s.gateway:
            await self._start_gateway(http_url, grpc_url)
        services = ControlPlaneServices(
            store=self.store,
            lifecycle=self.lifecycle,
            metrics=self.metrics,
            settings=s,
            triton=self.admin,
            publishing=self.publishing,
        )
        app = create_app(s, services)
        self._api = EmbeddedUvicorn(
            uvicorn.Config(app, host=s.host, port=s.api_port, log_level="warning", access_log=False, lifespan="off")
        )
        self._api_task = asyncio.create_task(self._api.serve())
        await wait_started(
            self._api,
            self._api_task,
            f"the control API could not listen on {s.host}:{s.api_port}",
            hint="free the port or pass --api-port",
        )
        if self.publishing.total:
            self._publisher = asyncio.create_task(self._publish(), name="snooze-publish")

    def _read_models(self) -> tuple[ModelStore, list[DeploymentSpec]]:
        """The store (its target is set once Triton has started) and the packages to publish (blocking)."""
        store = ModelStore(self.settings.repository, embedded_target())
        found = discover(self.models_dir) if self.models_dir is not None else []
        return store, [*found, *entry_point_deployments()]

    async def published(self, timeout: float | None = None) -> None:
        """Return once the ``--models`` packages of this start are published (they are, in the background, after
        the gateway and the API are live); ``timeout``: at most that many seconds (``TimeoutError``)."""
        if self._publisher is not None:
            await asyncio.wait_for(asyncio.shield(self._publisher), timeout)

    async def _start_triton(self) -> tuple[str, str, str | None, TritonTarget]:
        s = self.settings
        if s.triton_url:
            if not s.triton_grpc_url:
                raise SnoozeError(
                    "an external Triton needs both URLs", hint="pass --triton-grpc-url HOST:PORT with --triton-url"
                )
            await wait_for_triton(s.triton_url, s.triton_headers(), s.triton_wait_secs)
            return s.triton_url, s.triton_grpc_url, s.triton_metrics_url, target_by_name(s.target)
        admin_key = s.triton_admin_key.get_secret_value() if s.triton_admin_key else None
        self.triton_process = EmbeddedTriton(
            s.repository,
            s.work_dir / "triton",
            http_port=s.triton_http_port or None,
            grpc_port=s.triton_grpc_port or None,
            metrics_port=s.triton_metrics_port or None,
            journal_dir=s.journal_dir,
            admin_header=s.triton_admin_header,
            admin_key=admin_key,
            exit_timeout_secs=s.triton_exit_timeout_secs,
            bls_wake_timeout_secs=s.bls_wake_timeout_secs,
            doze_admit_timeout_secs=doze_admit_bound(s.wake_queue_timeout_secs),
        )
        s.repository.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        await asyncio.to_thread(self.triton_process.start)
        backends = detect_backends(s.work_dir / "triton" / "backends")
        self.console.print(
            f"tritonserver {self.triton_process.http_url} ready in {time.perf_counter() - started:.1f} s "
            f"(backends: {', '.join(sorted(backends))}; log {self.triton_process.log_file})",
            highlight=False,
        )
        p = self.triton_process
        return p.http_url, p.grpc_url, p.metrics_url, embedded_target(backends)

    async def _observe_triton(self, http_url: str) -> tuple[TritonProcesses, Path | None]:
        """How this control plane sees Triton's processes, and where their request journals are; said
        at start, since memory figures, crash recovery and hang cleanup depend on it."""
        s = self.settings
        if self.triton_process is not None:
            return self.triton_process.processes(), self.triton_process.journal_dir
        processes = TritonProcesses(http_url=http_url)
        server = await asyncio.to_thread(processes.server) if s.observe_triton_processes else None
        if server is None:
            why = (
                f"no tritonserver listening on the port of {http_url} in this PID namespace"
                if s.observe_triton_processes
                else "SNOOZE_OBSERVE_TRITON_PROCESSES=false"
            )
            self.console.print(
                f"[yellow]Triton's processes are not visible from here ({why}): model memory is shown as declared "
                "(memory_mb) or unknown, a crashed model process is found only through failed requests (which are "
                "not retried), and a hanging load keeps running in Triton.[/] To see them, run the control plane in "
                "Triton's PID namespace as the same user (docs/deploy.md).",
                highlight=False,
            )
            return TritonProcesses.unseen(), None
        found = s.journal_dir or (
            Path(value) if (value := await asyncio.to_thread(processes.environment, JOURNAL_ENV)) else None
        )
        if found is not None and not found.is_dir():
            # A fresh shared volume (compose's tmpfs at /run/snooze, an emptyDir) has no journal folder yet:
            # the stubs only write into it. Same uid as Triton's processes, so make it for both.
            with contextlib.suppress(OSError):
                found.mkdir(mode=0o700, parents=True, exist_ok=True)
        journal_dir = found if found is not None and found.is_dir() else None
        self.console.print(
            f"Triton's processes are visible (tritonserver pid {server.pid}): memory measured, crashed model "
            f"processes recovered, hanging loads killed; request journal: "
            + (
                str(journal_dir)
                if journal_dir
                else f"[yellow]none[/] ({JOURNAL_ENV} of Triton not reachable here: "
                "a request that meets a dead model process is not retried)"
            ),
            highlight=False,
        )
        return processes, journal_dir

    async def _publish(self) -> None:
        """Publish the planned packages in a worker thread while everything else serves; say the progress."""
        assert self.store is not None
        loop = asyncio.get_running_loop()
        lifecycle = self.lifecycle

        def say(line: str) -> None:
            loop.call_soon_threadsafe(lambda: self.console.print(line, highlight=False))

        def republished(model_id: str) -> None:
            if lifecycle is not None:
                asyncio.run_coroutine_threadsafe(lifecycle.published(model_id), loop)

        work = asyncio.create_task(
            asyncio.to_thread(
                publish_all,
                self.store,
                self.publishing,
                say=say,
                on_published=republished,
                helper_from=self.settings.publish_helper_from or sys.maxsize,
            )
        )
        while not work.done():
            await asyncio.wait({work}, timeout=PROGRESS_SECS)
            if not work.done():
                self.console.print(_progress_line(self.publishing.describe()), highlight=False)
        await work
        self.console.print(_progress_line(self.publishing.describe()), highlight=False)

    async def _start_gateway(self, http_url: str, grpc_url: str) -> None:
        from controlplane.gateway.envoy import EnvoyGateway

        assert self.activator is not None
        self.gateway = EnvoyGateway(
            self.settings,
            triton_http=http_url,
            triton_grpc=grpc_url,
            activator_http=self.activator.http_address,
            activator_grpc=self.activator.grpc_address,
        )
        await asyncio.to_thread(self.gateway.start)

    # ------------------------------------------------------------------ stop

    async def stop(self) -> None:
        """Stop admitting, drain (bounded), then stop every piece in reverse order. A step that fails is logged
        and the next ones still run (tritonserver and Envoy must not outlive the stack); the first failure is
        raised at the end."""
        s = self.settings
        failures: list[BaseException] = []

        async def step(what: str, action: Callable[[], Awaitable[object]]) -> None:
            try:
                await action()
            except Exception as e:  # every later piece still stops
                log.exception("stopping the %s failed", what)
                failures.append(e)

        async def api() -> None:
            assert self._api is not None and self._api_task is not None
            self._api.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._api_task, timeout=5)

        deadline = time.monotonic() + s.shutdown_grace_secs
        await step("publishing", self._stop_publishing)
        cancel_loads = getattr(self.lifecycle, "cancel_loads", None)
        if cancel_loads is not None:  # a stop never waits for a load (it may hang): cancelled, its waiters told
            await step("loads in flight", lambda: cancel_loads("stopping"))
        if self.lifecycle is not None:  # first, while the gateway still admits: their next requests must get in
            await step("live sequences", lambda: self._wait_sequences(s.shutdown_grace_secs))
        if self.gateway is not None:
            gateway = self.gateway
            await step("gateway", lambda: self._drain_gateway(max(deadline - time.monotonic(), 0.0)))
            await step("gateway", lambda: asyncio.to_thread(gateway.stop))
        if self._api is not None and self._api_task is not None:
            await step("control API", api)
        if self.activator is not None:
            await step("activator", self.activator.stop)
        if self.lifecycle is not None:
            await step("lifecycle", self.lifecycle.stop)
        if self.admin is not None:
            await step("Triton client", self.admin.aclose)
        if self.triton_process is not None:
            triton = self.triton_process
            await step("tritonserver", lambda: asyncio.to_thread(triton.stop))
        if failures:
            raise failures[0]

    async def _stop_publishing(self) -> None:
        """The package being written finishes, the rest wait for the next start; the store's catalog is kept for it
        (it reads no unchanged record again)."""
        if self._publisher is not None:
            self.publishing.stop()
            await asyncio.wait_for(asyncio.shield(self._publisher), PUBLISH_STOP_SECS)
        if self.store is not None:
            await asyncio.to_thread(self.store.save_catalog)

    async def _wait_sequences(self, grace: float) -> None:
        """Let live sequences end (their END, or Triton's idle bound), at most ``grace`` seconds or until a second
        Ctrl-C; those still live are ended by the stop, which says so."""
        wait_for = getattr(self.lifecycle, "wait_for_sequences", None)
        if wait_for is None or self._force.is_set():
            return
        wait = asyncio.create_task(wait_for(grace))
        force = asyncio.create_task(self._force.wait())
        await asyncio.wait({wait, force}, return_when=asyncio.FIRST_COMPLETED)
        force.cancel()
        if not wait.done():
            wait.cancel()
            return
        left = wait.result()
        if left:
            from controlplane.lifecycle.sequences import describe_live

            log.warning(
                "stopping ends %s: they did not end within shutdown_grace_secs (%gs); a client's next request of "
                "such a sequence gets Triton's error (end sequences before stopping, or raise "
                "SNOOZE_SHUTDOWN_GRACE_SECS)",
                describe_live(left),
                grace,
            )

    async def _drain_gateway(self, grace: float) -> None:
        drain = getattr(self.gateway, "drain", None)
        if drain is None:
            return
        wait = asyncio.create_task(asyncio.to_thread(drain, grace))
        force = asyncio.create_task(self._force.wait())
        await asyncio.wait({wait, force}, return_when=asyncio.FIRST_COMPLETED)
        force.cancel()

    @property
    def forced(self) -> bool:
        return self._force.is_set()

    def force(self) -> None:
        """A second Ctrl-C, or a SIGTERM during a graceful stop: skip the waits, SIGKILL tritonserver's and
        Envoy's process groups now (stubs, preforked parents and workers are in Triton's), and end this
        process within FORCE_EXIT_SECS whatever the rest of the stop is doing."""
        if self._force.is_set():
            return
        self._force.set()
        for server in (self.triton_process, self.gateway):
            pid = getattr(server, "pid", None)
            if pid:
                kill_group(pid)
        timer = threading.Timer(FORCE_EXIT_SECS, _exit_forced)
        timer.daemon = True
        timer.start()

    # ------------------------------------------------------------------ report

    def banner(self) -> str:
        s = self.settings
        lines = []
        if self.gateway is not None:
            lines.append(f"KServe v2 gateway: http://{s.host}:{s.http_port} (HTTP)  {s.host}:{s.grpc_port} (gRPC)")
        elif self.triton_process is not None:
            lines.append(
                f"no gateway: clients use Triton at {self.triton_process.http_url} / {self.triton_process.grpc_url}"
            )
        lines.append(f"control API: http://{s.host}:{s.api_port}  (docs at /docs)")
        if self.store is not None:
            ids = self.store.ids()
            shown = ", ".join(ids[:BANNER_MODELS]) + (
                f" and {len(ids) - BANNER_MODELS} more" if len(ids) > BANNER_MODELS else ""
            )
            lines.append(f"models: {shown or '(none yet: snoozectl publish PATH)'}")
            if self.publishing.in_progress:
                lines.append(_progress_line(self.publishing.describe()) + " (`snoozectl status` shows it too)")
        return "\n".join(lines)


BANNER_MODELS = 20  # the banner names this many models; `snoozectl status` lists them all
PUBLISH_STOP_SECS = 30.0  # a stop waits this long for the package being written
PROGRESS_SECS = 2.0  # how often the console says how far publishing is


def _progress_line(p: dict[str, Any]) -> str:
    state = "publishing" if p["in_progress"] else "published"
    failed = f", {len(p['failed'])} failed" if p["failed"] else ""
    return (
        f"{state}: {p['done']}/{p['total']} packages ({p['published']} written, {p['unchanged']} unchanged and "
        f"adopted{failed}) in {p['elapsed_secs']:.1f}s"
    )


# After a forced stop, how long the remaining steps get before the process exits regardless.
FORCE_EXIT_SECS = 1.5


def _exit_forced() -> None:
    print("stopped: forced (a second Ctrl-C or SIGTERM); tritonserver and Envoy were killed", flush=True)
    os._exit(130)


@contextlib.contextmanager
def stop_signals(on_first: Callable[[], None], on_again: Callable[[], None]) -> Iterator[asyncio.Event]:
    """While the block runs, the first SIGINT/SIGTERM calls ``on_first`` and sets the yielded event;
    any later one calls ``on_again`` (skip the graceful wait)."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    def on_signal() -> None:
        if stopping.is_set():
            on_again()
        else:
            on_first()
            stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        yield stopping
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def serve_until_signal(stack: ServingStack) -> int:
    def say_stopping() -> None:
        stack.console.print("stopping: draining in-flight requests (Ctrl-C again to force)")

    with stop_signals(say_stopping, stack.force) as stopping:
        started = time.monotonic()
        try:
            await stack.start()
            stack.console.print(stack.banner(), highlight=False)
            await stopping.wait()
            started = time.monotonic()
        finally:
            await stack.stop()
    # the last line of the log: every process of the stack has exited (a crash would not print it)
    stack.console.print(f"stopped: gateway, control plane and Triton exited ({time.monotonic() - started:.1f}s)")
    if stack.forced:  # no wait for worker threads still in a drain: the servers are gone already
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    return 0


def run_stack(settings: Settings, models_dir: Path | None) -> int:
    console = prepare_process(settings)
    return asyncio.run(serve_until_signal(ServingStack(settings, models_dir, console=console)))


def prepare_process(settings: Settings) -> Console:
    """Logging, and the auth warning or refusal, for a process that runs a ServingStack."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Every admin poll of Triton is an httpx request: only worth seeing when debugging.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if settings.log_level == "debug" else logging.WARNING)
    console = Console(stderr=True)
    if settings.auth == AuthMode.OFF:
        console.print(
            "[bold yellow]WARNING: API keys are OFF: anyone who can reach these ports can infer, publish and "
            "delete models. Use this only on a trusted machine (set SNOOZE_API_KEYS / SNOOZE_ADMIN_KEYS).[/]"
        )
    elif not settings.api_keys and not settings.admin_keys:
        raise SnoozeError(
            "auth is on but no API keys are configured",
            hint="set SNOOZE_ADMIN_KEYS='[\"<key>\"]' (and SNOOZE_API_KEYS for inference-only keys), "
            "or pass --no-auth for local use",
        )
    return console
