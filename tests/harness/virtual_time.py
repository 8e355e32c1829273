"""Virtual time for the lifecycle's fast tier: an event loop whose clock jumps to the next timer when every task
waits (``VirtualTimeLoop``), the ``Clock`` that reads it (``VirtualTime``, handed to the lifecycle manager and
the gateway's holds), and ``Hang``, raised when nothing is left to wake a task."""

from __future__ import annotations

import asyncio
import selectors
from typing import Any

EPOCH = 1_790_000_000.0  # what time.time() says at virtual time 0


class Hang(AssertionError):
    """Every task waits and no timer is set: nothing can ever happen again."""


class _VirtualSelector(selectors.DefaultSelector):
    """Never blocks: where the loop would wait ``timeout`` seconds for its next timer, time jumps there."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[Any]:
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:
            raise Hang("the event loop has nothing ready and no timer: every task waits forever")
        assert self.loop is not None
        self.loop.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when every task waits: sleeps and timeouts take no real time.

    Only for code that never waits on a thread or a socket (``asyncio.to_thread`` must be inline).
    """

    def __init__(self) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0

    def time(self) -> float:
        return self.now


class VirtualTime:
    """A ``controlplane.clock.Clock`` whose clocks read the loop's."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self.loop = loop

    def time(self) -> float:
        return EPOCH + self.loop.now

    def monotonic(self) -> float:
        return self.loop.now

    def sleep(self, secs: float) -> None:
        """A blocking wait inside a worker thread (inline here): no virtual time passes."""
