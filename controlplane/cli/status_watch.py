"""`snoozectl status --watch`: the status, refreshed until Ctrl-C, with what changed between refreshes.

Each refresh reads the models and the runtime (two API calls). A change is a model published or deleted, a new
state or level (dozing), an instance count, or a wake (its load count went up). With ``--json`` each refresh is one
line of JSON (``{"time", "models", "changes"}``) for scripts; on a terminal the table is redrawn in place. A server
that stops answering is said on the screen and asked again at the next refresh; Ctrl-C or SIGTERM ends the watch
with 0.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from rich.console import Group, RenderableType
from rich.live import Live
from rich.text import Text

from controlplane.cli.output import out_console
from controlplane.errors import SnoozeError

CHANGES_SHOWN = 12  # the most recent changes under the table


def _shape(status: dict[str, Any]) -> str:
    state = str(status.get("state", "?"))
    return f"{state} (dozing)" if state == "ready" and status.get("level") == "dozing" else state


def _memory(nbytes: int | None) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes else "no memory"


def status_changes(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[str]:
    """What changed from one refresh's statuses (model id -> status) to the next, one line per change, by model."""
    lines = []
    for model_id in sorted(before.keys() | after.keys()):
        old, new = before.get(model_id), after.get(model_id)
        if old is None:
            lines.append(f"{model_id}: published ({_shape(new or {})})")
            continue
        if new is None:
            lines.append(f"{model_id}: deleted")
            continue
        woke = int(new.get("load_count") or 0) - int(old.get("load_count") or 0)
        if woke > 0:
            took = new.get("last_cold_start_secs")
            lines.append(
                f"{model_id}: loaded {'once' if woke == 1 else f'{woke} times'}"
                + (f" (last cold start {took:.2f}s)" if took is not None else "")
            )
        if _shape(old) != _shape(new):
            lines.append(f"{model_id}: {_shape(old)} -> {_shape(new)} ({_memory(new.get('memory_bytes'))})")
        elif old.get("instances") != new.get("instances"):
            lines.append(f"{model_id}: {old.get('instances')} -> {new.get('instances')} instances")
    return lines


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM ends the watch as Ctrl-C does (a supervisor's stop, or a parent that had SIGINT ignored for its
    children, as a background job's shell does); only the main thread may set a handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Watch:
    """The refresh loop; ``read`` returns (models, runtime) as the API gives them, ``render`` the screen for them."""

    def __init__(
        self,
        read: Callable[[], tuple[list[dict[str, Any]], dict[str, Any]]],
        render: Callable[[list[dict[str, Any]], dict[str, Any]], Iterable[RenderableType]],
        *,
        interval: float,
        count: int,
        as_json: bool,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.read, self.render = read, render
        self.interval, self.count, self.as_json = interval, count, as_json
        self.clock, self.sleep = clock, sleep
        self.recent: deque[str] = deque(maxlen=CHANGES_SHOWN)
        self.seen: dict[str, dict[str, Any]] | None = None

    def run(self) -> None:
        """Refresh ``count`` times (0: until Ctrl-C or SIGTERM, each an ordinary end). The first read's error
        propagates (the command fails)."""
        with _sigterm_as_interrupt():
            if self.as_json:
                self._loop(lambda screen: None)
                return
            with Live(console=out_console, auto_refresh=False, transient=False) as live:
                self._loop(lambda screen: live.update(screen, refresh=True))

    def _loop(self, show: Callable[[RenderableType], None]) -> None:
        done = 0
        try:
            while True:
                show(self._refresh())
                done += 1
                if self.count and done >= self.count:
                    return
                self.sleep(self.interval)
        except KeyboardInterrupt:
            return

    def _refresh(self) -> RenderableType:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.clock()))
        try:
            models, runtime = self.read()
        except SnoozeError as e:
            if self.seen is None:
                raise
            if self.as_json:
                print(json.dumps({"time": self.clock(), "error": e.message}), flush=True)
            return Text(f"{stamp} the control plane did not answer: {e.message} (asking again)")
        statuses = {m["id"]: m["status"] for m in models}
        changes = status_changes(self.seen, statuses) if self.seen is not None else []
        self.seen = statuses
        self.recent.extend(f"{stamp} {line}" for line in changes)
        if self.as_json:
            print(json.dumps({"time": self.clock(), "models": models, "changes": changes}), flush=True)
            return Text("")
        every = f"every {self.interval:g}s" + (f", {self.count} times" if self.count else ", Ctrl-C to stop")
        changed = [Text("changes:" if self.recent else "changes: none yet")]
        changed += [Text(f"  {line}") for line in self.recent]
        return Group(Text(f"{stamp} snoozectl status ({every})"), *self.render(models, runtime), *changed)
