"""Fixtures of the fault-injection suite: `snoozectl serve` subprocesses that are always stopped."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.serve import TOPOLOGIES, WORKERS, Serve, write_package
from harness.variants import each_choice


@pytest.fixture(scope="module", params=TOPOLOGIES)
def topology(request: pytest.FixtureRequest) -> str:
    """Where Triton runs: serve's child, or its own process beside serve (as in compose and Kubernetes)."""
    return request.param


@pytest.fixture(scope="module", params=WORKERS)
def worker(request: pytest.FixtureRequest) -> str:
    """Where the model's code runs: its python-backend stub, or a worker forked from a preloaded parent."""
    return request.param


@pytest.hookimpl(tryfirst=True)  # before the -m 'not slow' deselection reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Preforked workers beside a Triton of its own (two_process) are a long variant: marked slow. Of the rest, each
    test runs every topology, worker, protocol and fault it is parametrized by at least once, not every combination
    (harness/variants.py; make test-all runs them all)."""
    here = Path(__file__).resolve().parent
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (
            here in Path(str(item.path)).parents
            and params.get("topology") == "two_process"
            and params.get("worker") == "preforked"
        ):
            item.add_marker(pytest.mark.slow)
    each_choice(items, here)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_package(tmp_path_factory.mktemp("reliability_pkg") / "scale")


@pytest.fixture(scope="module")
def serve_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Serve]]:
    """Make `snoozectl serve` runners (not started); every one is stopped, children included, afterwards."""
    made: list[Serve] = []

    def make(name: str = "serve", *, topology: str = "embedded", **env: str) -> Serve:
        # A 5 s drain at stop (30 s by default): after the stub-fault scenarios Triton can keep a request of a
        # dead process in flight, and the teardown would wait out the whole default grace for it. Triton itself
        # keeps a model whose stub died live until its exit timeout (10 s by default): 2 s here.
        defaults = {
            "SNOOZE_SWEEP_INTERVAL_SECS": "0.5",
            "SNOOZE_SHUTDOWN_GRACE_SECS": "5",
            "SNOOZE_TRITON_EXIT_TIMEOUT_SECS": "2",
        }
        env = {**defaults, **{f"SNOOZE_{k.upper()}": v for k, v in env.items()}}
        serve = Serve(tmp_path_factory.mktemp(name) / "work", {**os.environ, **env}, topology=topology)
        made.append(serve)
        return serve

    yield make
    for serve in made:
        serve.stop()
