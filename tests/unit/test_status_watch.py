"""`snoozectl status --watch` (controlplane.cli.status_watch): what changed between two refreshes, and the refresh
loop's bounds (a count, Ctrl-C, a server that stops answering), against a stand-in API read."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest

from controlplane.cli.status_watch import Watch, status_changes
from controlplane.errors import SnoozeError

MIB = 2**20


def status(state: str = "unloaded", **fields: Any) -> dict[str, Any]:
    return {"state": state, "level": "awake", "instances": 0, "load_count": 0, "memory_bytes": None, **fields}


def test_a_wake_a_doze_and_an_unload_are_each_said() -> None:
    before = {"a": status(), "b": status("ready", instances=1, load_count=2), "c": status("ready", instances=1)}
    after = {
        "a": status("ready", instances=1, load_count=1, memory_bytes=64 * MIB, last_cold_start_secs=0.31),
        "b": status("ready", instances=1, load_count=2, level="dozing", memory_bytes=24 * MIB),
        "c": status(),
    }
    assert status_changes(before, after) == [
        "a: loaded once (last cold start 0.31s)",
        "a: unloaded -> ready (64.0 MiB)",
        "b: ready -> ready (dozing) (24.0 MiB)",
        "c: ready -> unloaded (no memory)",
    ]


def test_publish_delete_rescale_and_a_reload_in_place() -> None:
    before = {"gone": status(), "m": status("ready", instances=1, load_count=1)}
    after = {"new": status(), "m": status("ready", instances=3, load_count=3)}
    assert status_changes(before, after) == [
        "gone: deleted",
        "m: loaded 2 times",
        "m: 1 -> 3 instances",
        "new: published (unloaded)",
    ]
    assert status_changes(after, after) == []


class Reads:
    """The API's answers, one per refresh: a list of statuses by id, or an error to raise."""

    def __init__(self, *answers: dict[str, dict[str, Any]] | SnoozeError | KeyboardInterrupt) -> None:
        self.answers = list(answers)
        self.sleeps: list[float] = []

    def read(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return [{"id": k, "status": v} for k, v in answer.items()], {}

    def watch(self, count: int) -> Watch:
        return Watch(
            self.read, lambda models, runtime: [], interval=0.5, count=count, as_json=True, clock=lambda: 100.0,
            sleep=self.sleeps.append,
        )  # fmt: skip


def lines(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_json_lines_one_per_refresh_until_the_count(capsys: pytest.CaptureFixture[str]) -> None:
    reads = Reads({"a": status()}, {"a": status("ready", instances=1, load_count=1)}, {"a": status()})
    reads.watch(count=2).run()
    out = lines(capsys)
    assert [o["changes"] for o in out] == [[], ["a: loaded once", "a: unloaded -> ready (no memory)"]]
    assert reads.sleeps == [0.5] and len(reads.answers) == 1  # two reads, one wait between them


def test_ctrl_c_ends_the_watch_quietly(capsys: pytest.CaptureFixture[str]) -> None:
    reads = Reads({"a": status()}, KeyboardInterrupt())
    reads.watch(count=0).run()  # returns: the command exits 0
    assert len(lines(capsys)) == 1


def test_a_server_that_stops_answering_is_said_and_asked_again(capsys: pytest.CaptureFixture[str]) -> None:
    down = SnoozeError("cannot reach the control plane at http://127.0.0.1:8080")
    reads = Reads({"a": status()}, down, {"a": status("ready", instances=1, load_count=1)})
    reads.watch(count=3).run()
    out = lines(capsys)
    assert out[1] == {"time": 100.0, "error": down.message}
    assert out[2]["changes"][0] == "a: loaded once"  # compared with the last answer before the gap


def test_the_first_read_failing_fails_the_command() -> None:
    reads = Reads(SnoozeError("cannot reach the control plane"))
    with pytest.raises(SnoozeError):
        reads.watch(count=0).run()


def test_sigterm_ends_the_watch_as_ctrl_c_does(capsys: pytest.CaptureFixture[str]) -> None:
    class Terminated(Reads):
        def read(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
            answer = super().read()
            if not self.answers:
                os.kill(os.getpid(), signal.SIGTERM)  # as a supervisor stops it, during its last read
            return answer

    before = signal.getsignal(signal.SIGTERM)
    reads = Terminated({"a": status()}, {"a": status()})
    reads.watch(count=0).run()  # returns: the command exits 0
    assert len(lines(capsys)) == 1 and signal.getsignal(signal.SIGTERM) == before
