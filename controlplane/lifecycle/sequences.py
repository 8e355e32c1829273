"""Live sequences keep a stateful model in use.

A sequence's state lives in the model's process (Triton's sequence batcher sends every request of one
correlation id to the same instance): an idle unload, an eviction or an instance fewer would end it.
The runtime notes until when one of its sequences may be live (``python_backend/sequences.py``: from its
START request until its END, or until its last request is the model's ``max_sequence_idle_secs`` old,
when Triton ends it). At each sweep ``LiveSequences.refresh`` reads those notes for the models with a
``[models.sequence]`` and holds each model with a live sequence as one user (``ModelRecord.in_use``): the
one place idle unload, eviction (host and GPU) and scale-down already look at. Bounds: a sequence counts
from the first sweep after its START (before that its START request is the model's last access, as for
any request) until at most ``max_sequence_idle_secs`` (+1 s) after its last request.

A graceful stop and the snapshot quiesce wait for live sequences too (``LifecycleManager.wait_for_sequences``,
while the gateway still admits their requests), up to the bound they name.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from controlplane.lifecycle.state import ModelRecord, ModelState
from controlplane.triton.journal import sequences_note, sequences_until


class LiveSequences:
    def __init__(self, journal_dir: Path | None) -> None:
        self.journal_dir = journal_dir
        self.held: dict[str, ModelRecord] = {}  # model id -> the record it holds one user of

    def until(self, rec: ModelRecord) -> float:
        """Until when (epoch seconds) one of the model's sequences may be live; 0.0: none, or not visible."""
        if self.journal_dir is None or rec.model.deployment.sequence is None:
            return 0.0
        return max((sequences_until(self.journal_dir, stub) for stub in rec.procs.stubs), default=0.0)

    def live_counts(self, records: Iterable[ModelRecord], now: float) -> dict[str, int]:
        """{model: sequences live} of the READY models whose notes say one may still be live at ``now`` (a count
        of at least 1: a note's count may lag its bound by one write)."""
        counts: dict[str, int] = {}
        if self.journal_dir is None:
            return counts
        for rec in records:
            if rec.state is not ModelState.READY or rec.model.deployment.sequence is None:
                continue
            notes = [sequences_note(self.journal_dir, stub) for stub in rec.procs.stubs]
            live = sum(n for n, until in notes if until > now)
            if any(until > now for _, until in notes):
                counts[rec.id] = max(live, 1)
        return counts

    def refresh(self, records: Iterable[ModelRecord], now: float) -> None:
        """Hold every loaded model with a live sequence, release the others."""
        seen = set()
        for rec in records:
            seen.add(rec.id)
            live = rec.state is ModelState.READY and self.until(rec) > now
            held = self.held.get(rec.id)
            if held is not None and (held is not rec or not live):
                self._release(rec.id)
                held = None
            if live and held is None:
                rec.in_use += 1
                self.held[rec.id] = rec
        for model_id in [m for m in self.held if m not in seen]:
            self._release(model_id)

    def _release(self, model_id: str) -> None:
        rec = self.held.pop(model_id)
        rec.in_use -= 1

    def live(self, model_id: str) -> bool:
        return model_id in self.held

    def release_all(self) -> None:
        for model_id in list(self.held):
            self._release(model_id)


def describe_live(counts: dict[str, int]) -> str:
    """``live_counts``' answer in words: "2 live sequence(s) of model 'a', 1 of model 'b'"."""
    parts = [f"{n} of model '{m}'" for m, n in sorted(counts.items())]
    parts[0] = parts[0].replace(" of ", " live sequence(s) of ", 1)
    return ", ".join(parts)
