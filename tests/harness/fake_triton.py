"""An in-process stand-in for tritonserver 2.51 and its python-backend stubs, for the lifecycle's logic tier.

It stands in for Triton only in this tier (``tests/model``): the real-Triton tests (``tests/integration``,
``tests/reliability``) stay the judges of what Triton does. It answers the calls ``LifecycleManager`` makes
(``TritonAdminClient``: ``repository_index``, ``load``, ``unload``, ``model_config``, ``model_stats``,
``pending_request_counts``, ``metrics_url``), the inference call the activator forwards (``infer``), and the
process observer's questions (``FakeProcesses``, the duck type of ``TritonProcesses``).

What it models, as measured on the embedded Triton 2.51 (docs/internals.md, TRITON_NOTES.md):

- explicit model control over a real model repository folder: a load reads the published ``config.pbtxt``
  (or the override), fails when the folder is gone, and blocks until the model is loaded or failed; a load
  without an override of a loaded model whose files are unchanged changes nothing (an earlier override
  stays);
  a failed reload keeps the old model serving; a change of the instance count alone keeps the
  surviving instances (their stubs), anything else rebuilds them all; old instances (of a reload, or of a load
  right after an unload) finish the requests they run or have queued, then exit (their memory is not counted
  meanwhile);
- an unload returns at once; the model is UNLOADING until its stubs exit (a scripted delay), then
  UNAVAILABLE; requests already accepted complete on their stubs; new ones get 404 "... has no available
  versions" (a model never loaded: "... is not found");
- one stub process per instance, named by pid and start ticks; a crashed stub stays a zombie with its
  exit status (Triton does not reap or restart it) and the model stays READY; a request sent to its
  instance fails after Triton's wait with "Stub process '<instance>' is not healthy."; a stub killed under
  a running request takes the request with it (it ran: the journal holds its id);
- each stub writes the request journal the runtime writes (``<pid>-<ticks>.journal``) before running
  a batch;
- scripted load outcomes per model: ``ok``, ``oom`` (the runtime's ``[snooze:oom]`` message), ``error``,
  ``hang`` (``initialize`` never returns: the load stays LOADING until its stubs are killed, then fails);
  scripted unload hangs (a ``finalize`` that blocks longer than the client waits); scripted delays of
  loads, unloads and executions; memory per stub (its RSS) from the published deployment's ``memory_mb``
  over its instances, or a figure the test sets, and what a stub grows by when it runs its first request
  (``growth``, 0 unless set: a real stub grew 2.8 MiB); tritonserver's own RSS (``server_memory``, plus
  ``server_per_model`` for each model it holds; both 0 unless set);
- ``nv_inference_pending_request_count``: requests accepted and not yet answered, per model;
- a model serving several versions (its record's ``versions``: a Triton folder's version_policy) runs its
  instances once per version, each a stub.

What it does not model: batching (one request per execution), the HTTP/gRPC wire, requests for a version,
decoupled models and streams, preforked workers and their parents, GPU memory, tritonserver itself dying
(the embedded launcher's restart), real memory pressure (OOM comes only when scripted), strict readiness,
Triton's own statistics refresh delay, and anything about performance.

Time is the event loop's: everything here sleeps with ``asyncio.sleep``, so a virtual-time loop
(``VirtualTimeLoop``) runs it deterministically, with no threads.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import struct
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controlplane.errors import NotFoundError, TritonError, TritonModelLoadError
from controlplane.lifecycle.configs import rendered_config
from controlplane.render import DEPLOYMENT_FILE
from controlplane.triton.client import BUSY_STATES, ModelStats, RepositoryEntry
from controlplane.triton.dead_stub import is_dead_stub_message
from controlplane.triton.journal import PHASE_SUFFIX, journal_path
from controlplane.triton.journal import SIZE as JOURNAL_SIZE
from controlplane.triton.processes import StubDeath, StubProcess
from controlplane.triton.stub_control import DozeAnswer, Wake
from harness.virtual_time import EPOCH
from python_backend.doze import BUSY

MIB = 1024 * 1024
# a load call's view of the repository: the model's folder (its identity), the names of the models in it
Sent = tuple[tuple[int, int] | None, frozenset[str]]
DEAD_STUB_WAIT = 1.0  # Triton's wait before failing a request sent to a dead stub (about a second, measured)
SIGSEGV_STATUS = signal.SIGSEGV  # the wait status of a process killed by SIGSEGV
SIGKILL_STATUS = signal.SIGKILL


@dataclass
class Stub:
    pid: int
    start_ticks: int
    model: str
    instance: str
    memory: int
    alive: bool = True
    reaped: bool = False
    exit_status: int | None = None
    running: str | None = None  # the request id it executes now (handed to it by Triton)
    stopped: bool = False  # SIGSTOP: it takes up nothing until SIGCONT
    busy: bool = False  # its journal's busy flag: a batch runs in the model's code
    grown: bool = False  # it has run a request (and grown by the model's ``growth``)
    last_end: float = 0.0  # virtual seconds when its last batch ended
    files: tuple[int, int] = (0, 0)  # the model folder it was started from (``Loaded.files``): the version it serves
    queued: int = 0  # requests sent to this instance that wait for it
    awake_memory: int | None = None  # while it dozes (its worker ended): what it held awake, back at its wake
    wakes: int = 0  # batches that found it dozing and forked a worker first
    woke_at: float = -1.0  # virtual seconds of its last wake
    can_doze: bool = True  # it serves a preforked deployment: an in-stub one answers a doze that it cannot
    died: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def process(self) -> StubProcess:
        return StubProcess(self.pid, self.start_ticks, self.model, self.instance)


@dataclass
class Loaded:
    """What Triton holds for one model."""

    name: str
    state: str  # LOADING, READY, UNLOADING, UNAVAILABLE
    config: dict[str, Any] = field(default_factory=dict)
    stubs: list[Stub] = field(default_factory=list)
    starting: list[Stub] = field(default_factory=list)  # stubs of a load in progress (initialize runs)
    reason: str = ""
    files: tuple[int, int] = (0, 0)  # the folder it was last loaded from: its inode, its config.pbtxt's mtime
    last_inference_ms: int = 0
    served: int = 0  # requests answered since the model was last built (Triton's success count)
    next_instance: int = 0
    unloading: asyncio.Task[None] | None = None
    finalize_secs: float = 0.0  # how long the unload in flight blocks in its finalize

    @property
    def count(self) -> int:
        groups = self.config.get("instance_group") or [{}]
        return int(groups[0].get("count", 1))


@dataclass
class Answer:
    """Triton's answer to one inference request."""

    status: int  # 200, 404, 500
    text: str = ""
    files: tuple[int, int] | None = None  # a 200's: the model folder (version) the stub that ran it was started from

    @property
    def dead(self) -> bool:
        """Triton's whole dead-stub message, as the gateway reads it (not an ensemble's answer wrapping a step's)."""
        return self.status == 500 and is_dead_stub_message(self.text)


@dataclass
class LoadScript:
    outcome: str = "ok"  # ok, oom, error, hang
    delay: float = 0.05
    # False: the new stubs write no phase note until initialize ends (still starting, as a real stub before its
    # first message), so a cancel waits for them instead of ending them
    phase_note: bool = True


class FakeTriton:
    """Triton's repository, model control, statistics, metrics and inference over one model repository."""

    metrics_url = "fake://metrics"

    def __init__(self, repository: Path, journal_dir: Path) -> None:
        self.repository = repository
        self.journal_dir = journal_dir
        self.models: dict[str, Loaded] = {}
        self.scripts: dict[str, list[LoadScript]] = {}
        self.unload_delay = 0.02
        self.unload_hangs: dict[str, float] = {}  # model -> how long its next unload's finalize blocks
        self.declares_unload: set[str] = set()  # models whose stubs' journals say they declare unload()
        self.exec_delay = 0.01
        self.memory: dict[str, int] = {}  # model -> bytes per stub, overriding the declared figure
        self.executions: Counter[str] = Counter()  # request id -> times a model ran it
        self.pending: Counter[str] = Counter()  # model -> requests accepted and not answered
        self.loads_in_flight: Counter[str] = Counter()
        self.server_memory = 0  # tritonserver's own RSS (its model processes' apart) with no model loaded
        self.server_per_model = 0  # what it holds more for each model it holds (its side of their shared memory)
        self.growth: dict[str, int] = {}  # model -> bytes each of its stubs grows by at its first request
        self.peak = 0  # the most bytes the tree held at once: the server and the stubs (each from its start)
        self.largest = 0  # the most bytes one model's stubs held
        # While the lifecycle is paused (``unenforced``) no sweep hears a wake from doze nor enforces the budget after
        # it: what such wakes added (``woken_unenforced``) is allowed over the budget (the product pauses only with
        # its gateway gated and drained, snapshot.py: no request reaches a stub then)
        self.unenforced = False
        self.woken_unenforced = 0
        self.overlaps: list[str] = []  # a second load of a model while one runs: two transitions at once
        # (ensemble, its steps that were not loaded) at each ensemble load that met one: the world judges whether
        # the lifecycle should have loaded them first (a published step: the real Triton would load it behind it)
        self.ensemble_misses: list[tuple[str, list[str]]] = []
        self.is_published: Callable[[str], bool] = lambda name: True  # the world's store, read at the miss
        # Ensembles Triton took down with a step's unload: it brings each back when its steps are loaded again
        # (measured on 2.51: unloading a step makes its loaded ensemble UNAVAILABLE at once; loading the step again
        # makes it READY, unless the ensemble was unloaded itself in between).
        self.down_with_step: set[str] = set()
        self.retired: list[Stub] = []  # the old instances of reloads: alive until their requests are done
        self.kept_old: set[str] = set()  # models whose last reload failed: Triton serves the version it had
        self.reap_delay = 0.0  # seconds a stub Triton ended stays a zombie before Triton reaps it (0: at once)
        self.ensembles: dict[str, list[str]] = {}  # ensemble -> its steps, in order (requests run through each)
        self.dozing_bytes = 20 * MIB  # what a dozing stub holds (python_backend/doze.py: its worker ended)
        self.wake_delay = 0.03  # a dozing stub's fork and load() before its batch runs
        # a dozing stub asks the control plane for room before it forks (``python_backend/doze.py``, ``ask_room``):
        # what the world wires to the lifecycle (the wake route's call); None: nobody to ask, the wake goes ahead
        self.ask_room: Callable[[Stub], Awaitable[object]] | None = None
        self.calls: Counter[str] = Counter()
        self.index_delay = 0.0  # how long a read of the repository index takes (Triton reads its repository folder)
        self._pids = itertools.count(10_000)
        self._round_robin: Counter[str] = Counter()
        self._server_tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ what the test scripts

    def script_load(self, model: str, outcome: str, delay: float = 0.05, *, phase_note: bool = True) -> None:
        self.scripts.setdefault(model, []).append(LoadScript(outcome, delay, phase_note))

    def holding(self) -> dict[str, int]:
        """Models holding memory in Triton (loading, ready or unloading) and the bytes their live stubs hold."""
        held = {
            name: sum(s.memory for s in m.stubs + m.starting if s.alive)
            for name, m in self.models.items()
            if m.state in BUSY_STATES
        }
        # an unload whose processes were ended holds nothing while Triton finishes it
        return {n: b for n, b in held.items() if b or self.models[n].state != "UNLOADING"}

    def server_bytes(self) -> int:
        """tritonserver's own RSS: its base, and its side of each model it holds."""
        return self.server_memory + self.server_per_model * len(self.holding())

    def ready(self) -> set[str]:
        return {name for name, m in self.models.items() if m.state == "READY"}

    def crash(self, model: str, *, busy_first: bool = True, status: int = SIGSEGV_STATUS) -> Stub | None:
        """A stub of a READY model dies (a zombie Triton does not reap); the busiest one first."""
        m = self.models.get(model)
        if m is None or m.state != "READY":
            return None
        live = [s for s in m.stubs if s.alive]
        if not live:
            return None
        live.sort(key=lambda s: (s.running is None) if busy_first else 0)
        self._kill(live[0], status)
        return live[0]

    # ------------------------------------------------------------------ TritonAdminClient

    async def repository_index(self, ready_only: bool = False) -> list[RepositoryEntry]:
        self.calls["index"] += 1
        await asyncio.sleep(self.index_delay)
        entries = []
        names = {p.name for p in self.repository.iterdir() if (p / "config.pbtxt").is_file()} | set(self.models)
        for name in sorted(names):
            m = self.models.get(name)
            state = m.state if m is not None else None
            if ready_only and state != "READY":
                continue
            entries.append(RepositoryEntry(name, "1" if m else None, state, m.reason if m else None))
        return entries

    def load(self, name: str, config: dict[str, Any] | None = None, timeout: float = 300) -> Coroutine[Any, Any, None]:
        """Blocks until Triton loaded or failed the model; a client that gives up does not stop Triton."""
        # What the repository held when the call was made (the lifecycle's checks run just before it): Triton reads
        # it a moment later, and a publish between the two is outside any check the lifecycle can make
        # (``_load_ensemble``).
        sent = self._files(name), frozenset(p.name for p in self.repository.iterdir())
        return self._load_call(name, config, timeout, sent)

    async def _load_call(self, name: str, config: dict[str, Any] | None, timeout: float, sent: Sent) -> None:
        self.calls["load"] += 1
        work = asyncio.ensure_future(self._load(name, config, sent))
        self._server_tasks.add(work)
        work.add_done_callback(self._server_tasks.discard)
        work.add_done_callback(lambda t: t.cancelled() or t.exception())  # the client hears it, or gave up
        try:
            await asyncio.wait_for(asyncio.shield(work), timeout)
        except TimeoutError:
            raise TritonModelLoadError(name, f"not loaded within {timeout}s") from None

    def _files(self, name: str) -> tuple[int, int] | None:
        """The model folder's identity (a republish changes it): the publish a load call was sent for."""
        folder = self.repository / name
        try:
            return folder.stat().st_ino, (folder / "config.pbtxt").stat().st_mtime_ns
        except OSError:
            return None

    async def _load(self, name: str, override: dict[str, Any] | None, sent: Sent = (None, frozenset())) -> None:
        self.loads_in_flight[name] += 1
        if self.loads_in_flight[name] > 1:
            self.overlaps.append(f"two loads of '{name}' at once")
        try:
            await self._load_once(name, override, sent)
        finally:
            self.loads_in_flight[name] -= 1

    async def _load_once(self, name: str, override: dict[str, Any] | None, sent: Sent) -> None:
        folder = self.repository / name
        try:
            text = (folder / "config.pbtxt").read_text(encoding="utf-8")
            files = (folder.stat().st_ino, (folder / "config.pbtxt").stat().st_mtime_ns)  # a republish changes both
            config = override if override is not None else rendered_config(text, where=name)
            record = json.loads((folder / DEPLOYMENT_FILE).read_text(encoding="utf-8"))
            deployment = record["deployment"]
        except (OSError, ValueError, KeyError) as e:
            raise TritonModelLoadError(name, f"failed to load '{name}': {e}") from None
        old = self.models.get(name)
        if config.get("platform") == "ensemble":
            self._load_ensemble(name, config, files, sent)
            return
        # the instances, once per version served (a Triton folder's version_policy: the record's versions)
        count = int((config.get("instance_group") or [{}])[0].get("count", 1)) * len(record.get("versions") or [1])
        per_stub = self.memory.get(name) or int((deployment.get("memory_mb") or 1) * MIB / deployment["instances"])
        serving = old is not None and old.state == "READY"
        if serving and old is not None and override is None and old.files == files and old.unloading is None:
            return  # Triton 2.51: a load without an override of a loaded model whose files are unchanged keeps it
        queue = self.scripts.get(name)
        script = queue.pop(0) if queue else LoadScript()
        if old is not None and old.unloading is not None:  # a load right after an unload builds it anew
            old.unloading.cancel()
            old.unloading = None
            self._retire(old.stubs)  # what they run completes there
            old.stubs, serving = [], False
        keep: list[Stub] = []
        if serving and old is not None and old.files == files and _same_but_count(old.config, config):
            keep = [s for s in old.stubs if s.alive][:count]
        m = old if old is not None else Loaded(name, "UNAVAILABLE")
        self.models[name] = m
        if not serving:
            m.state, m.reason, m.served = "LOADING", "", 0
        new = [self._stub(m, per_stub, files, phase_note=script.phase_note) for _ in range(count - len(keep))]
        for stub in new:  # what the runtime it started with can do (the version loaded, not the one asking)
            stub.can_doze = deployment.get("worker") == "preforked"
        m.starting += new
        held = self.holding()
        self.peak = max(self.peak, self.server_bytes() + sum(held.values()))
        self.largest = max(self.largest, *held.values())
        try:
            await self._initialize(m, new, script, serving)
        finally:
            m.starting = [s for s in m.starting if s not in new]
        if not script.phase_note:
            for stub in new:
                self._phase_note(stub)
        leaving = [s for s in m.stubs if s not in keep]
        m.stubs, m.config, m.state, m.reason, m.files = keep + new, config, "READY", "", files
        self.kept_old.discard(name)
        self._retire(leaving)
        for ensemble in sorted(self.down_with_step):
            if name in self.ensembles[ensemble] and set(self.ensembles[ensemble]) <= self.ready():
                self.down_with_step.discard(ensemble)
                self.models[ensemble].state, self.models[ensemble].reason = "READY", ""

    def _load_ensemble(self, name: str, config: dict[str, Any], files: tuple[int, int], sent: Sent) -> None:
        """An ensemble: no process of its own; its steps must be loaded (Triton would load them itself: snoozeml loads
        them first, so a step found unloaded here is a failure of the lifecycle's, reported as a load error).
        ``sent``: the repository when the load call was sent. The lifecycle checks the steps up to the call; what was
        published between the call and this read (the ensemble, naming a step the lifecycle never saw in it, or a
        step) is not its miss."""
        steps = [s["model_name"] for s in config.get("ensemble_scheduling", {}).get("step", [])]
        missing = [s for s in steps if s not in self.ready()]
        if missing:
            sent_files, present = sent
            if sent_files == files:
                published = [step for step in missing if step in present and self.is_published(step)]
                self.ensemble_misses.append((name, published))
            raise TritonModelLoadError(name, f"ensemble '{name}': steps not loaded: {missing}")
        m = self.models.get(name) or Loaded(name, "UNAVAILABLE")
        m.stubs, m.config, m.state, m.reason, m.files, m.served = [], config, "READY", "", files, 0
        self.models[name] = m
        self.ensembles[name] = steps

    def _retire(self, stubs: list[Stub]) -> None:
        """The old instances of a reloaded model: new requests go to the new ones; the requests an old one runs or
        has queued complete there (they hold the old model), then it exits."""
        self.retired += stubs
        busy = [s for s in stubs if s.alive and (s.running is not None or s.queued)]
        self._exit([s for s in stubs if s not in busy])
        if busy:
            task = asyncio.ensure_future(self._exit_when_idle(busy))
            self._server_tasks.add(task)
            task.add_done_callback(self._server_tasks.discard)

    async def _exit_when_idle(self, stubs: list[Stub]) -> None:
        while any(s.alive and (s.running is not None or s.queued) for s in stubs):
            await asyncio.sleep(self.exec_delay)
        self._exit(stubs)

    async def _initialize(self, m: Loaded, new: list[Stub], script: LoadScript, serving: bool) -> None:
        """The new stubs' ``initialize``: done, failed, or hanging until they are killed."""
        name = m.name
        await asyncio.sleep(script.delay)
        if script.outcome == "hang" and new:
            await asyncio.wait([asyncio.ensure_future(s.died.wait()) for s in new], return_when="FIRST_COMPLETED")
            self._exit(new)
            self._fail(m, serving, "stub process exited during initialize")
            raise TritonModelLoadError(name, f"failed to load '{name}': stub process exited during initialize")
        if script.outcome in ("oom", "error"):
            self._exit(new)
            if script.outcome == "oom":
                why = f"[snooze:oom] model '{name}': load ran out of memory (MemoryError: scripted)"
            else:
                why = f"[snooze:internal] model '{name}': load raised RuntimeError: scripted"
            self._fail(m, serving, why)
            raise TritonModelLoadError(name, why)
        if any(not s.alive for s in new):  # killed while loading (an abandoned load that did finish)
            self._exit(new)
            self._fail(m, serving, "stub process died during initialize")
            raise TritonModelLoadError(name, f"failed to load '{name}': stub process died")

    def _fail(self, m: Loaded, serving: bool, why: str) -> None:
        if serving:
            self.kept_old.add(m.name)
            return  # a failed reload keeps the model as it was
        self._exit(m.stubs)
        m.stubs, m.state, m.reason = [], "UNAVAILABLE", why

    def _stub(self, m: Loaded, memory: int, files: tuple[int, int], *, phase_note: bool = True) -> Stub:
        m.next_instance += 1
        pid = next(self._pids)
        stub = Stub(pid, pid * 7, m.name, f"{m.name}_0_{m.next_instance}", memory, files=files)
        self._journal(stub, None, busy=False)
        # The runtime's phase note: a stub here is in initialize as soon as it exists, unless the script says
        # it is still starting (before Triton's first untimed wait; cancel.py waits for this note before a kill).
        if phase_note:
            self._phase_note(stub)
        return stub

    def _phase_note(self, stub: Stub) -> None:
        (self.journal_dir / f"{stub.pid}-{stub.start_ticks}{PHASE_SUFFIX}").write_text('{"phase": "load"}')

    def _exit(self, stubs: list[Stub]) -> None:
        """Triton ends these stubs and reaps them (a crashed one too, once its model unloads). A live one ends
        cleanly: its runtime removes its journal (a crashed one's stays)."""
        for s in stubs:
            if s.alive:
                s.alive, s.exit_status = False, 0
                s.died.set()
                journal_path(self.journal_dir, s.pid, s.start_ticks).unlink(missing_ok=True)
            if self.reap_delay:  # a zombie for a moment, as a real stub is until Triton's waitpid
                asyncio.get_running_loop().call_later(self.reap_delay, setattr, s, "reaped", True)
            else:
                s.reaped = True

    def _kill(self, stub: Stub, status: int) -> None:
        if stub.alive:
            stub.alive, stub.exit_status = False, status
            stub.died.set()

    async def unload(self, name: str, wait: bool = True, timeout: float = 60) -> None:
        self.calls["unload"] += 1
        await asyncio.sleep(0)
        m = self.models.get(name)
        self.down_with_step.discard(name)  # unloaded itself: not brought back with its steps
        if m is not None and m.state in ("READY", "LOADING") and m.unloading is None:
            m.state = "UNLOADING"
            for ensemble, steps in self.ensembles.items():
                e = self.models.get(ensemble)
                if name in steps and e is not None and e.state == "READY":
                    e.state, e.reason = "UNAVAILABLE", f"its step '{name}' was unloaded"
                    self.down_with_step.add(ensemble)
            delay = m.finalize_secs = self.unload_hangs.pop(name, self.unload_delay)
            m.unloading = asyncio.ensure_future(self._finish_unload(m, delay))
        if not wait:
            return
        deadline = asyncio.get_running_loop().time() + timeout
        while (m := self.models.get(name)) is not None and m.state in BUSY_STATES:
            if asyncio.get_running_loop().time() >= deadline:
                raise TritonError(f"model '{name}' is still {m.state} {timeout}s after its unload")
            await asyncio.sleep(0.05)

    async def _finish_unload(self, m: Loaded, delay: float) -> None:
        await asyncio.sleep(delay)
        while any(s.running for s in m.stubs if s.alive):  # accepted requests complete first
            await asyncio.sleep(self.exec_delay)
        self._exit(m.stubs)
        m.stubs, m.state, m.reason, m.unloading = [], "UNAVAILABLE", "unloaded", None

    async def model_config(self, name: str) -> dict[str, Any]:
        await asyncio.sleep(0)
        m = self.models.get(name)
        if m is None or m.state != "READY":
            raise NotFoundError(f"no config for model '{name}'")
        return json.loads(json.dumps(m.config))

    async def model_stats(self, name: str, version: str = "") -> ModelStats:
        return (await self.version_stats(name, version))[-1]

    async def version_stats(self, name: str, version: str = "") -> list[ModelStats]:
        self.calls["stats"] += 1
        await asyncio.sleep(0)
        m = self.models.get(name)
        if m is None or m.state != "READY":
            raise NotFoundError(f"no statistics for model '{name}'")
        return [self._stats(m)]

    async def all_stats(self) -> dict[str, list[ModelStats]]:
        """Every READY model's statistics, as ``GET /v2/models/stats`` (one call)."""
        self.calls["all_stats"] += 1
        await asyncio.sleep(0)
        return {name: [self._stats(m)] for name, m in self.models.items() if m.state == "READY"}

    @staticmethod
    def _stats(m: Loaded) -> ModelStats:
        return ModelStats(m.name, "1", m.last_inference_ms, m.served, m.served, m.served, 0, 0, 0, 0, 0, 0, 0)

    async def pending_request_counts(self) -> dict[str, float]:
        await asyncio.sleep(0)
        return {name: float(self.pending[name]) for name, m in self.models.items() if m.state == "READY"}

    # ------------------------------------------------------------------ inference

    async def _wake(self, stub: Stub) -> None:
        """A dozing stub's batch asks room for its wake, then forks a worker and loads the model first
        (``FakeStubControl``)."""
        if stub.awake_memory is not None and stub.alive and self.ask_room is not None:
            await self.ask_room(stub)  # bounded, never refused: the wake goes ahead whatever the answer
        if stub.awake_memory is not None and stub.alive:
            if self.unenforced:
                self.woken_unenforced += max(stub.awake_memory - stub.memory, 0)
            stub.memory, stub.awake_memory = stub.awake_memory, None
            stub.wakes += 1
            stub.woke_at = asyncio.get_running_loop().time()
            self.peak = max(self.peak, self.server_bytes() + sum(self.holding().values()))
            await asyncio.sleep(self.wake_delay)

    async def infer(self, name: str, request_id: str) -> Answer:
        """One request, as Triton runs it: on the next instance, journaled before it runs."""
        m = self.models.get(name)
        if m is None or m.state != "READY":
            why = "has no available versions" if m is not None else "is not found"
            return Answer(404, f"Request for unknown model: '{name}' {why}")
        if name in self.ensembles:  # each step runs the request inside Triton (the gateway never sees it)
            for step in self.ensembles[name]:
                answer = await self.infer(step, f"{request_id}/{step}")
                if answer.status != 200:
                    return Answer(500, f"in ensemble '{name}': {answer.text}")
            m.served += 1
            m.last_inference_ms = int(EPOCH * 1000 + asyncio.get_running_loop().time() * 1000)
            return Answer(200, "ok")
        self._round_robin[name] += 1
        stub = m.stubs[self._round_robin[name] % len(m.stubs)]
        self.pending[name] += 1
        queued = True
        try:
            if not stub.alive:
                await asyncio.sleep(DEAD_STUB_WAIT)
                return Answer(500, f"Stub process '{stub.instance}' is not healthy.")
            stub.queued += 1
            try:
                while stub.running is not None and stub.alive:  # one execution at a time per instance
                    await asyncio.sleep(self.exec_delay)
            finally:
                stub.queued -= 1
            if not stub.alive:
                await asyncio.sleep(DEAD_STUB_WAIT)
                return Answer(500, f"Stub process '{stub.instance}' is not healthy.")
            stub.running = request_id  # handed to the instance: Triton's pending count no longer has it
            self.pending[name] -= 1
            queued = False
            while stub.stopped and stub.alive:  # a frozen stub takes it up when it goes on
                await asyncio.sleep(self.exec_delay / 10)
            await self._wake(stub)  # a dozing stub forks its worker first, before it journals the batch
            if not stub.alive:  # it never reached the model's code
                stub.running = None
                await asyncio.sleep(DEAD_STUB_WAIT)
                return Answer(500, f"Stub process '{stub.instance}' is not healthy.")
            self._journal(stub, request_id, busy=True)
            self.executions[request_id] += 1
            if not stub.grown:
                stub.grown, stub.memory = True, stub.memory + self.growth.get(name, 0)
                self.peak = max(self.peak, self.server_bytes() + sum(self.holding().values()))
            died = asyncio.ensure_future(stub.died.wait())
            done, _ = await asyncio.wait([died], timeout=self.exec_delay)
            died.cancel()
            if not done:
                self._journal(stub, request_id, busy=False)
            stub.running = None
            if done:
                return Answer(500, f"Stub process '{stub.instance}' is not healthy.")
            # Triton's statistics count a batch when it ends, stamped then (last_inference: the clock at its end)
            m.last_inference_ms = int(EPOCH * 1000 + asyncio.get_running_loop().time() * 1000)
            m.served += 1
            return Answer(200, "ok", stub.files)
        finally:
            if queued:
                self.pending[name] -= 1

    def _journal(self, stub: Stub, request_id: str | None, *, busy: bool) -> None:
        """The runtime's journal (journal.py): created empty when the stub starts; the batch's ids and the busy
        flag before a batch runs, the end after; its flags say whether the model declares unload()."""
        stub.busy = busy
        path = journal_path(self.journal_dir, stub.pid, stub.start_ticks)
        if request_id is None:
            path.write_bytes(struct.pack("<I", 0))
        elif busy:
            ids = request_id.encode()
            with path.open("r+b") as f:
                f.write(struct.pack("<I", len(ids)) + ids)
        else:
            stub.last_end = asyncio.get_running_loop().time()
        flags = int(stub.model in self.declares_unload)
        with path.open("r+b") as f:
            f.seek(JOURNAL_SIZE - 16)
            f.write(struct.pack("<QII", int(stub.last_end * 1e9), int(busy), flags))

    async def aclose(self) -> None:
        for task in list(self._server_tasks):
            task.cancel()


def _same_but_count(old: dict[str, Any], new: dict[str, Any]) -> bool:
    def without_count(config: dict[str, Any]) -> str:
        c = json.loads(json.dumps(config))
        for g in c.get("instance_group") or []:
            g.pop("count", None)
        return json.dumps(c, sort_keys=True)

    return bool(old) and without_count(old) == without_count(new)


@dataclass
class _Server:
    pid: int


class FakeProcesses:
    """``TritonProcesses`` over the fake's stubs: tritonserver and its stubs can be seen (a child, or a shared
    PID namespace); a stub's RSS is its scripted memory; a kill ends it as SIGKILL would."""

    proc_root = Path("/nonexistent-proc")
    visible = True
    can_observe = True

    def __init__(self, triton: FakeTriton) -> None:
        self.triton = triton
        self._server = _Server(4242)
        self.ended: set[int] = set()  # the stubs the control plane killed (``kill``): their deaths are not crashes

    def _all(self) -> list[Stub]:
        return [s for m in self.triton.models.values() for s in m.stubs + m.starting]

    def _find(self, stub: StubProcess) -> Stub | None:
        """Any stub Triton started, the old instances of a reload too (their deaths and journals are seen)."""
        stubs = self._all() + self.triton.retired
        found = (s for s in stubs if s.pid == stub.pid and s.start_ticks == stub.start_ticks)
        return next(found, None)

    def server(self) -> _Server:
        return self._server

    def environment(self, name: str) -> str | None:
        return None

    def stubs(self, model: str | None = None) -> list[StubProcess]:
        return sorted(
            (s.process for s in self._all() if s.alive and (model is None or s.model == model)), key=lambda p: p.pid
        )

    def alive(self, stub: StubProcess) -> bool:
        s = self._find(stub)
        return s is not None and s.alive

    def death(self, stub: StubProcess) -> StubDeath | None:
        s = self._find(stub)
        ended = stub.pid in self.ended
        if s is None or s.reaped:
            return StubDeath(stub, None, reaped=True, ended=ended)
        return None if s.alive else StubDeath(stub, s.exit_status, ended=ended)

    def deaths(self, stubs: list[StubProcess]) -> list[StubDeath]:
        return [d for d in (self.death(s) for s in stubs) if d is not None]

    def at_rest(self, stub: StubProcess) -> bool | None:
        s = self._find(stub)
        return s is None or not s.busy

    def rss(self, stubs: list[StubProcess]) -> int:
        return sum(s.memory for p in stubs if (s := self._find(p)) is not None and s.alive)

    def memory(self, stubs: list[StubProcess], *, max_age: float = 0.0) -> int:
        """A stub's scripted memory is its own: its Pss is its RSS."""
        return self.rss(stubs)

    def memory_split(self, stubs: list[StubProcess], *, max_age: float = 0.0) -> tuple[int, int]:
        """(Pss, private): all of a stub's scripted memory is private."""
        return self.rss(stubs), self.rss(stubs)

    def kill(self, stubs: list[StubProcess]) -> list[int]:
        self.ended.update(s.pid for s in stubs)  # pids are never reused here
        return self.signal(stubs, signal.SIGKILL)

    def signal(self, stubs: list[StubProcess], signum: int) -> list[int]:
        sent = []
        for p in stubs:
            s = self._find(p)
            if s is not None and s.alive:
                if signum == signal.SIGKILL:
                    self.triton._kill(s, SIGKILL_STATUS)
                elif signum in (signal.SIGSTOP, signal.SIGCONT):
                    s.stopped = signum == signal.SIGSTOP
                sent.append(s.pid)
        return sent

    def server_rss(self) -> int | None:
        return self.triton.server_bytes()

    def server_memory(self) -> int | None:
        return self.triton.server_bytes()

    def tree_rss(self) -> int:
        return self.triton.server_bytes() + sum(s.memory for s in self._all() if s.alive)


class NoGpu:
    """``GpuProcessReader`` on a machine without a GPU."""

    def devices(self) -> list[Any]:
        return []

    def processes(self) -> list[Any]:
        return []


class FakeStubControl:
    """``controlplane.triton.stub_control.StubControl`` over the fake's stubs: a doze keeps the stub (and Triton's
    READY) and drops it to ``FakeTriton.dozing_bytes``; its next batch wakes it (``FakeTriton.infer``)."""

    def __init__(self, processes: FakeProcesses) -> None:
        self.processes = processes
        self.asked: list[tuple[str, int]] = []  # (model, stub pid) per doze asked

    def doze(self, stub: StubProcess) -> DozeAnswer:
        self.asked.append((stub.model, stub.pid))
        s = self.processes._find(stub)
        if s is None or not s.alive or not s.can_doze:
            return DozeAnswer(False, "its stub cannot doze (in-stub, or a runtime without doze)")
        if s.running is not None or s.queued:
            return DozeAnswer(False, BUSY)
        if s.awake_memory is not None:
            return DozeAnswer(False, "dozing already")
        s.awake_memory, s.memory = s.memory, min(s.memory, self.processes.triton.dozing_bytes)
        return DozeAnswer(True, secs=0.005)

    def dozing(self, stub: StubProcess) -> bool:
        s = self.processes._find(stub)
        return s is not None and s.alive and s.awake_memory is not None

    def woke(self, stub: StubProcess) -> Wake | None:
        s = self.processes._find(stub)
        if s is None or not s.alive or s.awake_memory is not None or not s.wakes:
            return None
        return Wake(s.pid + 1, self.processes.triton.wake_delay)
