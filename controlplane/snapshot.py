"""The checkpoint/restore workload contract: `snoozectl snapshot-entrypoint`.

A snapshot agent checkpoints a warmed-up container (tritonserver with its models loaded, the control
plane, Envoy) and restores it later instead of cold-starting. The workload and the agent talk through
files in ``$SNAPSHOT_CONTROL_DIR``:

| file | written by | means |
| --- | --- | --- |
| ``ready-for-snapshot`` | workload | models loaded and warmed, nothing in flight: checkpoint now |
| ``snapshot-fingerprint.json`` | workload | the configuration the snapshot was taken with |
| ``restore-complete`` | agent | the process runs again (restored, or resumed after the checkpoint) |
| ``triton-restore-ready`` | workload | the restored process passed its checks and serves (readiness gate) |
| ``restore-failed`` | workload | why the restored process refused to serve (no ``triton-restore-ready``) |

Every file is written atomically (temporary file + rename). At start the workload removes the files
it owns (``ready-for-snapshot``, ``triton-restore-ready``, ``restore-failed``) left by an earlier run
of the container, before it starts anything; ``restore-complete`` belongs to the agent and is left
alone.

Capture: start the stack, load the models, one real inference each, then quiesce: let live sequences end
(the gate still open; still live after ``--quiesce-timeout``: no capture, an error naming them), close the gateway's
snapshot gate (every request on every connection, also one opened before, is answered 503 / gRPC
UNAVAILABLE by Envoy and reaches neither Triton nor the activator), drain Envoy's listeners (no new
connection) and wait until it has no request in flight, pause the lifecycle (no sweep: no idle
unload, autoscaling or dead-stub recovery; wake-ups and recoveries wait) once its running transitions
are done, and wait until Triton's pending count is zero for every model and no model is loading or
unloading. Write the fingerprint, then ``ready-for-snapshot``. The process then waits for
``restore-complete`` with nothing running in it: the checkpoint freezes it in that wait, the restored
image wakes up in it.

Restore (``restore-complete`` seen): compute the fingerprint again and refuse to serve if it differs
(naming the part that differs; the lifecycle stays paused and the gate closed), resume the lifecycle,
restart Envoy (a drained Envoy cannot admit again; the fresh one starts with the gate open), check
Triton live/ready and the control API, run one inference per ready model through the gateway, then
write ``triton-restore-ready``.

Standby (``SNAPSHOT_RESTORE_STANDBY=1``, the restore placeholder): in a restore pod the agent restores
the captured process beside this one, as a sibling process in the same container. The placeholder
stays inert for its whole life: it starts nothing (no Triton, no Envoy, no port, no work-dir write),
logs when ``restore-complete`` appears (the restored sibling serves and writes
``triton-restore-ready``), and sleeps until SIGTERM/SIGINT, then exits 0. It does not exit by itself,
because it may be the container's main process, whose exit would end the restored sibling too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from controlplane.errors import SnoozeError
from controlplane.lifecycle.sequences import describe_live
from controlplane.lifecycle.state import ModelState
from controlplane.modes import AuthMode
from controlplane.render import parse_config
from controlplane.settings import Settings
from controlplane.snapshot_fingerprint import compute_fingerprint, fingerprint_differences
from controlplane.stack import ServingStack, stop_signals
from controlplane.store import PublishedModel
from controlplane.validation.live import warmup_infer

log = logging.getLogger("snoozeml.snapshot")

CONTROL_DIR_ENV = "SNAPSHOT_CONTROL_DIR"
STANDBY_ENV = "SNAPSHOT_RESTORE_STANDBY"
READY_FOR_SNAPSHOT = "ready-for-snapshot"
RESTORE_COMPLETE = "restore-complete"
TRITON_RESTORE_READY = "triton-restore-ready"
RESTORE_FAILED = "restore-failed"
FINGERPRINT_FILE = "snapshot-fingerprint.json"
OWNED_FILES = (READY_FOR_SNAPSHOT, TRITON_RESTORE_READY, RESTORE_FAILED)
POLL_SECS = 0.2


class SnapshotError(SnoozeError):
    code = "snapshot_failed"


# ---------------------------------------------------------------------------------------------
# Environment and the control folder


def control_dir_from_env(environ: Mapping[str, str] = os.environ) -> Path:
    """``$SNAPSHOT_CONTROL_DIR``, created if needed and checked writable."""
    value = environ.get(CONTROL_DIR_ENV, "").strip()
    if not value:
        raise SnapshotError(
            f"{CONTROL_DIR_ENV} is not set: the snapshot entrypoint exchanges its sentinel files there",
            hint=f"set {CONTROL_DIR_ENV} to the snapshot-control volume's mount path "
            "(deploy/k8s/snapshot mounts it at /snapshot-control)",
        )
    path = Path(value)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as exc:
        raise SnapshotError(
            f"{CONTROL_DIR_ENV}={value} is not a writable folder ({exc.strerror or exc})",
            hint=f"mount a writable volume (an emptyDir) there, or point {CONTROL_DIR_ENV} at a folder this "
            f"user (uid {os.getuid()}) can write",
        ) from exc
    return path


def standby_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    value = environ.get(STANDBY_ENV, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise SnapshotError(
        f"{STANDBY_ENV}={environ[STANDBY_ENV]!r} is neither on nor off",
        hint=f"set {STANDBY_ENV}=1 in a restore placeholder, or leave it unset (or 0)",
    )


class ControlDir:
    """The sentinel files in ``$SNAPSHOT_CONTROL_DIR``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def clear_stale(self) -> list[str]:
        """Remove the files this workload writes, left by an earlier run; returns the names removed."""
        removed = []
        for name in OWNED_FILES:
            with contextlib.suppress(FileNotFoundError):
                (self.path / name).unlink()
                removed.append(name)
        return removed

    def exists(self, name: str) -> bool:
        return (self.path / name).exists()

    def write(self, name: str, text: str) -> Path:
        """Write ``name`` atomically: a temporary file in the same folder, fsync, rename."""
        target = self.path / name
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=f".{name}.")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return target

    def write_json(self, name: str, data: Mapping[str, Any]) -> Path:
        return self.write(name, json.dumps(data, indent=2, sort_keys=True) + "\n")

    def read_json(self, name: str) -> dict[str, Any] | None:
        path = self.path / name
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise SnapshotError(
                f"{path} is not valid JSON ({exc})", hint="remove it; the capture writes it again"
            ) from exc

    async def wait_for(self, name: str) -> None:
        while not self.exists(name):
            await asyncio.sleep(POLL_SECS)


# ---------------------------------------------------------------------------------------------
# The state machine


class SnapshotEntrypoint:
    """Capture, standby and restore around one ``ServingStack``.

    ``make_settings`` builds the Settings from the environment and the command's flags; it runs at
    start and again after restore, so the fingerprint sees the environment the process has then.
    """

    def __init__(
        self,
        control: ControlDir,
        make_settings: Callable[[], Settings],
        models_dir: Path | None,
        models_to_load: list[str] | None = None,
        *,
        quiesce_timeout: float = 60.0,
        console: Console | None = None,
    ) -> None:
        self.control = control
        self.make_settings = make_settings
        self.models_dir = models_dir
        self.models_to_load = models_to_load or None
        self.quiesce_timeout = quiesce_timeout
        self.console = console or Console(stderr=True)
        self.stack: ServingStack | None = None

    def say(self, message: str) -> None:
        self.console.print(f"snapshot: {message}", highlight=False, markup=False)

    def _clear_stale(self) -> None:
        removed = self.control.clear_stale()
        if removed:
            self.say(f"removed stale {', '.join(removed)} from {self.control.path}")

    async def run(self) -> bool:
        """Capture, then run until the workload serves after a restore (True) or refused to (False)."""
        self._clear_stale()
        await self._start_and_warm(self.make_settings())
        await self._quiesce()
        captured = self._fingerprint(self.stack.settings)  # type: ignore[union-attr]
        self.control.write_json(FINGERPRINT_FILE, captured)
        self.control.write(READY_FOR_SNAPSHOT, f"{time.time():.3f}\n")
        self.say(f"wrote {READY_FOR_SNAPSHOT} (fingerprint {captured['digest'][:12]}); now waiting")
        await self.control.wait_for(RESTORE_COMPLETE)
        self.say(f"{RESTORE_COMPLETE} seen: resuming")
        return await self._resume(captured)

    async def stand_by(self) -> None:
        """The restore placeholder: never starts anything; returns only when cancelled (on a signal)."""
        self._clear_stale()
        self.say(f"{STANDBY_ENV}=1: restore placeholder; it starts nothing, the agent restores the captured process")
        await self.control.wait_for(RESTORE_COMPLETE)
        self.say(f"{RESTORE_COMPLETE} seen: the restored process serves beside this one; staying inert until SIGTERM")
        await asyncio.Event().wait()

    async def stop(self) -> None:
        if self.stack is not None:
            await self.stack.stop()

    # ------------------------------------------------------------------ capture

    async def _start_and_warm(self, settings: Settings) -> None:
        if settings.triton_url:
            raise SnapshotError(
                f"the snapshot entrypoint runs the embedded tritonserver, but SNOOZE_TRITON_URL={settings.triton_url}",
                hint="unset SNOOZE_TRITON_URL / SNOOZE_TRITON_GRPC_URL: a snapshot must hold Triton's loaded models",
            )
        if not settings.gateway:
            raise SnapshotError(
                "the snapshot entrypoint needs the gateway (SNOOZE_GATEWAY is off): it stops admitting requests there",
                hint="unset SNOOZE_GATEWAY",
            )
        self.stack = ServingStack(settings, self.models_dir, console=self.console)
        await self.stack.start()
        await self.stack.published()  # a snapshot holds every model: all of them published first
        store, lifecycle = self.stack.store, self.stack.lifecycle
        assert store is not None and lifecycle is not None and self.stack.triton_process is not None
        published = store.ids()
        wanted = self.models_to_load or published
        unknown = sorted(set(wanted) - set(published))
        if unknown:
            raise SnapshotError(
                f"--models-to-load names models that are not published: {', '.join(unknown)}",
                hint=f"published: {', '.join(published) or '(none)'}; check --models and the ids in models.toml",
            )
        if not wanted:
            self.say("no model is published: the snapshot holds an empty Triton")
        for model_id in wanted:
            started = time.perf_counter()
            status = await lifecycle.load(model_id)
            if status.state is not ModelState.READY:
                raise SnapshotError(
                    f"model '{model_id}' did not load: {status.reason or status.state.value}",
                    hint=f"fix the model, or leave it out with --models-to-load; Triton's log: "
                    f"{self.stack.triton_process.log_file}",
                )
            model = store.get(model_id)
            if not parse_config(model.config_text, where=str(model.path / "config.pbtxt")).model_warmup:
                # A config with model_warmup ran its inference inside the load; others get one here.
                await self._infer(model, self.stack.triton_process.http_url, {}, "warm-up")
            self.say(f"{model_id}: loaded and warmed up in {time.perf_counter() - started:.2f}s")

    async def _infer(self, model: PublishedModel, url: str, headers: dict[str, str], what: str) -> None:
        config = parse_config(model.config_text, where=f"{model.path / 'config.pbtxt'}")
        try:
            await asyncio.to_thread(warmup_infer, url, config, headers, model.request_timeout_secs)
        except Exception as exc:  # tritonclient raises InferenceServerException and transport errors
            raise SnapshotError(
                f"model '{model.id}': the {what} inference via {url} failed: {exc}",
                hint="run `snoozectl check` on the package; read Triton's log",
            ) from exc

    async def _quiesce(self) -> None:
        """Close the gate, drain the gateway, pause the lifecycle; wait until nothing is in flight anywhere."""
        stack = self.stack
        assert stack is not None and stack.gateway is not None and stack.admin is not None
        assert stack.lifecycle is not None
        deadline = time.monotonic() + self.quiesce_timeout
        # Live sequences first, while the gate is open (their next requests must get in): a snapshot would
        # capture their state mid-sequence, for clients that lose it.
        left = await stack.lifecycle.wait_for_sequences(self.quiesce_timeout)
        if left:
            raise SnapshotError(
                f"{describe_live(left)} did not end within --quiesce-timeout ({self.quiesce_timeout:g}s): a snapshot "
                "would capture them mid-sequence",
                hint="end the sequences (sequence_end) before the capture, or raise --quiesce-timeout",
            )
        # Gate first: requests already past it (a wake-up at the activator included) finish with the
        # lifecycle still running; none can follow, not even over a connection opened before the drain.
        await asyncio.to_thread(stack.gateway.close_gate)
        await asyncio.to_thread(stack.gateway.drain, self.quiesce_timeout)
        try:
            await asyncio.wait_for(stack.lifecycle.pause(), max(deadline - time.monotonic(), 0))
        except TimeoutError:
            moving = [s.id for s in stack.lifecycle.statuses() if s.state in (ModelState.LOADING, ModelState.UNLOADING)]
            raise SnapshotError(
                f"the model lifecycle did not settle within {self.quiesce_timeout:.0f}s "
                f"(loading/unloading: {', '.join(moving) or 'none'})",
                hint="raise --quiesce-timeout, or fix the model whose load or unload hangs (load_timeout_secs)",
            ) from None
        while True:
            active = await asyncio.to_thread(stack.gateway.active_requests)
            pending = {m: n for m, n in (await stack.admin.pending_request_counts()).items() if n > 0}
            moving = [s.id for s in stack.lifecycle.statuses() if s.state in (ModelState.LOADING, ModelState.UNLOADING)]
            if not active and not pending and not moving:
                self.say("gateway gated and drained, lifecycle paused; no request in flight at Envoy or Triton")
                return
            if time.monotonic() >= deadline:
                raise SnapshotError(
                    f"still busy {self.quiesce_timeout:.0f}s after the gateway stopped admitting: "
                    f"{active} request(s) in flight at Envoy, Triton pending {pending or 'none'}, "
                    f"models loading/unloading: {', '.join(moving) or 'none'}",
                    hint="raise --quiesce-timeout, or find the request that never ends (request_timeout_secs)",
                )
            await asyncio.sleep(0.05)

    def _fingerprint(self, settings: Settings) -> dict[str, Any]:
        assert self.stack is not None
        return compute_fingerprint(settings, self.stack, self.models_dir, self.models_to_load)

    # ------------------------------------------------------------------ restore

    async def _resume(self, captured: dict[str, Any]) -> bool:
        try:
            await self._restore_checks(captured)
        except SnoozeError as exc:
            reason = str(exc)
            self.control.write(RESTORE_FAILED, reason + "\n")
            log.error("restore refused: %s", reason)
            self.say(f"NOT serving: {reason} (wrote {RESTORE_FAILED}, not {TRITON_RESTORE_READY})")
            return False
        return True

    async def _restore_checks(self, captured: dict[str, Any]) -> None:
        stack = self.stack
        assert stack is not None and stack.admin is not None and stack.lifecycle is not None
        assert stack.store is not None and stack.gateway is not None
        settings = self.make_settings()
        current = self._fingerprint(settings)
        differences = fingerprint_differences(captured, current)
        if differences:
            raise SnapshotError(
                "the configuration differs from the one the snapshot was taken with: " + "; ".join(differences),
                hint="restore with the capture's configuration, or take a new snapshot with this one",
            )
        stack.lifecycle.resume()
        # The capture drained Envoy, which cannot admit again: a fresh one on the same ports can, gate open.
        await asyncio.to_thread(stack.gateway.stop)
        await asyncio.to_thread(stack.gateway.start)
        if not await stack.admin.live() or not await stack.admin.ready():
            raise SnapshotError(
                f"Triton at {stack.admin.http_url} is not live and ready after the restore",
                hint=f"read Triton's log ({stack.triton_process.log_file if stack.triton_process else 'n/a'})",
            )
        connect = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
        api = f"http://{connect}:{settings.api_port}/health/ready"
        try:
            async with httpx.AsyncClient(timeout=5) as http:
                answer = await http.get(api)
        except httpx.TransportError as exc:
            raise SnapshotError(f"the control API does not answer at {api}: {exc}") from exc
        if answer.status_code != 200:
            raise SnapshotError(f"the control API at {api} answered HTTP {answer.status_code}: {answer.text[:200]}")
        gateway_url = f"http://{connect}:{settings.http_port}"
        headers = _client_headers(settings)
        checked = []
        for status in stack.lifecycle.statuses():
            if status.state is ModelState.READY:
                await self._infer(stack.store.get(status.id), gateway_url, headers, "post-restore")
                checked.append(status.id)
        self.control.write_json(
            TRITON_RESTORE_READY, {"time": time.time(), "fingerprint": current["digest"], "models_checked": checked}
        )
        self.say(f"wrote {TRITON_RESTORE_READY}: Triton ready, API listening, inference OK for {checked or 'no model'}")


def _client_headers(settings: Settings) -> dict[str, str]:
    """The key the gateway wants for inference (none when auth is off)."""
    if settings.auth == AuthMode.OFF:
        return {}
    keys = settings.api_keys or settings.admin_keys
    return {"X-API-Key": keys[0].get_secret_value()} if keys else {}


async def serve_snapshot(entry: SnapshotEntrypoint, standby: bool) -> int:
    """Run the state machine (or stand by), then serve until SIGINT/SIGTERM. 0 = served (or stood by) and
    stopped on a signal, 1 = the restore checks refused to serve."""

    def force() -> None:
        if entry.stack is not None:
            entry.stack.force()

    with stop_signals(lambda: entry.say("stopping"), force) as stopping:
        work = asyncio.create_task(entry.stand_by() if standby else entry.run())
        halt = asyncio.create_task(stopping.wait())
        try:
            await asyncio.wait({work, halt}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                return 0
            if not work.result():
                return 1
            if entry.stack is not None:
                entry.console.print(entry.stack.banner(), highlight=False)
            await halt
            return 0
        finally:
            halt.cancel()
            await entry.stop()
