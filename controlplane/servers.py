"""uvicorn servers that run inside the control plane's own event loop."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn


class EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside our loop: the process that runs it owns SIGINT/SIGTERM, not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
