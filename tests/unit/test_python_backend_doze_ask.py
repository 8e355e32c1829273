"""A dozing stub's ask for room (``python_backend.doze.ask_room``): one HTTP request by hand on the wake route's unix
socket. Standard library and the runtime only: this file runs on Python 3.10 too (``make test-runtime-py310``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness.wake_route import WakeRoute
from python_backend.doze import ADMIT_PATH, AskFailed, ask_room


def test_the_ask_names_the_model_and_the_stub_and_returns_the_answer(tmp_path: Path) -> None:
    with WakeRoute(tmp_path / "wake.sock") as route:
        route.answer = {"model": "m", "admitted": False, "why": "held by models in use"}
        answer = ask_room("m", (41, 7), 5.0, str(tmp_path / "wake.sock"))
        ask_room("a b.ü~", (41, 7), 5.0, str(tmp_path / "wake.sock"))
    assert answer == route.answer
    [(path, body, _), (quoted, _, _)] = route.asks
    assert path == ADMIT_PATH + "m" and body["stub"] == [41, 7] and 0 < body["timeout_secs"] < 5.0
    assert quoted == ADMIT_PATH + "a%20b.%C3%BC~"  # what the route unquotes back to the name


def test_an_answer_other_than_200_is_a_failure_naming_it(tmp_path: Path) -> None:
    with WakeRoute(tmp_path / "wake.sock") as route:
        route.status = 500
        with pytest.raises(AskFailed, match="500"):
            ask_room("m", (41, 7), 5.0, str(tmp_path / "wake.sock"))


def test_no_control_plane_is_a_failure_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(AskFailed, match="no snoozeml control plane listens at"):
        ask_room("m", (41, 7), 5.0, str(tmp_path / "wake.sock"))
    assert time.monotonic() - started < 1.0


def test_a_control_plane_that_does_not_answer_is_a_failure_within_the_bound(tmp_path: Path) -> None:
    with WakeRoute(tmp_path / "wake.sock") as route:
        route.hang = 5.0
        started = time.monotonic()
        with pytest.raises(AskFailed, match="did not answer within 0.3 s"):
            ask_room("m", (41, 7), 0.3, str(tmp_path / "wake.sock"))
        assert time.monotonic() - started < 3.0


def test_a_socket_path_longer_than_sockaddr_un_holds_is_reached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / ("deep" * 30)
    folder.mkdir()
    monkeypatch.chdir(folder)  # the route binds by a relative name, which fits; the stub asks by the whole path
    with WakeRoute("wake.sock") as route:
        assert ask_room("m", (41, 7), 5.0, str(folder / "wake.sock"))["admitted"] is True
    assert len(route.asks) == 1 and len(str(folder / "wake.sock")) > 108
