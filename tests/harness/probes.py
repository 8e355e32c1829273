"""The small steps every live test takes: wait for a condition (``until``, ``until_async``), each with a bound and a
message that says what it waited for.

Standard library only: the Python 3.10 runtime run (``make test-runtime-py310``) imports this module without the
control plane's environment.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# What a wait waited for: a phrase, or a function asked at the timeout (to show the last state it saw).
What = str | Callable[[], str]


def _timed_out(what: What, timeout: float) -> AssertionError:
    return AssertionError(f"timed out after {timeout:g}s waiting for {what() if callable(what) else what}")


def until(condition: Callable[[], T], what: What, timeout: float = 90.0, interval: float = 0.1) -> T:
    """Call ``condition`` every ``interval`` seconds until it returns something truthy; that value. Fails after
    ``timeout`` seconds, naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout)
        time.sleep(interval)


async def until_async(
    condition: Callable[[], object], what: What, timeout: float = 60.0, interval: float = 0.1, *, in_thread: bool = True
) -> float:
    """``until`` from async code; the seconds it took. ``in_thread``: the condition blocks (HTTP calls, the process
    table), so it runs in a worker thread and the loop goes on serving; False for one that reads objects of the
    loop itself (they change only between its steps)."""
    started = time.monotonic()
    while not (await asyncio.to_thread(condition) if in_thread else condition()):
        if time.monotonic() - started >= timeout:
            raise _timed_out(what, timeout)
        await asyncio.sleep(interval)
    return time.monotonic() - started
