"""What a model's load warm-up did, and the warm-ups its traffic teaches (see controlplane/warmup_samples.py).

The runtime notes per model process the warm-up's source and, when generated inputs failed, why it was
skipped; after the first real request, that request's input shapes (``python_backend/warmup.py``). This
reads those notes for a loaded model: its status says the warm-up's source (``signature``, ``learned``,
``samples``) or why it was skipped, said once in the log; learned shapes are kept in the model's folder
(``learned_warmup.json``), where its next loads' runtime finds them.
"""

from __future__ import annotations

import logging
from pathlib import Path

from controlplane.lifecycle.state import ModelRecord, ModelState
from controlplane.warmup_samples import keep_learned, learned_shapes, plan_source, read_note

log = logging.getLogger("snoozeml.lifecycle")


def configured_source(rec: ModelRecord) -> str | None:
    """The source the published config declares, or None (no warm-up); ``learned`` once shapes were kept
    for a generated one."""
    try:
        recorded = rec.model.warmup_source  # written at publish; None for a model published before it was
        source = (recorded or None) if recorded is not None else plan_source(rec.model.config_text)
    except Exception:  # deleted or republished meanwhile: nothing to say
        return None
    if source == "signature" and rec.model.backend == "python" and (rec.load.learned or learned_shapes(rec.model.path)):
        return "learned"
    return source


def harvest(rec: ModelRecord, journal_dir: Path | None) -> None:
    """Read the notes of a loaded model's processes: its warm-up line, and learned shapes to keep."""
    if journal_dir is None or rec.state is not ModelState.READY or not rec.procs.stubs:
        return
    notes = [n for s in rec.procs.stubs if (n := read_note(journal_dir, s.pid, s.start_ticks)) is not None]
    if not notes:
        return
    skipped = next((n["skipped"] for n in notes if n.get("skipped")), None)
    source = next((n["source"] for n in notes if n.get("source")), None)
    line = skipped or source
    if line and line != rec.load.warmup:
        rec.load.warmup = line
        if skipped and skipped != rec.load.warmup_said:
            rec.load.warmup_said = skipped
            log.warning("model '%s': warmup: %s", rec.id, skipped)
    learned = next((n["learned"] for n in notes if isinstance(n.get("learned"), dict) and n["learned"]), None)
    if not learned or rec.model.backend != "python" or rec.load.learned == (rec.model.publish, learned):
        return  # nothing learned, or already kept for the next load (no file read at each sweep)
    if learned != learned_shapes(rec.model.path):
        rec.load.learned = (rec.model.publish, learned)
        shapes = ", ".join(f"{k} {v.get('shape')}" for k, v in learned.items())
        log.info("model '%s': learned its warm-up from traffic: %s (kept for its next load)", rec.id, shapes)


def keep_pending(rec: ModelRecord) -> None:
    """Write the shapes ``harvest`` learned into the model's folder, before a load of the model from unloaded: Triton
    reads the folder afresh for that load anyway, while a file written into a loaded model's folder is a change of
    the model to Triton, which loads it anew (its instances replaced) when a load next names it (an ensemble's)."""
    pending, rec.load.learned = rec.load.learned, None
    if pending is not None and pending[0] == rec.model.publish:  # learned from this publish, not an earlier one
        keep_learned(rec.model.path, pending[1])


def status_line(rec: ModelRecord) -> str | None:
    """The warm-up as ``snoozectl status`` and ``GET /v1/models/{id}`` say it: the last load's outcome, or
    what the published config will do."""
    return rec.load.warmup or configured_source(rec)
