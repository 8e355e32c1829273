"""`snoozectl serve --models`: publish the packages in the background, after the gateway and the API are live.

``Publishing`` is the run's progress, read by the activator (a request for a model still waiting gets a retryable
answer naming it, and moves it to the front), by the control API (``GET /v1/publishing``, the status summary) and
by the console's progress line. ``publish_all`` does the work in one worker thread: a package whose content hash
(``source_hash``) matches the one its published folder was written from is adopted as it is, the others are
rendered and written (one rename each; in a large run a helper process renders and writes part of them, and this
thread commits every one: ``controlplane.store.stager``), and a republished model that is loaded is reloaded
(``on_published``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.markup import escape

from controlplane.errors import SnoozeError
from controlplane.spec import DeploymentSpec
from controlplane.store import ModelStore
from controlplane.store.stager import HELPER_FROM, Stager, StagerGone, refusal, stage
from controlplane.store.transactions import recover_staging

log = logging.getLogger("snoozeml.publishing")

# A request for a model still waiting to be published waits this long for it (it is published next), then gets a 503
# with this Retry-After.
ARRIVAL_WAIT_SECS, ARRIVAL_POLL_SECS = 10.0, 0.01
RETRY_AFTER_SECS = 1.0
SAY_EACH_UNDER = 100  # up to this many packages the console names each one published; beyond, the progress only
_RUNTIME_DIRS = ("python_backend", "model_repository_templates")


def runtime_fingerprint() -> str:
    """What every rendered folder also depends on besides its package: snoozeml's runtime and templates (an upgrade
    renders every model again)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for name in _RUNTIME_DIRS:
        for path in sorted((root / name).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    for path in sorted((root / "controlplane").glob("render*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def source_hash(deployment: DeploymentSpec, target: str, runtime: str) -> str:
    """The content hash of what a model folder is rendered from: the deployment, every file of the package (names
    and bytes), the Triton target and snoozeml's runtime."""
    digest = hashlib.sha256()
    digest.update(deployment.model_dump_json(exclude={"path"}).encode() + b"\0" + target.encode() + runtime.encode())
    root = Path(deployment.path)
    files = sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


@dataclass
class Publishing:
    """The progress of one publishing run; thread-safe (the worker writes, the event loop reads)."""

    total: int = 0
    published: int = 0
    unchanged: int = 0  # adopted as found: their content hash had not changed
    failed: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    finished: float | None = None
    _pending: dict[str, DeploymentSpec] = field(default_factory=dict)
    _urgent: deque[str] = field(default_factory=deque)
    _taken: set[str] = field(default_factory=set)  # being written now (by the control plane, or its helper)
    _stopped: bool = False  # stop(): what is given back waits for the next start
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def plan(self, deployments: Iterable[DeploymentSpec]) -> None:
        with self._lock:
            for deployment in deployments:
                self._pending[deployment.id] = deployment
            self.total = len(self._pending) + self.done
            self.finished, self._stopped = None, False

    @property
    def done(self) -> int:
        return self.published + self.unchanged + len(self.failed)

    @property
    def in_progress(self) -> bool:
        return self.finished is None and self.total > 0

    def waiting(self, model_id: str) -> bool:
        """Whether ``model_id`` is still waiting to be published in this run; if so it goes to the front."""
        with self._lock:
            if model_id in self._taken:
                return True
            if model_id not in self._pending:
                return False
            self._urgent.append(model_id)
            return True

    async def arrival(self, model_id: str, timeout: float = ARRIVAL_WAIT_SECS) -> None:
        """Wait (at most ``timeout`` seconds) while ``model_id`` is still waiting to be published; it goes first."""
        deadline = time.monotonic() + timeout
        while self.waiting(model_id) and time.monotonic() < deadline:
            await asyncio.sleep(ARRIVAL_POLL_SECS)

    def next(self) -> DeploymentSpec | None:
        """The next package to publish (one a request asked for first), or None when all are done."""
        with self._lock:
            while self._urgent:
                deployment = self._pending.pop(self._urgent.popleft(), None)
                if deployment is not None:
                    self._taken.add(deployment.id)
                    return deployment
            if not self._pending:
                return None
            deployment = self._pending.pop(next(iter(self._pending)))
            self._taken.add(deployment.id)
            return deployment

    def give_back(self, deployment: DeploymentSpec) -> None:
        """A package taken but not written (its helper died): next again, first."""
        with self._lock:
            self._taken.discard(deployment.id)
            if not self._stopped:
                self._pending[deployment.id] = deployment
                self._urgent.appendleft(deployment.id)

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def waiting_count(self) -> int:
        with self._lock:
            return len(self._pending)

    def describe(self) -> dict[str, Any]:
        """What ``GET /v1/publishing`` answers."""
        with self._lock:
            end = self.finished if self.finished is not None else time.time()
            return {
                "in_progress": self.in_progress,
                "total": self.total,
                "done": self.done,
                "published": self.published,
                "unchanged": self.unchanged,
                "failed": dict(self.failed),
                "waiting": len(self._pending),
                "elapsed_secs": round(end - self.started, 3),
            }

    def note(self, model_id: str, *, unchanged: bool = False, failed: str | None = None) -> None:
        """One package done: published, adopted unchanged, or failed (with why)."""
        with self._lock:
            self._taken.discard(model_id)
            if failed is not None:
                self.failed[model_id] = failed
            elif unchanged:
                self.unchanged += 1
            else:
                self.published += 1

    def stop(self) -> None:
        """No more packages in this run (a stop): the one being written finishes, the rest wait for the next start."""
        with self._lock:
            self._pending.clear()
            self._urgent.clear()
            self._stopped = True

    def finish(self) -> None:
        with self._lock:
            self.finished = time.time()
            self._taken.clear()

    def retry_hint(self, model_id: str) -> str:
        return (
            f"model '{model_id}' is waiting to be published ({self.done} of {self.total} done since the server "
            f"started); retry in {RETRY_AFTER_SECS:g}s"
        )


def publish_all(
    store: ModelStore,
    progress: Publishing,
    *,
    say: Callable[[str], None],
    on_published: Callable[[str], None] | None = None,
    helper_from: int = HELPER_FROM,
) -> None:
    """Publish every package ``progress`` plans (blocking: run it in a worker thread). A broken package is said and
    skipped: it must not keep the others from being served. A run with ``helper_from`` packages or more still to
    write hands part of them to a helper process, which stages them while this one stages the others and commits
    every one (``controlplane.store.stager``: two threads were slower than one, two processes are faster)."""
    run = _Run(store, progress, say, on_published)
    try:
        while True:
            while (deployment := progress.next()) is not None:
                run.one(deployment, helper_from)
            # a stop does not wait for the helper: what it staged and nobody committed goes with it (retire)
            run.answers(wait=not progress.stopped)
            if progress.stopped or not progress.waiting_count:  # else the helper died: what it held is back
                break
    finally:
        run.retire()
    progress.finish()
    store.save_catalog()  # the next start reads no unchanged record


class _Run:
    """One ``publish_all``: what is known published, and the helper process once started."""

    def __init__(
        self,
        store: ModelStore,
        progress: Publishing,
        say: Callable[[str], None],
        on_published: Callable[[str], None] | None,
    ) -> None:
        self.store, self.progress, self.say, self.on_published = store, progress, say, on_published
        self.runtime = runtime_fingerprint()
        self.known = {m.id: m.source_hash for m in store.list()}
        t = store.target
        self.target = f"{t.name}:{','.join(sorted(t.backends))}:{t.python_version}"
        self.helper: Stager | None = None
        self.tried = False  # the helper is started once a run at most

    def one(self, deployment: DeploymentSpec, helper_from: int) -> None:
        """Adopt the package unchanged, or stage it (here, or handed to the helper) and commit it."""
        try:
            digest = source_hash(deployment, self.target, self.runtime)
            if self.known.get(deployment.id) == digest:
                self.progress.note(deployment.id, unchanged=True)
                return
            if not self.tried and self.progress.waiting_count + 1 >= helper_from:
                self.tried, self.helper = True, Stager.start(self.store.repository, self.store.target)
                if self.helper is not None:
                    self.say(f"publishing with a helper process (pid {self.helper.proc.pid}) beside this one")
            if self.helper is not None and self.helper.room:
                try:
                    self.helper.submit(deployment, digest)
                except StagerGone as e:
                    self.gone(str(e))
                return
            staged = stage(deployment, self.store.repository, self.store.target, digest)
        except (SnoozeError, OSError) as exc:
            self.refused(deployment.id, refusal(exc))
            return
        finally:
            self.answers(wait=False)
        self.commit(deployment, staged)

    def refused(self, model_id: str, why: tuple[str, str | None]) -> None:
        """One broken package must not keep the others from being served: say why (message, hint) and go on."""
        message, hint = why
        self.progress.note(model_id, failed=f"{message} (fix: {hint})" if hint else message)
        self.say(f"[red]refused {model_id}:[/] {escape(message)}{escape(f' (fix: {hint})' if hint else '')}")

    def commit(self, deployment: DeploymentSpec, staged: Path) -> None:
        try:
            published = self.store.commit(staged, deployment.id)
        except (SnoozeError, OSError) as exc:
            self.refused(deployment.id, refusal(exc))
            return
        self.progress.note(deployment.id)
        if self.progress.total <= SAY_EACH_UNDER:
            self.say(f"published [bold]{published.id}[/] ({published.kind} -> {published.backend})")
        for note in published.notes:
            self.say(f"  note: {escape(note)}")
        if deployment.id in self.known and self.on_published is not None:
            self.on_published(deployment.id)  # republished: a loaded model reloads

    def answers(self, *, wait: bool) -> None:
        """Commit the helper's answers that are in (``wait``: all it holds)."""
        while self.helper is not None and self.helper.held and (wait or self.helper.ready()):
            try:
                deployment, staged, failed = self.helper.take()
            except StagerGone as e:
                self.gone(str(e))
                return
            if staged is not None:
                self.commit(deployment, staged)
            else:
                self.refused(deployment.id, failed or ("its helper did not stage it", None))

    def gone(self, why: str) -> None:
        """The helper died or stopped answering: it is ended, the packages it held are published here (first), and
        what it left half-written goes."""
        helper, self.helper = self.helper, None
        if helper is None:
            return
        log.warning("publishing helper gone (%s): the control plane writes the %d it held", why, len(helper.held))
        for deployment in reversed(helper.held):
            self.progress.give_back(deployment)
        helper.held.clear()
        self._end(helper)

    def retire(self) -> None:
        if self.helper is not None:
            helper, self.helper = self.helper, None
            self._end(helper)

    def _end(self, helper: Stager) -> None:
        """End the helper (bounded), then remove what it staged and nobody committed (its pid is gone now)."""
        helper.close()
        recover_staging(self.store.repository)
