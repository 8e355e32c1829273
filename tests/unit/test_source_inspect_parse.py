"""``source_inspect.parse``: one ``ast.parse`` at a time, and a parse broken by another one is tried again.

CPython 3.11 breaks two overlapping parses with ``SystemError: AST constructor recursion depth mismatch`` (seen
in CI with concurrent publishes of one package). The overlap itself depends on when the garbage collector runs,
so these tests stand a stand-in ``ast.parse`` in its place that records overlap, and one that fails like 3.11.
"""

from __future__ import annotations

import ast
import threading
import time

import pytest

from controlplane import source_inspect

SOURCE = "class Model:\n    def predict(self, x):\n        yield x\n"


def test_parses_from_many_threads_never_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    real_parse = ast.parse
    inside = 0
    most = 0
    guard = threading.Lock()

    def recording_parse(source: str | bytes, filename: str = "<unknown>") -> ast.Module:
        nonlocal inside, most
        with guard:
            inside += 1
            most = max(most, inside)
        time.sleep(0.005)  # long enough that unguarded threads would overlap
        try:
            return real_parse(source, filename=filename)
        finally:
            with guard:
                inside -= 1

    monkeypatch.setattr(ast, "parse", recording_parse)
    trees: list[ast.Module] = []

    def work() -> None:
        for _ in range(5):
            trees.append(source_inspect.parse(SOURCE))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert len(trees) == 20
    assert most == 1


def test_a_parse_broken_by_another_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    real_parse = ast.parse
    calls = 0

    def broken_once(source: str | bytes, filename: str = "<unknown>") -> ast.Module:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise SystemError("AST constructor recursion depth mismatch (before=27, after=19)")
        return real_parse(source, filename=filename)

    monkeypatch.setattr(ast, "parse", broken_once)
    tree = source_inspect.parse(SOURCE, filename="snooze_model.py")
    assert isinstance(tree.body[0], ast.ClassDef)
    assert calls == 2


def test_other_system_errors_and_syntax_errors_are_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0

    def other(source: str | bytes, filename: str = "<unknown>") -> ast.Module:
        nonlocal calls
        calls += 1
        raise SystemError("something else")

    monkeypatch.setattr(ast, "parse", other)
    with pytest.raises(SystemError, match="something else"):
        source_inspect.parse(SOURCE)
    assert calls == 1
    monkeypatch.undo()
    with pytest.raises(SyntaxError):
        source_inspect.parse("def (", filename="snooze_model.py")


def test_a_parse_that_keeps_breaking_raises_in_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    def always(source: str | bytes, filename: str = "<unknown>") -> ast.Module:
        raise SystemError("AST constructor recursion depth mismatch (before=3, after=1)")

    monkeypatch.setattr(ast, "parse", always)
    with pytest.raises(SystemError, match="recursion depth mismatch"):
        source_inspect.parse(SOURCE)
