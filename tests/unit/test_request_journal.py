"""The request journal: what the runtime's writer records, the control plane's reader finds (both take the
names and the layout from python_backend/journal.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from controlplane.triton import journal as reader
from controlplane.triton.processes import StubProcess, read_stat
from python_backend import journal as writer


class FakeRequest:
    def __init__(self, parameters: dict[str, object]) -> None:
        self._parameters = json.dumps(parameters, separators=(",", ":"))

    def parameters(self) -> str:
        return self._parameters


def me() -> StubProcess:
    stat = read_stat(os.getpid())
    assert stat is not None
    return StubProcess(os.getpid(), stat.start_ticks, "m", "m_0_0")


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ('{"x-request-id":"abc-1"}', "abc-1"),
        ('{"foo":1,"x-request-id":"abc-2","bar":"x"}', "abc-2"),
        ('{"x-request-id": "spaced"}', "spaced"),
        ('{"X-Request-Id":"capitals"}', "capitals"),
        ('{"foo":1}', ""),
        ("{}", ""),
    ],
)
def test_request_id_from_parameters(parameters, expected):
    assert writer.request_id(parameters) == expected


def test_the_reader_finds_the_last_batch_the_writer_recorded(tmp_path: Path):
    journal = writer.RequestJournal(str(tmp_path))
    assert writer.start_ticks() == me().start_ticks  # both sides name this process the same way
    assert reader.read_journal(tmp_path, me()) == set()
    journal.record([FakeRequest({"x-request-id": f"r{i}"}) for i in range(3)])
    assert reader.read_journal(tmp_path, me()) == {"r0", "r1", "r2"}
    journal.record([FakeRequest({"x-request-id": "last"}), FakeRequest({})])
    assert reader.read_journal(tmp_path, me()) == {"last"}  # only the batch now running
    journal.close()
    assert reader.read_journal(tmp_path, me()) is None  # a clean unload leaves nothing


def test_a_batch_of_one_and_an_oversized_batch_are_journaled(tmp_path: Path):
    journal = writer.RequestJournal(str(tmp_path))
    try:
        journal.record([FakeRequest({"x-request-id": "only"})])
        assert reader.read_journal(tmp_path, me()) == {"only"}
        ids = [f"{i:08d}-{'x' * 60}" for i in range(2000)]  # ~140 KB of ids: more than the journal holds
        journal.record([FakeRequest({"x-request-id": i}) for i in ids])
        kept = reader.read_journal(tmp_path, me())
        assert ids[0] in kept and len(kept) < len(ids) and len(kept - set(ids)) <= 1  # at most one id cut short
        journal.record([FakeRequest({})])
        assert reader.read_journal(tmp_path, me()) == set()
    finally:
        journal.close()


def test_the_trailer_says_whether_the_process_is_idle(tmp_path: Path):
    """What the fast eviction reads: busy from a batch's record until it is done, when it ended, and whether the
    model declares unload(); an oversized batch never overwrites it."""
    journal = writer.RequestJournal(str(tmp_path))
    try:
        assert reader.read_activity(tmp_path, me()) == reader.Activity(False, 0, False)  # a fresh stub: idle
        journal.declare(unload=True)
        journal.record([FakeRequest({"x-request-id": f"{i:08d}-{'x' * 60}"}) for i in range(2000)])
        running = reader.read_activity(tmp_path, me())
        assert running is not None and running.busy and running.declares_unload and running.last_end_ns == 0
        before = time.monotonic_ns()
        journal.batch_done()
        done = reader.read_activity(tmp_path, me())
        assert done is not None and not done.busy and before <= done.last_end_ns <= time.monotonic_ns()
        journal.declare(unload=False)
        assert not reader.read_activity(tmp_path, me()).declares_unload  # type: ignore[union-attr]
    finally:
        journal.close()
    assert reader.read_activity(tmp_path, me()) is None


def test_no_journal_dir_means_no_journal(monkeypatch, tmp_path: Path):
    monkeypatch.delenv(writer.JOURNAL_ENV, raising=False)
    assert writer.RequestJournal.from_environment() is None
    monkeypatch.setenv(writer.JOURNAL_ENV, str(tmp_path / "missing"))
    assert writer.RequestJournal.from_environment() is None  # unusable: the model still serves
    monkeypatch.setenv(writer.JOURNAL_ENV, str(tmp_path))
    journal = writer.RequestJournal.from_environment()
    assert journal is not None
    journal.close()


def test_stale_journals_are_removed(tmp_path: Path):
    journal = writer.RequestJournal(str(tmp_path))
    (tmp_path / "999999999-1.journal").write_bytes(b"\0\0\0\0")  # no such process
    (tmp_path / f"{os.getpid()}-1.journal").write_bytes(b"\0\0\0\0")  # this pid, another start: reused
    assert reader.remove_stale(tmp_path) == 2
    assert [p.name for p in tmp_path.iterdir()] == [Path(journal.path).name]
    journal.close()


class SequenceRequest:
    def __init__(self, correlation_id: int | str, flags: int = 0) -> None:
        self._id, self._flags = correlation_id, flags

    def correlation_id(self) -> int | str:
        return self._id

    def flags(self) -> int:
        return self._flags


def test_live_sequences_note_is_read_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A stateful model's process notes until when a sequence may be live; the control plane reads that bound."""
    from python_backend.sequences import SEQUENCE_END, SEQUENCE_START, SequenceNote

    monkeypatch.setenv(writer.JOURNAL_ENV, str(tmp_path))
    config = {"sequence_batching": {"max_sequence_idle_microseconds": 5_000_000}}
    assert SequenceNote.from_environment("m", {}) is None  # no sequence batcher: nothing noted
    note = SequenceNote.from_environment("m", config)
    assert note is not None
    assert reader.sequences_until(tmp_path, me()) == 0.0  # nothing written yet
    note.record([SequenceRequest(7, SEQUENCE_START)], now=1000.0)
    assert reader.sequences_until(tmp_path, me()) >= 1005.0  # live until its last request is 5 s old
    note.record([SequenceRequest(8, SEQUENCE_START)], now=1000.5)  # within the note's slack: no write needed
    note.record([SequenceRequest(7)], now=1003.0)
    assert reader.sequences_until(tmp_path, me()) >= 1008.0
    note.record([SequenceRequest(7, SEQUENCE_END), SequenceRequest(0)], now=1004.0)  # and an idle slot's null request
    assert reader.sequences_until(tmp_path, me()) >= 1008.0  # sequence 8 is still live
    note.record([SequenceRequest(8, SEQUENCE_END), SequenceRequest(0)], now=1004.5)
    assert reader.sequences_until(tmp_path, me()) == 0.0  # the last one ended
    note.record([SequenceRequest(9, SEQUENCE_START | SEQUENCE_END)], now=1005.0)  # a one-request sequence
    assert reader.sequences_until(tmp_path, me()) == 0.0
    note.close()
    assert not list(tmp_path.iterdir())


def test_the_phase_a_stub_or_its_worker_notes_names_where_a_load_hangs(tmp_path, monkeypatch):
    monkeypatch.setenv(writer.JOURNAL_ENV, str(tmp_path))
    stub = me()
    assert reader.hung_phase(tmp_path, [stub]) is None  # no note: nothing to say
    writer.note_phase("warm-up")
    phase = reader.hung_phase(tmp_path, [stub], now=time.time() + 12)
    assert phase is not None and phase.startswith("its warm-up (for 12.") and f"model process pid {stub.pid})" in phase
    writer.note_phase("load", stub=(stub.pid, stub.start_ticks))  # as a preforked worker writes it
    assert reader.hung_phase(tmp_path, [stub]).startswith("its load (for 0.")
    writer.note_phase("ready")
    assert reader.hung_phase(tmp_path, [stub]) is None
    reader.remove_journal(tmp_path, stub)  # goes with the stub's other files
    assert list(tmp_path.iterdir()) == []
    assert reader.hung_phase(None, [stub]) is None
