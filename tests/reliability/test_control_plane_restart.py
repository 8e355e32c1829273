"""The control plane (`snoozectl serve`) is killed with SIGKILL during traffic and during a publish.

Its tritonserver, Envoy and stubs must not outlive it (they held the gateway ports, so a restart could
not bind), the repository holds only complete models, every model published before is listed after
the restart, and the same clients are served again.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from harness.probes import until_async
from harness.reliability import Traffic, report, summary
from harness.serve import Serve, alive, write_package

pytestmark = pytest.mark.integration

CLIENT_TIMEOUT = 10.0
CONNECT_ERROR = re.compile(r"failed to connect|Connection refused|Cannot connect|ClientConnectorError", re.IGNORECASE)


def assert_repository_complete(serve: Serve) -> list[str]:
    """Every folder in the repository is a whole model: config.pbtxt (parses, names the folder),
    snooze_deployment.json (agrees with it) and the version folder with its entry file."""
    ids = []
    for folder in sorted(serve.repository.iterdir()):
        config = model_config_pb2.ModelConfig()
        text_format.Parse((folder / "config.pbtxt").read_text(), config)
        record = json.loads((folder / "snooze_deployment.json").read_text())
        assert config.name == folder.name == record["deployment"]["id"]
        assert config.max_batch_size == record["deployment"]["max_batch_size"]
        assert (folder / "1" / "model.py").is_file() and (folder / "1" / "snooze_runtime.json").is_file()
        ids.append(folder.name)
    return ids


async def assert_children_gone(children, what: str) -> float:
    return await until_async(lambda: not alive(children), f"{what} to exit with the control plane", timeout=30)


async def test_killed_during_traffic_restarts_and_serves_again(serve_factory, package):
    serve = serve_factory("cprestart")
    await asyncio.to_thread(serve.start)
    for model in ("one", "two"):
        await asyncio.to_thread(serve.publish, model, package)
    traffic = Traffic(serve, {"one": 2.0, "two": 2.0}, grpc_clients=4, http_clients=2, timeout=CLIENT_TIMEOUT)
    traffic.start()
    try:
        await until_async(lambda: sum(r.ok for r in traffic.results) >= 50, "warm traffic")
        shm_before = set(Path("/dev/shm").glob("snooze_*"))
        killed_at = time.monotonic()
        children = await asyncio.to_thread(serve.kill9)
        servers = [c for c in children if c.name() in ("tritonserver", "envoy")]
        stubs = [c for c in children if c.name() == "triton_python_backend_stub"]
        assert len(servers) == 2 and stubs
        orphans_gone = await assert_children_gone(servers, "tritonserver and Envoy")
        await asyncio.sleep(1.0)  # clients keep trying while nothing listens
        restart_secs = await asyncio.to_thread(serve.start)  # same ports: nothing of the old run holds them
        # A stub can outlive its killed server (reparented, blocked on its message queue); the restart
        # removes what is left of the old run's process group.
        assert not alive(stubs), [(p.pid, p.cmdline()[:2]) for p in alive(stubs)]
        up_at = time.monotonic()
        recovered = await until_async(
            lambda: {r.client for r in traffic.results if r.ok and r.started > up_at} == set(range(traffic.clients)),
            "every client to be served again",
        )
        await asyncio.sleep(2.0)
    finally:
        results = await traffic.stop()

    total = summary(results)
    report(
        "control plane SIGKILL mid-traffic",
        failed=f"{total['failed']}/{total['total']}",
        failed_before_kill=sum(1 for r in results if not r.ok and r.ended < killed_at),
        failed_after_restart=sum(1 for r in results if not r.ok and r.started > up_at),
        errors_after_restart=sorted({r.error[:90] for r in results if not r.ok and r.started > up_at}),
        orphans_gone_secs=round(orphans_gone, 2),
        restart_secs=round(restart_secs, 2),
        first_success_after_restart_secs=round(recovered, 2),
        slowest_request_secs=total["max_seconds"],
    )
    assert not any("WRONG ANSWER" in r.error for r in results)
    assert all(r.ok for r in results if r.ended < killed_at)
    # The restarted stack wakes models on demand: once a client reached it, it was served. Before that,
    # only connection errors: a client's own reconnect back-off (gRPC) can outlast the restart a little.
    for client in range(traffic.clients):
        mine = [r for r in results if r.client == client and r.started > up_at]
        first_ok = min(r.started for r in mine if r.ok)
        assert all(r.ok for r in mine if r.started >= first_ok), summary(mine)
        assert all(CONNECT_ERROR.search(r.error) for r in mine if r.started < first_ok), summary(mine)
    assert total["max_seconds"] <= CLIENT_TIMEOUT + 3
    assert sorted(serve.models()) == ["one", "two"] == assert_repository_complete(serve)
    # The old run's shared-memory regions are removed by the restart (recorded in the work dir).
    leaked = {p for p in shm_before if p.exists()} - set(Path("/dev/shm").glob("snooze_*"))
    assert not leaked
    old_regions = json.loads((serve.work_dir / "triton" / "tritonserver.run.json").read_text())
    assert old_regions["pid"] == serve.tritonserver().pid


async def test_killed_during_a_publish_leaves_no_half_written_model(serve_factory, package, tmp_path):
    serve = serve_factory("cppublish")
    await asyncio.to_thread(serve.start)
    small = write_package(tmp_path / "small")
    big = write_package(tmp_path / "big", weights_mb=160)  # copying it takes a moment: the kill lands mid-write
    for model in ("keep-a", "keep-b"):
        await asyncio.to_thread(serve.publish, model, package)
    await asyncio.to_thread(serve.publish, "big", small, max_batch_size=4)  # the version a republish replaces

    outcome: dict[str, object] = {}

    def republish() -> None:
        try:
            outcome["response"] = httpx.post(
                f"{serve.api_url}/v1/models:from-path",
                json={"id": "big", "path": str(big), "max_batch_size": 2},
                timeout=120,
            ).status_code
        except httpx.HTTPError as e:
            outcome["response"] = type(e).__name__

    publisher = threading.Thread(target=republish)
    publisher.start()
    # Kill as soon as the new version is being written into its staging folder.
    staged = await until_async(
        lambda: any(serve.staging.glob("big@*.staged")), "the publish to start writing", interval=0.002
    )
    writing = [p for p in serve.staging.glob("big@*.staged/1/package/weights.bin")]
    children = await asyncio.to_thread(serve.kill9)
    publisher.join(60)
    sizes = [p.stat().st_size for p in writing if p.exists()]
    # the new version's weights in a staged folder the kill left: it was not committed (after a commit the staged
    # folder holds the version it replaced, which has no weights file)
    uncommitted = any(serve.staging.glob("big@*.staged/1/package/weights.bin"))
    await assert_children_gone([c for c in children if c.name() != "triton_python_backend_stub"], "the servers")
    leftovers = sorted(p.name for p in serve.staging.iterdir() if p.is_dir())

    await asyncio.to_thread(serve.start)
    ids = assert_repository_complete(serve)
    listed = await asyncio.to_thread(serve.models)
    report(
        "control plane SIGKILL during a publish",
        publish_answer=outcome.get("response"),
        staged_after_secs=round(staged, 3),
        weights_written_at_kill_mb=[round(s / 2**20) for s in sizes],
        staging_leftovers_before_restart=len(leftovers),
        staging_leftovers_after_restart=len([p for p in serve.staging.iterdir() if p.is_dir()]),
        models=sorted(listed),
        big_max_batch_size=listed["big"]["max_batch_size"],
        new_version_left_staged=uncommitted,
    )
    assert outcome.get("response") != 201, "the publish finished before the kill: make the package bigger"
    assert sorted(listed) == ["big", "keep-a", "keep-b"] == ids
    # one version, whole: the previous one, or the new one where the kill came after its commit but before the
    # answer (a loaded machine delays the kill: seen once in a fresh clone's run)
    assert listed["big"]["max_batch_size"] in (2, 4)
    if uncommitted or sizes:
        assert listed["big"]["max_batch_size"] == 4  # the kill met the new version being written
    assert all(not p.name.startswith(".") for p in serve.repository.iterdir())  # staging lives outside
    assert [p for p in serve.staging.iterdir() if p.is_dir()] == []  # a killed publish's staging is removed

    # The stack serves every model, and the interrupted publish can simply be repeated.
    traffic = Traffic(serve, {"keep-a": 2.0, "keep-b": 2.0, "big": 2.0}, grpc_clients=3)
    traffic.start()
    await until_async(lambda: {r.model for r in traffic.results if r.ok} == {"keep-a", "keep-b", "big"}, "traffic")
    await asyncio.to_thread(serve.publish, "big", big, max_batch_size=2)
    await asyncio.sleep(1.0)
    results = await traffic.stop()
    assert summary(results)["failed"] == 0, summary(results)
    assert (await asyncio.to_thread(serve.models))["big"]["max_batch_size"] == 2
