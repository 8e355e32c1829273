"""Shared fixtures: one real embedded tritonserver per test session, over a session model repository.

Test helpers live in the package tests/harness and every module imports them as ``harness.<module>``: pyproject's
``pythonpath = ["tests"]`` puts tests/ on sys.path in every pytest process (xdist workers too) before collection, so
no import depends on this file, the import mode or the order modules run in (``make test-runtime-py310`` passes the
same path with ``--noconftest``); the ``harness.`` prefix says where a name lives.
"""

from __future__ import annotations

import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from controlplane.triton.client import TritonAdminClient
from controlplane.triton.launcher import EmbeddedTriton

# Modules that start real stacks (tritonserver, Envoy, `snoozectl serve`): a minute or more each, against seconds for
# most of the rest. They are handed out first, so that xdist's workers end together on short modules rather than one
# of them on a long module begun last (2026-12-06: a third of a run's last two minutes was one worker alone).
LONG_FIRST = ("integration", "reliability")
TESTS = Path(__file__).resolve().parent


def _long(path: Path) -> bool:
    try:
        return path.resolve().relative_to(TESTS).parts[0] in LONG_FIRST
    except (ValueError, IndexError):
        return False


@pytest.hookimpl(trylast=True)  # after the shuffle (pytest-random-order): it keeps the shuffled order within each part
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that start stacks before the others (``LONG_FIRST``), each part in the shuffle's order; and a test
    marked ``stops_stack``, which ends the module's shared stack (a graceful stop, Ctrl-C), after every other test of
    its module, whatever order the shuffle chose; the others keep theirs."""
    first: dict[Path, int] = {}
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
    items.sort(
        key=lambda item: (
            not _long(item.path),
            first[item.path],
            item.get_closest_marker("stops_stack") is not None,
        )
    )


FAILURE_LOG_LINES = 150
TRITON_LOG_LINES = 80


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A test that fails with a stack (a fixture value with ``log_tail``: ``harness.serve.Serve``) reports the end of
    that stack's log with its failure: CI keeps nothing else of a run, and a failure that shows only under its load
    must be readable from its report."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when != "call" or not report.failed:
        return
    for name, value in getattr(item, "funcargs", {}).items():
        tail = getattr(value, "log_tail", None)
        if callable(tail):
            report.sections.append((f"log of '{name}' (its last {FAILURE_LOG_LINES} lines)", tail(FAILURE_LOG_LINES)))
        triton_tail = getattr(value, "triton_log_tail", None)
        if callable(triton_tail) and (text := triton_tail(TRITON_LOG_LINES)):
            report.sections.append((f"tritonserver's log of '{name}' (its last {TRITON_LOG_LINES} lines)", text))


@pytest.fixture(scope="session")
def embedded_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    """One tritonserver (explicit model control, free ports) for the whole session; always stopped."""
    root = tmp_path_factory.mktemp("embedded_triton")
    repo = root / "model_repository"
    repo.mkdir()
    triton = EmbeddedTriton(repo, root / "work", exit_timeout_secs=3)  # no test here waits on Triton's exit
    try:
        triton.start()
        yield triton
    finally:
        triton.stop()


@pytest.fixture
def model_repo(embedded_triton: EmbeddedTriton) -> Path:
    """The session Triton's model repository; give each test's models unique names."""
    return embedded_triton.model_repository


@pytest.fixture
async def triton_admin(embedded_triton: EmbeddedTriton) -> AsyncIterator[TritonAdminClient]:
    async with TritonAdminClient(embedded_triton.http_url, embedded_triton.metrics_url) as client:
        yield client


TINY_MODEL_PY = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        if {fail_init!r}:
            raise RuntimeError("tiny model refuses to initialize")

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", (x * 2).astype(np.float32))]))
        return responses

    def finalize(self):
        time.sleep({finalize_sleep!r})
"""


@pytest.fixture
def write_tiny_model() -> Callable[..., str]:
    """Write a hand-made python-backend model (config.pbtxt + 1/model.py) into a repository."""

    def write(repo: Path, name: str, *, instances: int = 1, fail_init: bool = False, finalize_sleep: float = 0) -> str:
        folder = repo / name
        (folder / "1").mkdir(parents=True)
        (folder / "config.pbtxt").write_text(
            textwrap.dedent(
                f"""\
                name: "{name}"
                backend: "python"
                max_batch_size: 8
                input [{{ name: "x", data_type: TYPE_FP32, dims: [2] }}]
                output [{{ name: "y", data_type: TYPE_FP32, dims: [2] }}]
                instance_group [{{ kind: KIND_CPU, count: {instances} }}]
                """
            )
        )
        (folder / "1" / "model.py").write_text(TINY_MODEL_PY.format(fail_init=fail_init, finalize_sleep=finalize_sleep))
        return name

    return write
