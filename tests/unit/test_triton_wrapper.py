"""The wrapper that runs a Triton python model as written (python_backend/triton_wrapper.py), without Triton: the
user's module imported from its version folder (sibling imports work), every call handed over, and what the
lifecycle reads written around it: phase notes before the model's code runs, a batch's request ids in the journal
before execute runs it, the batch's end after (after an async execute's coroutine too), the journal gone at a
clean finalize, a hanging finalize bounded. Standard library, numpy and python_backend only (runs on 3.10 too)."""

from __future__ import annotations

import asyncio
import importlib.machinery
import itertools
import json
import os
import sys
import textwrap
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from python_backend import journal, triton_wrapper
from python_backend.journal import JOURNAL_ENV, LENGTH, PHASE_SUFFIX, TRAILER_LAYOUT, own_file

_VERSIONS = itertools.count(7001)  # a version folder's name is a package name: one per test, never reused

USER_MODEL = """
import json
import os
import time

from helper import doubled


def _journal_ids():
    path = os.environ["SNOOZE_TEST_JOURNAL"]
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:4], "little")
    return raw[4 : 4 + n].decode()


def _phase():
    with open(os.environ["SNOOZE_TEST_PHASE"]) as f:
        return json.load(f)["phase"]


class TritonPythonModel:
    def initialize(self, args):
        self.args = args
        self.phase_at_initialize = _phase()
        self.seen = []

    def execute(self, requests):
        self.seen.append(_journal_ids())  # what the journal says while this batch runs
        return [doubled(r.value) for r in requests]

    def is_ready(self):
        return True

    def finalize(self):
        time.sleep(float(os.environ.get("SNOOZE_TEST_FINALIZE_SECS", "0")))
        self.finalized = True
"""

ASYNC_MODEL = """
import asyncio


class TritonPythonModel:
    async def execute(self, requests):
        await asyncio.sleep(0.05)
        return [r.value for r in requests]
"""


class Request:
    """What the wrapper reads of a pb_utils.InferenceRequest: its parameters (the gateway's request id)."""

    def __init__(self, request_id: str, value: int) -> None:
        self.request_id, self.value = request_id, value

    def parameters(self) -> str:
        return json.dumps({"x-request-id": self.request_id})


@pytest.fixture(autouse=True)
def stub_utils(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """A stand-in for the stub's ``triton_python_backend_utils`` (what the wrapper's BLS wake patches: its
    ``InferenceRequest``); the stub's own methods are put back after each test."""
    from python_backend import bls_wake

    pb = types.ModuleType("triton_python_backend_utils")

    class InferenceRequest:
        def exec(self) -> None: ...

        async def async_exec(self) -> None: ...

    vars(pb)["InferenceRequest"] = InferenceRequest
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    yield pb
    bls_wake.uninstall()


@pytest.fixture
def journal_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "journal"
    folder.mkdir()
    monkeypatch.setenv(JOURNAL_ENV, str(folder))
    monkeypatch.setenv("SNOOZE_TEST_JOURNAL", own_file(str(folder), journal.JOURNAL_SUFFIX))
    monkeypatch.setenv("SNOOZE_TEST_PHASE", own_file(str(folder), PHASE_SUFFIX))
    return folder


@pytest.fixture
def model_folder(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A model folder whose version folder (named uniquely) is importable as the stub imports it."""
    version = str(next(_VERSIONS))
    folder = tmp_path / "model"
    (folder / version).mkdir(parents=True)
    for path in (str(folder / version), str(folder)):
        sys.path.append(path)
    yield folder, version
    for path in (str(folder / version), str(folder)):
        sys.path.remove(path)
    for name in [n for n in sys.modules if n == version or n.startswith(f"{version}.") or n == "helper"]:
        del sys.modules[name]


def _write(folder: Path, version: str, model: str) -> None:
    (folder / version / "triton_user_model.py").write_text(textwrap.dedent(model))
    (folder / version / "helper.py").write_text("def doubled(v):\n    return 2 * v\n")


def _args(version: str) -> dict[str, str]:
    return {"model_name": "wrapped", "model_version": version, "model_config": json.dumps({"name": "wrapped"})}


def _trailer(journal_dir: Path) -> tuple[int, int, int]:
    raw = Path(os.environ["SNOOZE_TEST_JOURNAL"]).read_bytes()
    return TRAILER_LAYOUT.unpack(raw[-journal.TRAILER :])


def test_the_users_model_runs_as_written_with_the_journal_around_each_batch(
    journal_dir, model_folder, stub_utils
) -> None:
    folder, version = model_folder
    _write(folder, version, USER_MODEL)
    model = triton_wrapper.wrapped_model(version, "triton_user_model")()
    stubs_exec = stub_utils.InferenceRequest.exec
    model.initialize(_args(version))
    assert stub_utils.InferenceRequest.exec is not stubs_exec  # its BLS calls wake a sleeping callee
    user = model._user
    assert user.phase_at_initialize == "initialize"  # noted before the model's own initialize ran
    assert json.loads(Path(os.environ["SNOOZE_TEST_PHASE"]).read_text())["phase"] == "ready"
    assert user.args["model_name"] == "wrapped"
    assert model.execute([Request("r-1", 3), Request("r-2", 4)]) == [6, 8]  # the sibling module's doubled
    assert user.seen == ["r-1\nr-2"]  # the ids were in the journal before execute ran them
    _, busy, flags = _trailer(journal_dir)
    assert busy == 0 and flags == journal.FLAG_DECLARES_UNLOAD  # the batch ended; finalize is the model's clean-up
    assert model.is_ready() is True  # the stub's other hooks are the model's own
    model.finalize()
    assert user.finalized and not Path(os.environ["SNOOZE_TEST_JOURNAL"]).exists()


def test_a_failing_execute_still_ends_its_batch(journal_dir, model_folder) -> None:
    folder, version = model_folder
    _write(folder, version, USER_MODEL)
    model = triton_wrapper.wrapped_model(version, "triton_user_model")()
    model.initialize(_args(version))
    with pytest.raises(TypeError):
        model.execute([Request("r-3", None)])
    assert LENGTH.unpack(Path(os.environ["SNOOZE_TEST_JOURNAL"]).read_bytes()[:4])[0] == len("r-3")
    assert _trailer(journal_dir)[1] == 0


def test_an_async_execute_ends_its_batch_when_its_coroutine_is_done(journal_dir, model_folder) -> None:
    folder, version = model_folder
    _write(folder, version, ASYNC_MODEL)
    model = triton_wrapper.wrapped_model(version, "triton_user_model")()
    model.initialize(_args(version))
    coroutine = model.execute([Request("r-4", 1)])
    assert _trailer(journal_dir)[1] == 1  # running until the stub has awaited it
    assert asyncio.run(coroutine) == [1]
    assert _trailer(journal_dir)[1] == 0
    assert not hasattr(model, "is_ready")  # the model has none: the stub sees none
    assert _trailer(journal_dir)[2] == 0  # no finalize of its own: nothing to wait for at an eviction


def test_a_hanging_finalize_is_bounded(journal_dir, model_folder, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, version = model_folder
    _write(folder, version, USER_MODEL)
    monkeypatch.setattr(triton_wrapper, "FINALIZE_TIMEOUT_SECS", 0.3)
    monkeypatch.setenv("SNOOZE_TEST_FINALIZE_SECS", "5")
    model = triton_wrapper.wrapped_model(version, "triton_user_model")()
    model.initialize(_args(version))
    started = time.monotonic()
    model.finalize()
    assert time.monotonic() - started < 3
    assert not Path(os.environ["SNOOZE_TEST_JOURNAL"]).exists()


def test_a_bls_wake_module_is_installed_for_the_model_when_the_runtime_has_one(
    journal_dir, model_folder, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, version = model_folder
    _write(folder, version, USER_MODEL)
    installed: list[str] = []
    name = f"{triton_wrapper.__package__}.{triton_wrapper.BLS_WAKE_MODULE}"
    fake = types.ModuleType(name)
    fake.__spec__ = importlib.machinery.ModuleSpec(name, None)
    vars(fake)["install"] = installed.append
    monkeypatch.setitem(sys.modules, name, fake)
    triton_wrapper.wrapped_model(version, "triton_user_model")().initialize(_args(version))
    assert installed == ["wrapped"]
