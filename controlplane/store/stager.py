"""A publishing helper: a second process that renders and stages model folders while the first commits them.

Publishing thousands of packages is the file system's work: each model folder is a handful of folders and files made
(0.1-0.3 ms each on the VM this was measured on), system time that a second core does as well as the first. Threads
do not help (measured: 4.3 ms a package with two threads, 4.2 with one: the interpreter's lock changes hands at every
file operation); a second process does (2.7-3.0 ms a package with two, 4.1-4.8 with one, 3,000 packages). So a large
run (``publish_all``, ``HELPER_FROM`` packages or more to write) starts one helper. The helper only stages
(``store.stage_published``: render, validate, write the folder whole under the staging root); the control plane
commits every folder itself (one rename under the repository's lock) and keeps the catalog and the progress, so
nothing about a publish's order, its atomicity or what a request waiting for a model sees changes.

The helper reads work from its stdin and answers on its stdout, in order, as length-prefixed pickles (the same code on
both ends: it is this module, started with this interpreter). It ignores SIGINT (the control plane decides when
publishing stops) and exits at the end of its stdin, which a control plane that dies closes too. Where the helper
cannot start, dies, or stops answering within ``ANSWER_SECS``, the control plane stages what it held itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import IO, Any

from controlplane.errors import SnoozeError
from controlplane.render import TritonTarget
from controlplane.spec import DeploymentSpec, resolve

log = logging.getLogger("snoozeml.publishing")

# A run with at least this many packages to write starts the helper (a Python start costs about a second here, 300
# packages written).
HELPER_FROM = 300
# Packages handed to the helper ahead of its answers: enough that it never waits for the control plane, few enough
# that a package a request moved to the front waits behind little.
DEPTH = 4
# The longest the control plane waits for one answer (a package's render and write); then it stages itself.
ANSWER_SECS = 120.0
CLOSE_SECS = 5.0  # a helper told to stop (its stdin closed) exits within this; else it is killed
PR_SET_PDEATHSIG = 1
_LENGTH = struct.Struct("!I")


def _send(stream: IO[bytes], message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_LENGTH.pack(len(data)) + data)
    while view:  # an unbuffered pipe may take part of it
        written = stream.write(view)
        view = view[written if written is not None else len(view) :]
    stream.flush()


def _read_exactly(stream: IO[bytes], size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = stream.read(left)  # an unbuffered pipe returns what is there, at most ``left``
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive(stream: IO[bytes]) -> Any:
    """The next message, or EOFError at the end of the stream."""
    size = _LENGTH.unpack(_read_exactly(stream, _LENGTH.size))[0]
    return pickle.loads(_read_exactly(stream, size))  # noqa: S301 (this module's own messages, from its own child)


def stage(deployment: DeploymentSpec, repository: Path, target: TritonTarget, digest: str) -> Path:
    """Resolve and stage one package (``store.stage_published``): what the helper does, and the control plane with
    the packages it keeps."""
    from controlplane.store import stage_published

    return stage_published(resolve(deployment), repository, target, source_hash=digest)


def refusal(exc: SnoozeError | OSError) -> tuple[str, str | None]:
    """Why a package was refused: (message, hint)."""
    return (exc.message, exc.hint) if isinstance(exc, SnoozeError) else (str(exc), None)


class StagerGone(Exception):
    """The helper died or stopped answering: the deployments it held go back to the control plane."""


class Stager:
    """The control plane's end: ``submit`` a package, ``take`` the answers in the same order: ``(deployment,
    staged path, None)`` or ``(deployment, None, (message, hint))`` for a package refused."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.held: deque[DeploymentSpec] = deque()  # submitted, not answered yet

    @classmethod
    def start(cls, repository: Path, target: TritonTarget) -> Stager | None:
        """The helper process, or None where it cannot run (one core, or it fails to start: publishing goes on in
        one process)."""
        if len(os.sched_getaffinity(0)) < 2:
            return None
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            # fork and exec at once (the parent's thread pools are not copied into a running child)
            # unbuffered: ``ready`` asks the pipe itself, so no answer may wait in a buffer of this process (one that
            # did would be read only once another came, and the last ones after ANSWER_SECS)
            proc = subprocess.Popen(
                [sys.executable, "-m", "controlplane.store.stager"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                close_fds=True,
                bufsize=0,
            )
            assert proc.stdin is not None
            _send(proc.stdin, (str(repository), target))
        except OSError as e:
            log.warning("publishing in one process: its helper did not start (%s)", e)
            return None
        return cls(proc)

    @property
    def room(self) -> bool:
        return len(self.held) < DEPTH

    def submit(self, deployment: DeploymentSpec, digest: str) -> None:
        assert self.proc.stdin is not None
        try:
            _send(self.proc.stdin, (deployment, digest))
        except OSError as e:  # it died: what it held comes back with this one
            self.held.append(deployment)
            raise StagerGone(str(e)) from None
        self.held.append(deployment)

    def ready(self) -> bool:
        """An answer can be read without waiting."""
        assert self.proc.stdout is not None
        return bool(self.held) and bool(select.select([self.proc.stdout], [], [], 0)[0])

    def take(self) -> tuple[DeploymentSpec, Path | None, tuple[str, str | None] | None]:
        """The oldest package's answer, waiting at most ``ANSWER_SECS`` for it."""
        assert self.proc.stdout is not None and self.held
        if not select.select([self.proc.stdout], [], [], ANSWER_SECS)[0]:
            raise StagerGone(f"no answer within {ANSWER_SECS:g}s")
        try:
            model_id, staged, failed = _receive(self.proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            raise StagerGone(f"its answers ended ({type(e).__name__})") from None
        deployment = self.held.popleft()
        if model_id != deployment.id:  # out of step: nothing it says can be trusted
            self.held.appendleft(deployment)
            raise StagerGone(f"it answered for '{model_id}', not '{deployment.id}'")
        return deployment, Path(staged) if staged is not None else None, failed

    def close(self) -> None:
        """Stop it (its stdin closed: it exits once the package it stages is written), bounded."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(CLOSE_SECS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(CLOSE_SECS)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """The helper's loop: stage each package it is given, answer in order; until its stdin ends."""
    repository, target = _receive(stdin)
    repo = Path(repository)
    while True:
        try:
            deployment, digest = _receive(stdin)
        except EOFError:
            return
        started = time.monotonic()
        try:
            answer: tuple[str, str | None, tuple[str, str | None] | None] = (
                deployment.id,
                str(stage(deployment, repo, target, digest)),
                None,
            )
        except (SnoozeError, OSError) as e:
            answer = (deployment.id, None, refusal(e))
        log.debug("staged '%s' in %.1f ms", deployment.id, 1000 * (time.monotonic() - started))
        _send(stdout, answer)


def _die_with_parent() -> None:
    """SIGKILL when the control plane dies (Linux ``PR_SET_PDEATHSIG``; the thread that started it lives as long as
    the control plane's thread pool): a helper copying a large package does not outlive a second Ctrl-C."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # it died before that
        os._exit(0)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the control plane's to act on
    if sys.platform == "linux":
        _die_with_parent()
    with contextlib.suppress(BrokenPipeError):
        _serve(sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    main()
