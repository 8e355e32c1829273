"""uvicorn servers that run inside the control plane's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn

from controlplane.errors import SnoozeError

STARTED_POLL_SECS = 0.01


class EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside our loop: the process that runs it owns SIGINT/SIGTERM, not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def wait_started(server: uvicorn.Server, task: asyncio.Task[None], what: str, hint: str | None = None) -> None:
    """Return once ``server``, served by ``task``, accepts connections. If ``task`` ends first: uvicorn's own
    start-up error, else ``SnoozeError(what, hint=hint)``."""
    while not server.started:
        if task.done():
            await task  # raises uvicorn's start-up error
            raise SnoozeError(what, hint=hint)
        await asyncio.sleep(STARTED_POLL_SECS)
