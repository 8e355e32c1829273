"""The one clock the lifecycle and the gateway's holds read.

Passed in rather than read from the ``time`` module, so a test can run the lifecycle on virtual time by
handing every part the same clock (``tests/model``), instead of patching ``time`` module by module.
``time()`` is wall time (what status shows, what the request journal writes); ``monotonic()`` is what
deadlines and idle timers measure.
"""

from __future__ import annotations

import time as _time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float: ...

    def monotonic(self) -> float: ...


class SystemClock:
    """The machine's clocks."""

    def time(self) -> float:
        return _time.time()

    def monotonic(self) -> float:
        return _time.monotonic()


SYSTEM_CLOCK: Clock = SystemClock()
