"""The gateway stack of tests/integration/gateway: one per test module (its tests do not interfere)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.gateway.activator import Activator
from controlplane.gateway.bls_wake import wake_socket_path
from controlplane.gateway.envoy import EnvoyGateway
from controlplane.lifecycle.manager import LifecycleManager
from controlplane.render import embedded_target
from controlplane.settings import Settings
from controlplane.store import ModelStore
from controlplane.triton.launcher import EmbeddedTriton, free_port
from harness.gateway import (
    ACCUMULATOR_PY,
    ADMIN_KEY,
    API_KEY,
    MODEL_PY,
    RAISER_PY,
    REPEATER_PY,
    WAKE_BUFFER,
    LoopThread,
    Stack,
    _admin,
    _write_package,
)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_package(
        tmp_path_factory.mktemp("gw_package") / "scale",
        MODEL_PY,
        params={"scale": 3.0},
        params_schema={"scale": {"type": "float", "default": 2.0}},
    )


@pytest.fixture(scope="module")
def raiser(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A package whose predict raises its ``message`` param, logging each call to its ``calls`` file."""
    return _write_package(
        tmp_path_factory.mktemp("gw_raiser") / "raiser",
        RAISER_PY,
        warmup=False,  # its predict always raises: with the load's warm-up on, no load would succeed
        params_schema={
            "message": {"type": "str", "default": ""},
            "calls": {"type": "str", "default": ""},
            "exception": {"type": "str", "default": "RuntimeError"},
        },
    )


@pytest.fixture(scope="module")
def stack(
    embedded_triton: EmbeddedTriton, package: Path, raiser: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("gateway")
    settings = Settings(
        work_dir=work,
        http_port=free_port(),
        grpc_port=free_port(),
        api_keys=[API_KEY],
        admin_keys=[ADMIN_KEY],
        wake_buffer_bytes=WAKE_BUFFER,
        sweep_interval_secs=3600,
    )
    store = ModelStore(embedded_triton.model_repository, embedded_target())
    loop = LoopThread()
    admin = loop.run(_admin(embedded_triton))
    lifecycle = LifecycleManager(settings, store, admin, triton_process=embedded_triton)
    loop.run(lifecycle.start())
    activator = Activator(
        lifecycle,
        store,
        settings,
        triton_http_url=embedded_triton.http_url,
        triton_grpc_url=embedded_triton.grpc_url,
        wake_socket=wake_socket_path(embedded_triton.journal_dir),  # as serve: where the stubs' BLS calls wake
    )
    loop.run(activator.start())
    gateway = EnvoyGateway(
        settings,
        triton_http=embedded_triton.http_url,
        triton_grpc=embedded_triton.grpc_url,
        activator_http=activator.http_address,
        activator_grpc=activator.grpc_address,
    )
    try:
        gateway.start()
        yield Stack(embedded_triton, store, lifecycle, admin, gateway, loop, package, raiser, activator)
    finally:
        gateway.stop()
        loop.run(activator.stop())
        loop.run(lifecycle.stop())
        loop.run(admin.aclose())
        loop.close()


@pytest.fixture(scope="module")
def repeater(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A decoupled package (predict is a generator): n responses per request."""
    return _write_package(
        tmp_path_factory.mktemp("gw_repeater") / "repeater",
        REPEATER_PY,
        params_schema={"log": {"type": "str", "default": ""}},
    )


@pytest.fixture(scope="module")
def accumulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_package(
        tmp_path_factory.mktemp("gw_accumulator") / "accumulator",
        ACCUMULATOR_PY,
        params_schema={"calls": {"type": "str", "default": ""}},
    )
