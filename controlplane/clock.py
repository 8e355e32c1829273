"""The one clock the lifecycle and the gateway's holds read.

``LifecycleManager(clock=...)`` hands its clock to every part that reads time (the supervisor, the request
path, the loader and its wake queue, the unloader, recovery, warmth), and ``HoldRegistry(clock=...)`` takes
the same one; the default is the machine's (``SYSTEM_CLOCK``). The fast tier (``tests/model``) hands them one
clock that reads its virtual-time event loop, so no ``time`` module is patched.

``time()`` is wall time (what status shows, what the request journal writes); ``monotonic()`` is what
deadlines and idle timers measure; ``sleep()`` is a short blocking wait inside a worker thread (the unloader's
poll for a stopped process), which a virtual clock skips: its thread runs inline on the event loop, so no other
task could run meanwhile. Coroutines wait with ``asyncio.sleep``, on the event loop's own clock.

What is not a time the lifecycle measures reads the machine: a config's generation token (unique across
restarts) and the age of a Pss reading of a real process (``triton.processes.held_split``).
"""

from __future__ import annotations

import time as _time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float: ...

    def monotonic(self) -> float: ...

    def sleep(self, secs: float) -> None: ...


class SystemClock:
    """The machine's clocks."""

    def time(self) -> float:
        return _time.time()

    def monotonic(self) -> float:
        return _time.monotonic()

    def sleep(self, secs: float) -> None:
        _time.sleep(secs)


SYSTEM_CLOCK: Clock = SystemClock()
