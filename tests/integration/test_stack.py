"""The whole stack end to end: `snoozectl serve` in a child process (real signals, real orphans),
with auth on, driven only with standard clients (tritonclient http/grpc/grpc.aio, httpx, the
`snoozectl` CLI) through the Envoy gateway and the control API.

Two stacks: the shared one (wake storms, idle unload, stub crash, auth, bad uploads, status,
Triton killed; in that order, the Triton kill last) and a small-budget one (LRU eviction, then
graceful shutdown, which ends it). Component-level behaviour is proven in tests/integration/gateway and
test_lifecycle.py; these tests prove the wiring: settings from the environment, models.toml, the
CLI, the signal handling and the process tree of `snoozectl serve`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import json
import os
import signal
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from controlplane.api.client import ControlPlaneError
from controlplane.warmup_samples import LEARNED_FILE
from harness.probes import grpc_infer, grpc_infer_async, http_infer, until
from harness.serve import SNOOZECTL, Serve, cmdline, is_alive, tree_digest, write_package

pytestmark = pytest.mark.integration

API_KEY = "stack-infer-key-8d1f"
ADMIN_KEY = "stack-admin-key-52c9"
GRPC_KEY = {"x-api-key": API_KEY}
HTTP_KEY = {"X-API-Key": API_KEY}
DEADLINE = 90.0  # generous: every wait below polls and returns as soon as the condition holds
MIB = 1024 * 1024

# ------------------------------------------------------------------------------------------------
# helpers


def models_toml(entries: list[dict[str, Any]]) -> str:
    lines = []
    for entry in entries:
        lines.append("[[models]]")
        params = entry.pop("params", {})
        for k, v in entry.items():
            lines.append(f"{k} = {json.dumps(v)}")
        if params:
            inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in params.items())
            lines.append(f"params = {{ {inner} }}")
        lines.append("")
    return "\n".join(lines)


def x_rows(values: list[float]) -> np.ndarray:
    return np.array([[v, v + 1, v + 2, v + 3] for v in values], dtype=np.float32)


def kserve_body(x: np.ndarray) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}


def make_serve(root: Path, models: Path, **env: str) -> Serve:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SNOOZE_")}
    base.update(
        SNOOZE_API_KEYS=json.dumps([API_KEY]),
        SNOOZE_ADMIN_KEYS=json.dumps([ADMIN_KEY]),
        SNOOZE_SWEEP_INTERVAL_SECS="0.3",
        SNOOZE_SHUTDOWN_GRACE_SECS="20",
        SNOOZE_LOG_LEVEL="info",
        **env,
    )
    return Serve(root / "work", base, models=models, admin_key=ADMIN_KEY)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_package(tmp_path_factory.mktemp("stack_package") / "numpy-scale", dims=4, params={"scale": 2.0})


# ------------------------------------------------------------------------------------------------
# The small-budget stack: LRU eviction, then graceful shutdown (which ends it)

BALLAST_MB = 100  # each LRU model holds ~100 MiB + the stub's own ~20 MiB of proportional memory (Pss)
# two of them fit beside tritonserver's own memory (~50 MiB; the budget is for the whole Triton tree), three do not
# (~2 x 121 measured + 140 declared for the next)
BUDGET_MB = 360


@pytest.fixture(scope="module")
def budget_stack(tmp_path_factory: pytest.TempPathFactory, package: Path) -> Iterator[Serve]:
    root = tmp_path_factory.mktemp("budget_stack")
    models = root / "models"
    models.mkdir()
    marker = root / "slow.started"
    entries = [
        {"id": f"lru_{n}", "path": str(package), "memory_mb": 140, "params": {"ballast_mb": BALLAST_MB}} for n in "abc"
    ]
    entries.append(
        {"id": "slow", "path": str(package), "memory_mb": 1, "params": {"predict_sleep": 1.0, "marker": str(marker)}}
    )
    (models / "models.toml").write_text(models_toml(entries))
    # lru: the test follows least-recently-used choices (gdsf's: tests/model/test_lifecycle_budget.py)
    serve = make_serve(root, models, SNOOZE_MEMORY_BUDGET_MB=str(BUDGET_MB), SNOOZE_EVICTION_POLICY="lru")
    try:
        serve.start(timeout=120, ready=True)
        yield serve
    finally:
        serve.stop()


def test_lru_eviction_under_a_small_budget(budget_stack: Serve):
    s = budget_stack
    x = x_rows([1.0])
    for model in ("lru_a", "lru_b"):
        np.testing.assert_allclose(grpc_infer(s.grpc_url, model, x, headers=GRPC_KEY), x * 2)
    a, b = s.status("lru_a"), s.status("lru_b")
    assert a["state"] == b["state"] == "ready"
    # The budget check below depends on the measured footprints, so say what they are when it fails.
    sizes = f"measured: a={a['memory_bytes'] / MIB:.0f} MiB, b={b['memory_bytes'] / MIB:.0f} MiB, budget {BUDGET_MB}"
    assert a["memory_bytes"] + b["memory_bytes"] + 140 * MIB > BUDGET_MB * MIB, sizes

    # wakes c: evicts a (least recent)
    np.testing.assert_allclose(http_infer(s.http_url, "lru_c", x, headers=HTTP_KEY), x * 2)
    states = {m: s.status(m)["state"] for m in ("lru_a", "lru_b", "lru_c")}
    assert states == {"lru_a": "unloaded", "lru_b": "ready", "lru_c": "ready"}, sizes
    assert s.metric("snooze_evictions_total", model="lru_a", reason="memory") == 1
    assert s.stub_pids("lru_a") == [] and s.stub_pids("lru_c")

    # a again: b is now the least recently used, and every request still succeeds.
    np.testing.assert_allclose(grpc_infer(s.grpc_url, "lru_a", x, headers=GRPC_KEY), x * 2)
    states = {m: s.status(m)["state"] for m in ("lru_a", "lru_b", "lru_c")}
    assert states == {"lru_a": "ready", "lru_b": "unloaded", "lru_c": "ready"}, sizes


@pytest.mark.stops_stack
def test_graceful_shutdown_finishes_in_flight_requests_and_leaves_no_process(budget_stack: Serve):
    s = budget_stack
    marker = s.work_dir.parent / "slow.started"
    x = x_rows([5.0])
    np.testing.assert_allclose(http_infer(s.http_url, "slow", x, headers=HTTP_KEY), x * 2)  # awake first
    marker.unlink()
    s.descendants()
    assert s.stub_pids("slow")
    triton_pid = s.tritonserver().pid

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        in_flight_grpc = pool.submit(grpc_infer, s.grpc_url, "slow", x, headers=GRPC_KEY)
        in_flight_http = pool.submit(http_infer, s.http_url, "slow", x, headers=HTTP_KEY)
        until(lambda: marker.exists(), "the slow request to reach the model")
        s.descendants()
        assert s.proc is not None
        s.proc.send_signal(signal.SIGTERM)
        np.testing.assert_allclose(in_flight_grpc.result(60), x * 2)
        np.testing.assert_allclose(in_flight_http.result(60), x * 2)

    try:
        code = s.proc.wait(40)  # grace (20 s) plus stopping the pieces
    except subprocess.TimeoutExpired:
        pytest.fail(f"snoozectl serve did not exit after SIGTERM:\n{s.log_tail()}")
    assert code == 0, s.log_tail()
    assert triton_pid in s.seen
    left = s.leftovers()
    assert left == [], [(p.pid, cmdline(p)) for p in left]


# ------------------------------------------------------------------------------------------------
# The shared stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, package: Path) -> Iterator[Serve]:
    root = tmp_path_factory.mktemp("shared_stack")
    models = root / "models"
    models.mkdir()
    entries = [
        # each storm model is woken by its storm test only (it checks the storm was the one cold start)
        {"id": "storm_grpc", "path": str(package), "params": {"scale": 3.0}},
        {"id": "storm_http", "path": str(package), "params": {"scale": 3.0}},
        {"id": "shared", "path": str(package), "params": {"scale": 3.0}},  # any test may use it
        {"id": "listed", "path": str(package)},  # woken by the status test
        {"id": "dormant", "path": str(package)},  # no test loads it
        {"id": "napper", "path": str(package), "idle_timeout_secs": 2},
        {"id": "crashy", "path": str(package), "params": {"crash": "poison"}},
        {"id": "phoenix", "path": str(package), "params": {"marker": str(root / "phoenix.started")}},
    ]
    (models / "models.toml").write_text(models_toml(entries))
    serve = make_serve(root, models)
    try:
        serve.start(timeout=120, ready=True)
        yield serve
    finally:
        serve.stop()


STORM = 100


async def test_wake_storm_grpc_aio(stack: Serve):
    model = "storm_grpc"
    assert stack.status(model)["state"] == "unloaded"
    xs = [x_rows([float(i)]) for i in range(STORM)]

    async with grpcaio.InferenceServerClient(stack.grpc_url) as client:
        results = await asyncio.gather(
            *(grpc_infer_async(client, model, x, headers=GRPC_KEY, timeout=DEADLINE) for x in xs)
        )
    for x, y in zip(xs, results, strict=True):
        np.testing.assert_allclose(y, x * 3)
    status = stack.status(model)
    assert status["state"] == "ready" and status["load_count"] == 1
    assert stack.metric("snooze_cold_starts_total", model=model, trigger="request") == 1


async def test_wake_storm_http_kserve_json(stack: Serve):
    model = "storm_http"
    assert stack.status(model)["state"] == "unloaded"
    xs = [x_rows([float(i)]) for i in range(STORM)]
    limits = httpx.Limits(max_connections=STORM, max_keepalive_connections=STORM)
    async with httpx.AsyncClient(timeout=DEADLINE, limits=limits, headers=HTTP_KEY) as http:
        url = f"http://{stack.http_url}/v2/models/{model}/infer"
        responses = await asyncio.gather(*(http.post(url, json=kserve_body(x)) for x in xs))
    for x, r in zip(xs, responses, strict=True):
        assert r.status_code == 200, r.text
        [out] = r.json()["outputs"]
        assert out["name"] == "y" and out["shape"] == [1, 4]
        np.testing.assert_allclose(out["data"], (x * 3).ravel())
    status = stack.status(model)
    assert status["state"] == "ready" and status["load_count"] == 1
    assert stack.metric("snooze_cold_starts_total", model=model, trigger="request") == 1


def test_idle_unload_stops_the_stubs_and_the_next_request_wakes(stack: Serve):
    model = "napper"
    x = x_rows([2.0])
    np.testing.assert_allclose(http_infer(stack.http_url, model, x, headers=HTTP_KEY), x * 2)
    assert stack.status(model)["state"] == "ready"
    stubs = stack.stub_pids(model)
    assert stubs, "a loaded python model has a stub process"
    procs = [stack.seen[pid] for pid in stubs]

    until(lambda: stack.status(model)["state"] == "unloaded", "the idle unload")
    until(lambda: not any(is_alive(p) for p in procs) and stack.stub_pids(model) == [], "its stubs to exit")
    assert stack.metric("snooze_idle_unloads_total", model=model) >= 1

    np.testing.assert_allclose(grpc_infer(stack.grpc_url, model, x, headers=GRPC_KEY), x * 2)
    status = stack.status(model)
    assert status["state"] == "ready" and status["load_count"] == 2
    assert stack.stub_pids(model)


def test_stub_crash_fails_one_request_then_recovers(stack: Serve):
    """With auth on: the request that kills the stub fails once (never run again), the next is served.
    (tests/reliability/test_stub_faults.py counts executions in both topologies.)"""
    model = "crashy"
    x, poison = x_rows([1.0]), x_rows([-1.0])
    np.testing.assert_allclose(grpc_infer(stack.grpc_url, model, x, headers=GRPC_KEY), x * 2)
    for protocol, infer in (("gRPC", grpc_infer), ("HTTP", http_infer)):
        loads = stack.status(model)["load_count"]
        with pytest.raises(InferenceServerException, match="died while running this request"):
            if protocol == "gRPC":
                infer(stack.grpc_url, model, poison, headers=GRPC_KEY)
            else:
                infer(stack.http_url, model, poison, headers=HTTP_KEY)
        until(
            lambda loads=loads: (st := stack.status(model))["state"] == "ready" and st["load_count"] == loads + 1,
            f"the recovery ({protocol})",
        )
        np.testing.assert_allclose(http_infer(stack.http_url, model, x, headers=HTTP_KEY), x * 2)
        np.testing.assert_allclose(grpc_infer(stack.grpc_url, model, x, headers=GRPC_KEY), x * 2)
    assert stack.metric("snooze_recoveries_total", model=model, cause="dead_stub") == 2


@pytest.mark.parametrize("headers", [{}, {"X-API-Key": "wrong"}, {"Authorization": "Bearer wrong"}])
def test_http_refusals_are_kserve_json_401(stack: Serve, headers: dict[str, str]):
    with pytest.raises(InferenceServerException) as info:
        http_infer(stack.http_url, "shared", x_rows([1.0]), headers=headers)
    assert info.value.status() == "401" and "missing or invalid API key" in info.value.message()
    raw = httpx.post(f"http://{stack.http_url}/v2/models/shared/infer", json=kserve_body(x_rows([1.0])),
                     headers=headers)  # fmt: skip
    assert raw.status_code == 401 and "missing or invalid API key" in raw.json()["error"]


@pytest.mark.parametrize("headers", [{}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}])
def test_grpc_refusals_are_unauthenticated(stack: Serve, headers: dict[str, str]):
    with pytest.raises(InferenceServerException) as info:
        grpc_infer(stack.grpc_url, "shared", x_rows([1.0]), headers=headers)
    assert info.value.status() == "StatusCode.UNAUTHENTICATED"
    assert "missing or invalid API key" in info.value.message()


def test_inference_key_infers_but_cannot_administer(stack: Serve, package: Path, tmp_path: Path):
    x = x_rows([3.0])
    np.testing.assert_allclose(http_infer(stack.http_url, "shared", x, headers=HTTP_KEY), x * 3)
    np.testing.assert_allclose(
        grpc_infer(stack.grpc_url, "shared", x, headers={"authorization": f"Bearer {API_KEY}"}), x * 3
    )
    with stack.api(API_KEY) as api:
        for call in (
            lambda: api.publish_archive(package, "sneaky"),
            lambda: api.load("dormant"),
            lambda: api.delete("dormant"),
        ):
            with pytest.raises(ControlPlaneError) as info:
                call()
            assert info.value.status_code == 403 and "admin" in info.value.message
    with stack.api(None) as api, pytest.raises(ControlPlaneError) as info:
        api.list()
    assert info.value.status_code == 401
    cli = stack.snoozectl("load", "dormant", "--json", key=API_KEY)
    assert cli.returncode == 1 and json.loads(cli.stdout)["code"] in ("forbidden", "auth_forbidden"), cli.stdout
    assert stack.status("dormant")["state"] == "unloaded"

    # The admin key may: publish (CLI), load, unload, delete.
    cli = stack.snoozectl("publish", str(package), "--id", "admin_made", "--no-convert", "--json")
    assert cli.returncode == 0, cli.stdout + cli.stderr
    with stack.api() as api:
        assert api.load("admin_made")["state"] == "ready"
        np.testing.assert_allclose(grpc_infer(stack.grpc_url, "admin_made", x, headers=GRPC_KEY), x * 2)
        assert api.unload("admin_made")["state"] == "unloaded"
        api.delete("admin_made")
        assert "admin_made" not in {m["id"] for m in api.list()}


def _bad_packages(root: Path, package: Path) -> dict[str, tuple[Path, str]]:
    """case -> (what `snoozectl publish` gets, a fragment the error must contain)."""
    dotdot = root / "dotdot.tar.gz"
    with tarfile.open(dotdot, "w:gz") as tar:
        for f in sorted(package.iterdir()):
            tar.add(f, arcname=f.name)
        evil = b"print('escaped')\n"
        info = tarfile.TarInfo("../evil.py")
        info.size = len(evil)
        tar.addfile(info, io.BytesIO(evil))

    bad_manifest = write_package(root / "bad-manifest")
    (bad_manifest / "snooze_model.json").write_text('{"inputs": [')

    import_error = write_package(root / "import-error")
    (import_error / "snooze_model.py").write_text("import not_a_real_module_xyz\n\nclass Model: ...\n")

    onnx_mismatch = root / "onnx-mismatch"
    onnx_mismatch.mkdir()
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (onnx_mismatch / "model.onnx").write_bytes(model.SerializeToString())
    (onnx_mismatch / "snooze_model.json").write_text(
        json.dumps({"inputs": [{"name": "x", "datatype": "INT64", "dims": [4]}]})
    )
    return {
        "dotdot": (dotdot, "'../evil.py' escapes"),
        "bad-manifest": (bad_manifest, "snooze_model.json: not valid JSON"),
        "import-error": (import_error, "No module named 'not_a_real_module_xyz'"),
        "onnx-mismatch": (onnx_mismatch, "'x' is FP32 in the ONNX file, INT64 in the manifest"),
    }


def test_bad_uploads_are_refused_and_the_repository_is_unchanged(stack: Serve, package: Path, tmp_path: Path):
    cases = _bad_packages(tmp_path, package)
    # What publishing wrote; not the learned warm-up the lifecycle keeps in a model's folder after its first requests
    # (another test's request can have it written at any moment: fresh clone 4).
    skip = frozenset({LEARNED_FILE, f".{LEARNED_FILE}.tmp"})
    before = tree_digest(stack.repository, skip=skip)
    env = {**os.environ, "SNOOZE_API_URL": stack.api_url, "SNOOZE_API_KEY": ADMIN_KEY}
    # The CLI, as users run it (all four at once: they must not disturb each other either).
    runs = {
        case: subprocess.Popen(
            [SNOOZECTL, "publish", str(path), "--id", "shared", "--no-convert", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for case, (path, _) in cases.items()
    }
    for case, run in runs.items():
        out, err = run.communicate(timeout=120)
        assert run.returncode == 1, (case, out, err)
        body = json.loads(out)
        assert body["ok"] is False and body["code"] == "invalid_package", (case, body)
        assert cases[case][1] in body["error"] and body["hint"], (case, body)
    assert tree_digest(stack.repository, skip=skip) == before
    # The same through the API client: a 4xx with the one JSON error shape.
    with stack.api() as api:
        for case, (path, fragment) in cases.items():
            with pytest.raises(ControlPlaneError) as info:
                api.publish_archive(path, "shared")
            assert 400 <= info.value.status_code < 500 and fragment in info.value.message, case
    assert tree_digest(stack.repository, skip=skip) == before
    # The model those uploads tried to replace still serves.
    x = x_rows([4.0])
    np.testing.assert_allclose(grpc_infer(stack.grpc_url, "shared", x, headers=GRPC_KEY), x * 3)


def test_status_json_lists_every_model(stack: Serve):
    x = x_rows([1.0])
    np.testing.assert_allclose(grpc_infer(stack.grpc_url, "listed", x, headers=GRPC_KEY), x * 2)
    cli = stack.snoozectl("status", "--json")
    assert cli.returncode == 0, cli.stderr
    models = {m["id"]: m["status"] for m in json.loads(cli.stdout)}
    assert set(models) == {"storm_grpc", "storm_http", "shared", "listed", "dormant", "napper", "crashy", "phoenix"}
    keys = {"state", "instances", "last_access", "idle_timeout_secs", "memory_bytes", "last_cold_start_secs"}
    for model, status in models.items():
        assert keys <= set(status), (model, status)
    listed = models["listed"]
    assert listed["state"] == "ready" and listed["instances"] >= 1
    assert listed["last_access"] and listed["last_access"] <= time.time() + 1
    assert listed["idle_timeout_secs"] == 300 and models["napper"]["idle_timeout_secs"] == 2
    assert listed["memory_bytes"] > 0 and listed["last_cold_start_secs"] > 0
    never = models["dormant"]
    assert never["state"] == "unloaded" and never["instances"] == 0 and never["last_cold_start_secs"] is None
    table = stack.snoozectl("status")  # the human table names the same models
    assert table.returncode == 0 and all(m in table.stdout for m in models)


def test_triton_killed_fails_fast_then_serves_after_the_restart(stack: Serve):
    model = "phoenix"
    marker = stack.work_dir.parent / "phoenix.started"
    x, held = x_rows([7.0]), x_rows([-2.0])  # ``held`` stays 3 s in predict
    np.testing.assert_allclose(grpc_infer(stack.grpc_url, model, x, headers=GRPC_KEY), x * 2)
    client_timeout = 20.0  # short next to load_timeout_secs (300): a hang would exceed it
    outcomes: list[str] = []

    def attempt(send: Callable[..., np.ndarray], url: str, headers: dict[str, str], x: np.ndarray = x) -> bool:
        try:
            np.testing.assert_allclose(send(url, model, x, headers=headers, timeout=client_timeout), x * 2)
            outcomes.append("ok")
            return True
        except InferenceServerException as e:
            outcomes.append(f"{e.status()}: {e.message()}")
            return False

    old = stack.tritonserver()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        in_flight = [pool.submit(attempt, grpc_infer, stack.grpc_url, GRPC_KEY, held),
                     pool.submit(attempt, http_infer, stack.http_url, HTTP_KEY, held)]  # fmt: skip
        until(lambda: marker.exists(), "a request in flight in the model")
        old.send_signal(signal.SIGKILL)
        old.wait(30)
        for f in in_flight:  # each ends (an error, or served after the restart): none hangs
            f.result(client_timeout + 30)

    until(lambda: attempt(grpc_infer, stack.grpc_url, GRPC_KEY), "gRPC to succeed after the restart", interval=0.2)
    until(lambda: attempt(http_infer, stack.http_url, HTTP_KEY), "HTTP to succeed after the restart", interval=0.2)
    hangs = [o for o in outcomes if "DEADLINE" in o or "timed out" in o.lower()]
    assert hangs == [], outcomes
    assert stack.tritonserver().pid != old.pid
    assert stack.metric("snooze_triton_restarts_total") == 1
    for m in ("shared", "crashy"):  # everything published survived; the others wake again
        y = grpc_infer(stack.grpc_url, m, x, headers=GRPC_KEY)
        assert y.shape == x.shape
