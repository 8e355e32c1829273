"""Live sequences of a stateful model's process, for the control plane: the write side.

Triton's statistics do not say whether a sequence is open, and the state of one lives in the model's
process: an unload, an eviction or an instance fewer would end it. So the runtime notes, from the requests
it is given (``correlation_id()``, the START / END flags; the direct strategy's null requests, which fill idle
batch slots with correlation id 0, are not sequences), until when one of its sequences may still be
live: ``<journal dir>/<pid>-<start ticks>.sequences``, JSON ``{"model", "live", "until"}`` (epoch seconds;
0 when none is live). A sequence is live from its START until its END, or until its last request is
``max_sequence_idle_microseconds`` old (Triton's own limit: it ends the sequence then). The control plane
(``controlplane/lifecycle/sequences.py``) counts the model as in use while ``until`` is ahead.

Written only when ``until`` moves past what the file says (then ``REFRESH_SECS`` ahead of the truth, so
a sequence sending requests rewrites it about once per ``REFRESH_SECS``) or when the last live sequence
ends: the file never says less than the truth, and the request path mostly only reads the clock.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from .journal import JOURNAL_ENV, SEQUENCES_SUFFIX, own_file

REFRESH_SECS = 1.0
# TRITONSERVER_RequestFlag: the first and the last request of a sequence.
SEQUENCE_START, SEQUENCE_END = 1, 2


def max_idle_secs(model_config: dict[str, Any]) -> float | None:
    """Triton's idle limit of a sequence from the model's config (its default, 1 s, when unset); None
    when the model has no sequence batcher."""
    batching = model_config.get("sequence_batching")
    if batching is None:
        return None
    micros = int(batching.get("max_sequence_idle_microseconds") or 0)
    return micros / 1e6 if micros > 0 else 1.0


class SequenceNote:
    def __init__(self, path: str, model_id: str, max_idle: float) -> None:
        self.path = path
        self.model_id = model_id
        self.max_idle = max_idle
        self.live: dict[Any, float] = {}  # correlation id -> its last request (epoch seconds)
        self.written = 0.0  # what the file says

    @classmethod
    def from_environment(cls, model_id: str, model_config: dict[str, Any]) -> SequenceNote | None:
        """A note in $SNOOZE_JOURNAL_DIR for a model with a sequence batcher; None otherwise."""
        directory = os.environ.get(JOURNAL_ENV)
        max_idle = max_idle_secs(model_config)
        if not directory or max_idle is None:
            return None
        try:
            return cls(own_file(directory, SEQUENCES_SUFFIX), model_id, max_idle)
        except OSError:
            return None

    def record(self, requests: list[Any], now: float | None = None) -> None:
        now = time.time() if now is None else now
        live = self.live
        for request in requests:
            key = request.correlation_id()
            if not key:  # 0 or "": the direct strategy's null request for an idle batch slot, no sequence
                continue
            if request.flags() & SEQUENCE_END:
                live.pop(key, None)
            else:
                live[key] = now
        if not live:
            if self.written:
                self._write(0.0)
            return
        until = now + self.max_idle  # the newest request is this batch's
        if until > self.written:
            stale = now - self.max_idle
            for key in [k for k, at in live.items() if at < stale]:  # Triton has ended those
                del live[key]
            self._write(until + REFRESH_SECS)

    def _write(self, until: float) -> None:
        data = json.dumps({"model": self.model_id, "live": len(self.live), "until": until})
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except OSError:
            return
        self.written = until

    def close(self) -> None:
        """A clean end (unload): the note goes with the process."""
        try:
            os.unlink(self.path)
        except OSError:
            pass
