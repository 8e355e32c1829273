"""The real ``LifecycleManager`` in a world of fakes: a fake Triton (``fake_triton``), a virtual clock, a real
``ModelStore`` over a temporary repository (and a second store on it: another node of a fleet), the real
activator logic (``ModelAnswers.forward``) for requests, and the invariants checked after every step.

Every operation is a method of ``LifecycleWorld``; the randomized state machine (``test_lifecycle_machine``)
and the regression tests call the same methods, so a shrunk failing sequence reads as a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import textwrap
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controlplane.errors import SnoozeError
from controlplane.gateway.activator import HoldRegistry, ModelAnswers
from controlplane.lifecycle.loading import LOAD_ABANDON_SECS
from controlplane.lifecycle.manager import LifecycleManager
from controlplane.lifecycle.memory.cgroup import CgroupMemory
from controlplane.lifecycle.state import ModelRecord, ModelState, ModelStates
from controlplane.lifecycle.unloading import HEALTH_PROBE_SECS, KILL_WAIT_SECS
from controlplane.render import DEPLOYMENT_FILE, embedded_target
from controlplane.settings import Settings
from controlplane.spec import DeploymentSpec, resolve
from controlplane.store import ModelStore
from harness.fake_triton import MIB, Answer, FakeProcesses, FakeStubControl, FakeTriton, NoGpu, Stub
from harness.virtual_time import Hang, VirtualTime, VirtualTimeLoop
from python_backend.doze import DEFAULT_ADMIT_TIMEOUT_SECS

MODEL_PY = """
class Model:
    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        return {"y": inputs["x"]}
"""
LOAD_TIMEOUT = 4.0
MANIFEST = {
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [2]}],
    "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}],
    "load_timeout_secs": LOAD_TIMEOUT,
}
MODELS = ("m0", "m1", "m2", "m3")
ENSEMBLE = "e0"  # the machine's ensemble (publish_ensemble_api), over some of MODELS
CANCEL_BOUND = 5.0  # virtual seconds: a stop, an unload, a delete or a republish never waits for a hung load
BUDGET_MB = 300
SIZES_MB = (60, 100, 150)
# how long a client may wait at most: its wake-up, a recovery, Triton's waits on dead stubs, and slack
SLACK = 2 * (LOAD_TIMEOUT + LOAD_ABANDON_SECS) + 10.0
RUN_LIMIT = 600.0  # virtual seconds one step (or a test's end) may take
# What a request waiting on a load is told when an unload cancels it; after a republish it waits for the new version.
REPUBLISH_REFUSAL = "its load was cancelled (republished)"


def ensemble_config(name: str, steps: list[str]) -> str:
    """A Triton ensemble's config.pbtxt whose steps run every request in order (x -> y of each)."""
    ins = ["x", *(f"y_{i}" for i in range(len(steps) - 1))]
    outs = [*(f"y_{i}" for i in range(len(steps) - 1)), "y"]
    step_text = "".join(
        f'  step {{ model_name: "{s}" model_version: -1 input_map {{ key: "x" value: "{a}" }} '
        f'output_map {{ key: "y" value: "{b}" }} }}\n'
        for s, a, b in zip(steps, ins, outs, strict=True)
    )
    return (
        f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: 8\n'
        'input [{ name: "x" data_type: TYPE_FP32 dims: [2] }]\n'
        'output [{ name: "y" data_type: TYPE_FP32 dims: [2] }]\n'
        f"ensemble_scheduling {{\n{step_text}}}\n"
    )


class Violation(AssertionError):
    """An invariant of the lifecycle does not hold."""


@dataclass
class Call:
    """A client request, or an API call, and what it was answered."""

    what: str
    model: str
    started: float
    bound: float  # virtual seconds it may take at most
    task: asyncio.Task[Any]
    answer: str | None = None


@dataclass
class Probe:
    """Who changes a record's state: a change to a model that has a transition running, made from outside
    that transition, is a second transition at once."""

    violations: list[str] = field(default_factory=list)

    def install(self, states: ModelStates) -> None:
        set_state = states.set_state
        probe = self

        def checked(rec: ModelRecord, state: ModelState, reason: str | None = None) -> None:
            op = rec.op
            with contextlib.suppress(RuntimeError):
                current = asyncio.current_task()
                if op is not None and not op.done() and current is not op:
                    probe.violations.append(
                        f"model '{rec.id}' set {state.value} from {current.get_name() if current else '?'} "
                        f"while its transition {op.get_name()} runs"
                    )
            set_state(rec, state, reason)

        states.set_state = checked  # type: ignore[method-assign]


async def inline(func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``asyncio.to_thread`` in this tier: the fakes answer at once, and the virtual clock allows no thread."""
    return func(*args, **kwargs)


class LifecycleWorld:
    """One manager over the fakes, the operations a test drives, and the invariants."""

    def __init__(
        self,
        root: Path,
        *,
        monkeypatch: Any,
        log: Callable[[str], None] | None = None,
        gpu_reader: Any = None,
        **settings: Any,
    ) -> None:
        """``settings``: Settings fields that differ from this world's defaults; ``gpu_reader``: NVML's stand-in
        (default: no GPU)."""
        self.gpu_reader = gpu_reader if gpu_reader is not None else NoGpu()
        self.root = root
        self._sources = itertools.count()  # the machine's ensemble folders, one per publish
        self.loop = VirtualTimeLoop()
        # the one clock of the manager and the gateway's holds
        self.clock = VirtualTime(self.loop)
        monkeypatch.setattr(asyncio, "to_thread", inline)
        self.say = log or (lambda line: None)
        self.package = root / "package"
        self.package.mkdir()
        (self.package / "snooze_model.py").write_text(textwrap.dedent(MODEL_PY))
        (self.package / "snooze_model.json").write_text(json.dumps(MANIFEST))
        repo, self.journal = root / "repo", root / "journal"
        repo.mkdir()
        self.journal.mkdir()
        self.store = ModelStore(repo, embedded_target())
        self.other_node = ModelStore(repo, embedded_target())  # another node's writes to the shared store
        self.triton = FakeTriton(repo, self.journal)
        self.triton.is_published = self.store.exists
        self.triton.ask_room = self._ask_room
        self.processes = FakeProcesses(self.triton)
        self.stub_control = FakeStubControl(self.processes)
        # Triton's memory cgroup as the manager reads it (None: unseen), or what reads it
        self.cgroup: CgroupMemory | Callable[[], CgroupMemory] | None = None
        self.settings = Settings(
            work_dir=root / "work",
            memory_budget_mb=BUDGET_MB,
            sweep_interval_secs=1.0,
            watch_interval_secs=0.2,
            store_poll_secs=2.0,
            autoscale_queue_threshold=2,
            autoscale_window_secs=1.0,
            max_concurrent_loads=2,
        ).model_copy(update=settings)
        self.probe = Probe()
        self.manager: LifecycleManager = self._manager()
        self.answers = ModelAnswers(self.manager, self.store, self.settings)
        self.holds = HoldRegistry(self.answers, root / "held.log", clock=self.clock)
        # open holds (a stream through the gateway): token -> (model, the model's idle unloads and evictions when
        # the hold was taken; None until it is)
        self.held: dict[str, tuple[str, float | None]] = {}
        self.calls: list[Call] = []
        self.answered: list[Call] = []  # calls with their answers, in the order the checks found them done
        self.ids = itertools.count(1)
        self.locks: dict[str, asyncio.Lock] = {}
        self.deleted: dict[str, float] = {}  # model -> when it left the store (virtual seconds)
        # model -> its published folders (the fake's ``Loaded.files``), numbered in the order they were published
        self.versions: dict[str, dict[tuple[int, int], int]] = {}
        # model -> (when a publish through the API returned, the version it published): requests sent to Triton
        # after that are answered by that version or a newer one (unless a reload failed: Triton keeps the old)
        # model -> (the order its last API publish returned in, its version): ``_order`` numbers what happens, in the
        # event loop's order (a request sent in the same virtual instant as a publish returned came before or after)
        self.settled: dict[str, tuple[int, int]] = {}
        self._order = itertools.count()
        self.stale: list[str] = []  # answers that broke that rule, or told a waiting request a republish failed it
        self.overcommits: list[str] = []  # wakes from doze let over the budget while an idle model could have gone
        self.changed: dict[str, float] = {}  # model -> when the store last changed it (virtual seconds)
        self.paused_since: float | None = None
        self.paused_secs = 0.0
        self.resumed_at = 0.0  # while paused no sweep or store follow runs: what they fix counts from here
        self.stuck_at = -1e9  # when every loaded model was last seen in use beside a wake from doze (``check``)
        self.steps = 0
        self.sweep_started: float | None = None  # clock.time() the sweep running now began (None: none runs)
        self.run(self.manager.start())

    def _manager(self) -> LifecycleManager:
        m = LifecycleManager(
            self.settings,
            self.store,
            self.triton,  # type: ignore[arg-type]
            processes=self.processes,  # type: ignore[arg-type]
            journal_dir=self.journal,
            gpu_reader=self.gpu_reader,
            gpu_pid_map=None,
            cgroup=lambda: self.cgroup() if callable(self.cgroup) else self.cgroup,
            stub_control=self.stub_control,
            clock=self.clock,
        )
        self.probe.install(m.states)
        sweep = m.supervisor.sweep

        async def sweeping() -> None:  # the sweeper's task takes this one (started after)
            self.sweep_started = self.clock.time()
            try:
                await sweep()
            finally:
                self.sweep_started = None

        m.supervisor.sweep = sweeping  # type: ignore[method-assign]
        return m

    # ------------------------------------------------------------------ running

    @property
    def now(self) -> float:
        return self.loop.now

    def run(self, coro: Coroutine[Any, Any, Any], limit: float = RUN_LIMIT) -> Any:
        """Run ``coro`` on the virtual clock; a Violation when it outlives ``limit`` virtual seconds."""
        try:
            return self.loop.run_until_complete(asyncio.wait_for(coro, limit))
        except Hang as e:
            raise Violation(f"hang: {e}") from None
        except TimeoutError:
            raise Violation(f"an operation did not end within {limit:g} virtual seconds") from None

    def step(self, coro: Coroutine[Any, Any, Any], gap: float = 0.05) -> None:
        """Run one operation, let ``gap`` virtual seconds pass, check every invariant."""
        self.steps += 1

        async def go() -> None:
            await coro
            await asyncio.sleep(gap)

        self.run(go())
        self.check()

    def close(self) -> None:
        """Answer everything, stop the manager, close the loop (a test's end)."""
        try:
            if self.paused_since is not None:
                self.step(self.resume())
                # the budget is judged once the first sweep after the pause has had time to enforce it
                self.step(self.tick(0.0), 2 * self.settings.sweep_interval_secs + 1.5)
            self.run(self._settle_calls())
            self.run(self._release_all())
            self.check()
            self.run(self.manager.stop())
            self.run(self.triton.aclose())
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Cancel whatever still runs and close the loop (after a violation)."""
        if self.loop.is_closed():
            return
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        with contextlib.suppress(BaseException):
            self.loop.run_until_complete(asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60))
        self.loop.close()

    def _start(self, what: str, model: str, coro: Coroutine[Any, Any, str], bound: float) -> Call:
        call = Call(what, model, self.now, bound, asyncio.ensure_future(coro))
        self.calls.append(call)
        return call

    async def _settle_calls(self) -> None:
        pending = [c.task for c in self.calls if not c.task.done()]
        if pending:
            await asyncio.wait(pending)

    def _lock(self, model: str) -> asyncio.Lock:
        return self.locks.setdefault(model, asyncio.Lock())

    # ------------------------------------------------------------------ operations

    async def request(self, model: str, timeout: float | None = None) -> None:
        """A client's inference request through the gateway: straight to Triton; a 404 or a dead stub's
        answer goes once more, to the activator (``ModelAnswers.forward``)."""
        rid = f"req-{next(self.ids)}"
        wake = timeout if timeout is not None else LOAD_TIMEOUT + LOAD_ABANDON_SECS
        self._start("request", model, self._client(model, rid, timeout), wake + SLACK)
        await asyncio.sleep(0)

    async def _client(self, model: str, rid: str, timeout: float | None) -> str:
        answer = await self._infer(model, rid)
        if answer.status == 200:
            return "200"
        if answer.status != 404 and not answer.dead:
            return f"{answer.status}: {answer.text}"
        try:
            again = await self.answers.forward(
                model, rid, lambda: self._infer(model, rid), lambda a: a.dead, timeout=timeout
            )
        except SnoozeError as e:
            if REPUBLISH_REFUSAL in e.message:  # the model is still published: its new version answers
                self.stale.append(f"request {rid} of '{model}' failed by a republish: {e.message}")
            return f"{e.status_code}: {e.message}"
        return f"{again.status}: {again.text}" if again.status != 200 else "200"

    async def _infer(self, model: str, rid: str) -> Answer:
        """Triton's answer to ``rid``; one served by a version older than a publish that returned before it was sent
        is a violation (a republish's waiters and later requests get the new version), unless Triton kept the old
        version (its reload failed) when it was sent or when it was answered."""
        sent = next(self._order)
        kept = model in self.triton.kept_old  # a later reload that succeeds clears it: read it now too
        answer = await self.triton.infer(model, rid)
        settled = self.settled.get(model)
        kept = kept or model in self.triton.kept_old
        if answer.status != 200 or settled is None or settled[0] > sent or kept:
            return answer
        served = self.versions.get(model, {}).get(answer.files or (0, 0))
        if served is not None and served < settled[1]:
            self.stale.append(
                f"request {rid} of '{model}' answered by version {served} after version {settled[1]} was published"
            )
        return answer

    def _note_version(self, model: str) -> int:
        """Number the folder just published for ``model`` (the fake Triton identifies a version by it)."""
        folder = self.triton.repository / model  # the store's repository, which Triton reads
        files = (folder.stat().st_ino, (folder / "config.pbtxt").stat().st_mtime_ns)
        known = self.versions.setdefault(model, {})
        return known.setdefault(files, len(known) + 1)

    async def republish_while_waiting(self, model: str, outcome: str = "hang", n: int = 3) -> None:
        """Requests wait on a load that is slow (``ok`` after 2 s) or hangs, then the model is republished: they
        are answered by the new version (or a bounded, explained error), never failed by the republish."""
        if not self.store.exists(model):
            return
        self.triton.script_load(model, outcome, 2.0 if outcome == "ok" else 0.05)
        await self.burst(model, n)
        await asyncio.sleep(0.5)
        await self.publish(model, 60)

    async def burst(self, model: str, n: int) -> None:
        for _ in range(n):
            await self.request(model)

    async def hold(self, model: str) -> None:
        """A stream (or a large body) through the gateway: the wake filter asks the activator to hold the model
        (``HoldRegistry.hold``: wake it, keep it in use) until the request ends (``release``)."""
        token = f"hold-{next(self.ids)}"
        self.held[token] = (model, None)

        async def go() -> str:
            try:
                await self.holds.hold(model, token)
            except SnoozeError as e:
                self.held.pop(token, None)
                return f"{e.status_code}: {e.message}"
            if token in self.held:  # not ended during the wake
                self.held[token] = (model, self._unloads(model))
            return "held"

        self._start("hold", model, go(), LOAD_TIMEOUT + LOAD_ABANDON_SECS + SLACK)
        await asyncio.sleep(0)

    async def release(self) -> None:
        """The oldest open stream ends (Envoy logs its end; the activator releases the hold)."""
        if self.held:
            token = next(iter(self.held))
            del self.held[token]
            await self.holds.release(token)

    async def _end_streams(self, model: str) -> None:
        """A deleted model's streams end (its unload cuts them): their holds are released."""
        for token in [t for t, (m, _) in self.held.items() if m == model]:
            del self.held[token]
            await self.holds.release(token)

    def _unloads(self, model: str) -> float:
        """Idle unloads and evictions of ``model`` by this manager: what a hold must prevent."""
        total = 0.0
        for family in self.manager.metrics.registry.collect():
            if family.name in ("snooze_idle_unloads", "snooze_evictions"):
                total += sum(
                    s.value for s in family.samples if s.name.endswith("_total") and s.labels.get("model") == model
                )
        return total

    async def doze(self, model: str) -> None:
        """Ask a loaded preforked model's stubs to doze now, as an idle sweep or an eviction does (its stubs refuse
        while a batch runs); not a step a loaded ensemble pins: neither dozes a model in use."""
        rec = self.manager.states.get(model)
        pinned = any(model in steps for steps in self.manager.groups.pins.values())
        if (
            rec is not None
            and rec.state is ModelState.READY
            and rec.op is None
            and not pinned
            and self.manager.dozing.can_doze(rec)
        ):
            await self.manager.dozing.doze(rec)

    async def tick(self, secs: float) -> None:
        await asyncio.sleep(secs)

    def _spec(self, model: str, size_mb: float | None, instances: int = 1, **deployment: Any) -> Any:
        """``size_mb`` None: the model declares no memory (set what its stubs hold in ``triton.memory``)."""
        return resolve(
            DeploymentSpec(
                id=model,
                path=self.package,
                memory_mb=size_mb * instances if size_mb is not None else None,
                instances=instances,
                max_instances=deployment.pop("max_instances", 3),
                idle_timeout_secs=deployment.pop("idle_timeout_secs", 5),
                **deployment,
            )
        )

    async def publish(
        self, model: str, size_mb: float | None = 60, instances: int = 1, worker: str | None = None, **deployment: Any
    ) -> None:
        """Publish or republish through the API (``operations._publish``): the store, then ``published``.
        ``worker``: "preforked" for a model that dozes when idle (``doze_after_secs``)."""
        if worker is not None:
            deployment["worker"] = worker
        await self._publish_spec(model, self._spec(model, size_mb, instances, **deployment))

    async def _publish_spec(self, model: str, spec: Any) -> None:
        """The API's publish of ``spec``: the store, then ``published``."""

        async def go() -> str:
            async with self._lock(model):
                self.store.publish(spec)
                version = self._note_version(model)
                self.deleted.pop(model, None)
                self.changed[model] = self.now
                await self.manager.published(model)
                if model not in self.deleted:  # another node's delete during the publish: the delete rule governs
                    self.settled[model] = (next(self._order), version)
            return "published"

        self._start("publish", model, self._api(go()), self._api_bound())
        await asyncio.sleep(0)

    async def publish_ensemble_api(self, steps: tuple[str, ...], idle_timeout_secs: float = 5) -> None:
        """Publish or republish the ensemble ``ENSEMBLE`` of ``steps`` through the API, from a Triton ensemble folder
        (resolved as publish resolves one): the store, then ``published``. Its steps need not be published."""
        await self._publish_spec(ENSEMBLE, self._ensemble_spec(steps, idle_timeout_secs))

    async def remote_publish_ensemble(self, steps: tuple[str, ...], idle_timeout_secs: float = 5) -> None:
        """Another node publishes or republishes ``ENSEMBLE`` of ``steps`` into the shared store (this one's store
        follow notices it later)."""
        self.other_node.publish(self._ensemble_spec(steps, idle_timeout_secs))
        self._note_version(ENSEMBLE)
        self.deleted.pop(ENSEMBLE, None)
        self.changed[ENSEMBLE] = self.now

    def _ensemble_spec(self, steps: tuple[str, ...], idle_timeout_secs: float) -> Any:
        folder = self.root / "ensembles" / str(next(self._sources))
        (folder / "1").mkdir(parents=True)
        (folder / "config.pbtxt").write_text(ensemble_config(ENSEMBLE, list(steps)))
        return resolve(DeploymentSpec(id=ENSEMBLE, path=folder, idle_timeout_secs=idle_timeout_secs))

    def publish_ensemble(self, name: str, steps: list[str], *, idle_timeout_secs: float = 5) -> None:
        """An ensemble of published ``steps`` (each runs every request, in order), written into the repository as a
        Triton ensemble folder (``platform: "ensemble"``) with the record publishing writes for that kind."""
        repo = self.triton.repository
        record = json.loads((repo / steps[0] / DEPLOYMENT_FILE).read_text())
        deployment = {**record["deployment"], "id": name, "memory_mb": None, "idle_timeout_secs": idle_timeout_secs}
        folder = repo / name
        (folder / "1").mkdir(parents=True, exist_ok=True)
        (folder / "config.pbtxt").write_text(ensemble_config(name, steps))
        (folder / DEPLOYMENT_FILE).write_text(
            json.dumps(
                {
                    **record,
                    "deployment": deployment,
                    "kind": "triton-ensemble",
                    "backend": "ensemble",
                    "publish": f"ens-{name}",
                    "ensemble_steps": [[step, ""] for step in steps],
                }
            )
        )

    async def delete(self, model: str) -> None:
        """Delete through the API (``operations.delete``): 404 for an unknown id, forget, then the store."""

        async def go() -> str:
            async with self._lock(model):
                self.store.get(model)
                await self.manager.forget(model)
                self.store.delete(model)
                self._gone(model)
                await self._end_streams(model)
            return "deleted"

        self._start("delete", model, self._api(go()), self._api_bound())
        await asyncio.sleep(0)

    async def api_load(self, model: str, instances: int | None = None) -> None:
        async def go() -> str:
            self.store.get(model)
            return (await self.manager.load(model, instances=instances)).state.value

        self._start("load", model, self._api(go()), self._api_bound())
        await asyncio.sleep(0)

    async def api_override(self, model: str, max_batch_size: int | None) -> None:
        """A repository load with a client's config override (``None``: a repository load without one)."""
        override = {"max_batch_size": max_batch_size} if max_batch_size else None

        async def go() -> str:
            self.store.get(model)
            return (await self.manager.load(model, override=override)).state.value

        self._start("load", model, self._api(go()), self._api_bound())
        await asyncio.sleep(0)

    async def api_unload(self, model: str) -> None:
        async def go() -> str:
            self.store.get(model)
            return (await self.manager.unload(model)).state.value

        self._start("unload", model, self._api(go()), self._api_bound())
        await asyncio.sleep(0)

    async def _api(self, coro: Awaitable[str]) -> str:
        """What the API answers: a SnoozeError is its JSON error; anything else would be a bare 500."""
        try:
            return await coro
        except SnoozeError as e:
            return f"{e.status_code}: {e.message}"

    def _api_bound(self) -> float:
        # an API call may wait for the model's transition, then run its own (loads wait for a slot)
        return 4 * (LOAD_TIMEOUT + LOAD_ABANDON_SECS) + 70.0  # 60 s: an unload's own limit

    async def remote_publish(self, model: str, size_mb: float = 60) -> None:
        self.other_node.publish(self._spec(model, size_mb))
        self._note_version(model)
        self.deleted.pop(model, None)
        self.changed[model] = self.now

    def _gone(self, model: str) -> None:
        """``model`` left the store: until the store follow unloads it (the deleted-model rule in ``check`` bounds
        that), Triton may answer with whichever version it still holds, so no published version is owed."""
        self.deleted[model] = self.now
        self.settled.pop(model, None)

    async def remote_delete(self, model: str) -> None:
        if self.other_node.exists(model):
            self.other_node.delete(model)
            self._gone(model)
            await self._end_streams(model)

    async def crash(self, model: str) -> None:
        self.triton.crash(model)

    async def script_load(self, model: str, outcome: str, delay: float = 0.05) -> None:
        self.triton.script_load(model, outcome, delay)

    async def unload_hang(self, model: str, secs: float = 100.0) -> None:
        self.triton.unload_hangs[model] = secs

    async def pause(self) -> None:
        if self.paused_since is None:
            self.paused_since = self.now
            self.triton.unenforced = True
            self._start("pause", "*", self._api(self._pause()), self._api_bound())
        await asyncio.sleep(0)

    async def _pause(self) -> str:
        await self.manager.pause()
        return "paused"

    async def resume(self) -> None:
        if self.paused_since is not None:
            self.manager.resume()
            self.triton.unenforced = False
            self.paused_secs += self.now - self.paused_since
            self.paused_since = None
            self.resumed_at = self.now
        await asyncio.sleep(0)

    async def restart(self) -> None:
        """Shut the control plane down (after every caller is answered) and start a new one over the same
        Triton: it adopts what Triton has loaded."""
        await self.resume()
        await self._settle_calls()
        await self._release_all()  # the streams end with the control plane
        await self.manager.stop()
        self.manager = self._manager()
        self.answers = ModelAnswers(self.manager, self.store, self.settings)
        self.holds = HoldRegistry(self.answers, self.root / "held.log", clock=self.clock)
        await self.manager.start()
        self.resumed_at = self.now  # no sweep ran while the old manager stopped (it waits for its transitions)

    async def stop_during_hung_load(self, model: str, action: str = "stop") -> None:
        """A load that hangs until cancelled, then ``action`` arrives during it: a stop (Ctrl-C; a new control
        plane starts after it), an unload, a delete or a republish. The action must not wait for the load."""
        if self.paused_since is not None or not self.store.exists(model):
            return
        self.triton.script_load(model, "hang", 0.05)
        await self.request(model)
        await asyncio.sleep(1.0)
        if action != "stop":
            others = [c for c in self.calls if c.model == model and c.what != "request" and not c.task.done()]
            # the request may have found the model loaded: then no load hangs (the script waits for a later one,
            # which may be the action's own: a republish's reload waits for the new version's load)
            rec = self.manager.states.get(model)
            hung = rec is not None and rec.state is ModelState.LOADING and rec.op is not None
            await {"unload": self.api_unload, "delete": self.delete, "publish": self.publish}[action](model)
            if hung and not others and self.calls[-1].model == model:  # nothing ahead of it on the model's lock
                self.calls[-1].bound = CANCEL_BOUND
            return
        started, bound = self.now, CANCEL_BOUND
        if any(m.unloading is not None and m.finalize_secs > CANCEL_BOUND for m in self.triton.models.values()):
            # an unload whose finalize hangs is waited for within its own bound (the model's unload() gets its
            # time, then its processes are ended): a stop is not a kill (plain machine seed 976560240)
            bound = HEALTH_PROBE_SECS + self.settings.unload_finalize_secs + KILL_WAIT_SECS + 1.0
        await self.manager.stop()
        if self.now - started > bound:
            raise Violation(f"a stop during the hung load of '{model}' took {self.now - started:.1f}s")
        await self._settle_calls()
        await self._release_all()
        self.manager = self._manager()
        self.answers = ModelAnswers(self.manager, self.store, self.settings)
        self.holds = HoldRegistry(self.answers, self.root / "held.log", clock=self.clock)
        await self.manager.start()
        self.resumed_at = self.now

    async def _ask_room(self, stub: Stub) -> None:
        """A dozing stub's ask for room before its fork, as the wake route takes it (``create_wake_app``), within the
        stub's bound; a control plane that stops has no route to ask."""
        manager = self.manager
        if manager.states.stopping:
            return
        bound = DEFAULT_ADMIT_TIMEOUT_SECS
        key = (stub.pid, stub.start_ticks)
        try:
            answer = await asyncio.wait_for(manager.admit_doze_wake(stub.model, key, timeout=bound * 0.9), bound)
        except TimeoutError:
            answer = {"admitted": False, "why": f"no answer within {bound:g} s"}
        # a control plane paused or stopping makes no room (the next one's start enforces the budget, or the resume)
        if answer["why"] is not None and not answer["admitted"] and not manager.paused and not manager.states.stopping:
            # over the budget: only where no other loaded model could be evicted (in use, busy in Triton, in a
            # transition); the tree may then stay over it until one is free and the next sweep has run
            free = [
                r.id
                for r in manager.states.records.values()
                if r.id != stub.model and r.loaded and r.op is None and not r.in_use and not self.triton.pending[r.id]
            ]
            if free:
                self.overcommits.append(
                    f"a wake of '{stub.model}' went over the budget beside idle {free}: {answer['why']}"
                )
            self.stuck_at = self.now

    async def _release_all(self) -> None:
        while self.held:
            await self.release()

    # ------------------------------------------------------------------ invariants

    def check(self) -> None:
        problems = list(self.probe.violations) + list(self.triton.overlaps) + list(self.stale) + self.overcommits
        twice = [rid for rid, n in self.triton.executions.items() if n > 1]
        if twice:
            problems.append(f"requests executed twice: {twice}")
        extra = self.paused_secs + (self.now - self.paused_since if self.paused_since is not None else 0.0)
        for call in self.calls:
            if call.task.done():
                error = None if call.task.cancelled() else call.task.exception()
                if call.task.cancelled() or error is not None:
                    problems.append(f"{call.what} of '{call.model}' failed without an answer: {error!r}")
                else:
                    call.answer = call.task.result()
            elif self.now - call.started > call.bound + extra:
                problems.append(f"{call.what} of '{call.model}' unanswered after {self.now - call.started:.1f}s")
        problems += self._model_problems()
        states = self.manager.states
        active = {m: r.state for m, r in states.records.items() if r.state is not ModelState.UNLOADED}
        if states.active != active:  # what a listing filtered by state reads (LifecycleManager.states_of)
            problems.append(f"the states kept for listings {states.active} are not the records' {active}")
        for ensemble, published in self.triton.ensemble_misses:  # the steps published when the load met them
            if published:  # the real Triton loads them itself, behind the lifecycle (its records, its budget)
                problems.append(f"ensemble '{ensemble}' loaded while its published step(s) {published} were not")
        self.triton.ensemble_misses.clear()
        for model, unloads in self.held.values():
            if unloads is not None and self._unloads(model) > unloads:
                problems.append(f"'{model}' was unloaded for idleness or memory while a stream held it")
        if problems:
            raise Violation("; ".join(problems))
        self.answered += [c for c in self.calls if c.task.done()]
        self.calls = [c for c in self.calls if not c.task.done()]

    def _woke_unheard(self, rec: ModelRecord) -> bool:
        """A stub that a batch woke while the record lists it dozing (the control plane is not on the warm path: it
        hears and measures a wake at its next sweep, ``Dozing.hear_dozing``); or a model with stubs that doze or dozed
        whose record of the doze a state change ended since (a reload in place, failed or not): the next sweep asks
        its stubs again and measures them (``Dozing._find_dozing``); or a wake the sweep still running heard (it
        enforces the budget after hearing: judged at its end, dozing machine seed 3024910981)."""
        m = self.triton.models.get(rec.id)
        if m is None:
            return False
        if self.sweep_started is not None and rec.access.woke >= self.sweep_started:
            return True  # heard by the sweep still running, which enforces the budget after it (seed 3024910981)
        woke = any(s.awake_memory is None and (s.pid, s.start_ticks) in rec.doze.stubs for s in m.stubs)
        dozed = any(s.awake_memory is not None or s.woke_at >= 0 for s in m.stubs)
        return woke or (dozed and rec.doze.checked != rec.generation)

    def _override_problems(self, rec: ModelRecord | None, held: bool) -> list[str]:
        """A client's override holds through every load of the model until a load without one."""
        if rec is None or not rec.loaded or not rec.load.config_override or not held:
            return []
        want = rec.load.config_override["max_batch_size"]
        got = int(self.triton.models[rec.id].config.get("max_batch_size") or 0)
        if got == want:
            return []
        return [f"'{rec.id}' loaded with max_batch_size {got}, the client's override says {want}"]

    def _cancelled_problems(self, rec: ModelRecord | None) -> list[str]:
        """A model whose load was cancelled (cancel.py) holds no process and no memory budget."""
        if rec is None or not (rec.reason or "").startswith("load cancelled"):
            return []
        problems = []
        if self.processes.stubs(rec.id):
            problems.append(f"'{rec.id}' had its load cancelled but its model processes live on")
        if rec.memory.reserved or rec.memory.gpu_reserved or rec.holds_memory:
            problems.append(f"'{rec.id}' had its load cancelled but still holds memory budget")
        return problems

    def _model_problems(self) -> list[str]:
        problems = []
        m = self.manager
        holding = self.triton.holding()
        records = m.states.records
        busy = {c.model for c in self.calls if not c.task.done()}
        for model in sorted(set(holding) | set(records)):
            rec = records.get(model)
            if rec is not None and rec.op is not None:
                continue  # a transition runs: Triton and the record may differ until it ends
            if self.triton.loads_in_flight[model]:
                continue
            problems += self._cancelled_problems(rec)
            leaving = self.triton.models[model].state == "UNLOADING" if model in holding else False
            # a model Triton holds that this manager did not load: deleted (the rule below gives it time), or
            # published since Triton loaded it (the next sweep's resync adopts it, or counts it while it leaves)
            since = max(self.changed.get(model, -1e9), self.resumed_at)
            recent = self.paused_since is not None or self.now - since < 2 * self.settings.sweep_interval_secs + 1
            orphan = (rec is None and not self.store.exists(model)) or (recent and (rec is None or not rec.loaded))
            uncounted = (rec is None or not rec.holds_memory) and model not in m.budget.unrecorded
            if model in holding and uncounted and not orphan and not (leaving and rec is None):
                state = rec.state.value if rec is not None else "no record"
                where = self.triton.models[model].state
                problems.append(f"Triton holds '{model}' ({where}) but the manager says {state}")
            elif rec is not None and rec.loaded and model not in holding:
                problems.append(f"the manager says '{model}' is {rec.state.value}; Triton does not hold it")
            elif rec is not None and self._woke_unheard(rec):
                continue  # a request woke a dozing stub on Triton's side: the next sweep hears and measures it
            elif rec is not None and rec.loaded and all(s.alive for s in self.triton.models[model].stubs):
                # a stub grows at its first request (``growth``): counted ahead (a model loaded again as it was) or
                # from the next sweep on; without growth, exactly what its stubs hold
                stubs = self.triton.models[model].stubs
                growth = self.triton.growth.get(model, 0)
                base = holding[model] - growth * sum(s.grown for s in stubs)
                if not base <= (rec.memory.footprint or 0) <= base + growth * len(stubs):
                    problems.append(
                        f"'{model}' accounted {rec.memory.footprint} bytes, its stubs hold {holding[model]}"
                    )
            problems += self._override_problems(rec, model in holding and not leaving)
            gone = self.deleted.get(model)
            if gone is not None and model not in busy and not self.store.exists(model):
                follow = max(self.settings.store_poll_secs, 2 * self.settings.sweep_interval_secs) + 1
                since = max(gone, self.resumed_at)
                wait = follow + 2 * (LOAD_TIMEOUT + LOAD_ABANDON_SECS)
                settled = self.paused_since is None and self.now - since > wait
                lingering = (
                    rec is not None and rec.memory.triton_may_hold and model in holding
                )  # counted until Triton lets go
                if (rec is not None or (model in holding and not leaving)) and settled and not lingering:
                    problems.append(
                        f"deleted model '{model}' survives (record: {rec is not None}, in Triton: {model in holding})"
                    )
        # memory in flux while Triton unloads something is not judged (left undone: a model whose unload hangs
        # across a restart of this control plane is counted only once a sweep sees it again)
        # (a wake from doze is judged while unheard too: its stub asked room before it forked, ``_ask_room``),
        # nor while the lifecycle is paused or its first sweep after has not run: no sweep enforces the budget then
        # (plain machine seed 2028529355: a publish during a pause met a reload in flight, which Triton then built
        # from the new files at 200 MiB against the 60 it was admitted for; the load's own enforcement evicted the
        # idle model it could and left the model just loaded, and the one left was held by a stream)
        swept = self.paused_since is None and self.now - self.resumed_at > 2 * self.settings.sweep_interval_secs + 1
        quiet = (
            swept
            and all(r.op is None for r in records.values())
            and not any(self.triton.loads_in_flight.values())
            and all(m.state != "UNLOADING" for m in self.triton.models.values())
        )
        budget = self.manager.budget.budget_mb  # the setting, else the cgroup's limit less its headroom
        # and wakes from doze while the lifecycle was paused: no sweep enforces the budget after them (dozing machine
        # seed 3954049102: two models woken by requests straight to Triton during a pause, 530 MiB of 300 + 200)
        unenforced = self.triton.woken_unenforced
        if budget is not None and self.triton.peak > budget * MIB + self.triton.largest + unenforced:
            problems.append(
                f"Triton's tree held {self.triton.peak / MIB:.0f} MiB at its peak, over the budget plus one model "
                f"({budget:g} + {self.triton.largest / MIB:.0f} MiB"
                + (f", and {unenforced / MIB:.0f} MiB woken from doze while paused)" if unenforced else ")")
            )
        if quiet and budget is not None and not self._woken_beside_models_in_use(records):
            used = self.triton.server_bytes() + sum(holding.values())
            if used > budget * MIB and len(holding) > 1:
                problems.append(f"Triton holds {used / MIB:.0f} MiB in {sorted(holding)}, over the budget")
        return problems

    def _woken_beside_models_in_use(self, records: dict[str, ModelRecord]) -> bool:
        """A wake from doze whose stub's ask for room went over the budget (``_ask_room``: only where no other loaded
        model could be evicted, or the world flags it): the tree stays over the budget until one is free and the next
        sweep after that evicts (dozing machine seed 2487831979: three models held, one woken by a request straight
        to Triton). The peak check above still bounds it. Every other wake was admitted before its fork: the budget
        is judged while it is unheard too."""
        return self.now - self.stuck_at < 2 * self.settings.sweep_interval_secs + 1
