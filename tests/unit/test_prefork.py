"""Preforked workers without Triton: the framed protocol, the preloaded parent and the stub's stand-in.

Real processes throughout: a parent started the way a stub starts it, workers forked from it, and a
``sleep`` process standing in for tritonserver (the parent lives as long as it does; killing it ends
every parent and worker a test started). Crash semantics exit the stub's process, so they run in a
child "stub" (``STUB_DRIVER``) whose exit code and notes are checked.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from harness.parallel_torch import PARALLEL_TORCH_MODEL
from harness.probes import until
from python_backend import prefork_connect, preforked
from python_backend.errors import RemoteFailure
from python_backend.journal import start_ticks
from python_backend.prefork_protocol import (
    INFER,
    READY,
    RESULT,
    PeerClosed,
    PeerRegion,
    ProtocolError,
    Region,
    read_tensors,
    recv_frame,
    send_json,
    send_tensors,
)
from python_backend.preforked import PreforkedModel
from python_backend.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------------------------
# The protocol


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield a, b
    a.close()
    b.close()


def round_trip(pair, obj, *, copy: bool, region: Region | None = None, peer: PeerRegion | None = None):
    a, b = pair
    region, peer = region or Region("t"), peer or PeerRegion()
    send_tensors(a, INFER, region, obj)
    kind, body, fd = recv_frame(b)
    assert kind == INFER
    return read_tensors(body, fd, peer, copy=copy)


def test_json_frames_and_a_closed_peer(pair):
    a, b = pair
    send_json(a, READY, {"import_secs": 0.5})
    assert recv_frame(b) == (READY, b'{"import_secs": 0.5}', None)
    a.close()
    with pytest.raises(PeerClosed):
        recv_frame(b)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array([[1, -2]], dtype=np.int64),
        np.array([True, False, True]),
        np.arange(6, dtype=np.float16).reshape(2, 3),
        np.array(3.5, dtype=np.float64),  # 0-d
        np.zeros((0, 5), dtype=np.uint8),  # empty
        np.arange(12, dtype=np.int32).reshape(3, 4).T,  # not contiguous
    ],
    ids=["fp32", "int64", "bool", "fp16", "scalar", "empty", "transposed"],
)
def test_numeric_arrays_round_trip_without_pickle(pair, array):
    got = round_trip(pair, {"x": array, "y": array}, copy=True)
    for name in "xy":
        assert got[name].dtype == array.dtype and got[name].shape == array.shape
        np.testing.assert_array_equal(got[name], array)


def test_views_share_the_region_and_copies_do_not(pair):
    region, peer = Region("t"), PeerRegion()
    view = round_trip(pair, {"x": np.ones(4, np.float32)}, copy=False, region=region, peer=peer)["x"]
    copied = round_trip(pair, {"x": np.full(4, 2, np.float32)}, copy=True, region=region, peer=peer)["x"]
    assert view.flags.writeable and view.tolist() == [2.0] * 4  # the second frame overwrote the region
    assert view.ctypes.data % 64 == 0  # aligned
    round_trip(pair, {"x": np.full(4, 3, np.float32)}, copy=False, region=region, peer=peer)
    assert copied.tolist() == [2.0] * 4


def test_bytes_tensors_and_lists_are_pickled(pair):
    strings = np.array([[b"a"], [b"\x00\xff not utf-8"]], dtype=object)
    raw = {"x": [np.ones((1, 2), np.float32), np.zeros((2, 3), np.float32)], "s": strings}
    got = round_trip(pair, raw, copy=True)
    assert got["s"].tolist() == strings.tolist()
    assert [a.shape for a in got["x"]] == [(1, 2), (2, 3)]


def test_string_tensors_cross_the_framing_with_their_element_types(pair):
    """A preforked model's BYTES inputs (bytes, NUL and non-UTF-8 included) and text outputs (str objects, fixed-width
    unicode) reach the other side as they left: what the stub's checks then make of them is the stub's business."""
    sent = {
        "raw": np.array([[b"a\x00"], [b"\xff\xfe"]], dtype=object),
        "text": np.array([["zürich"], ["straße"]], dtype=object),
        "fixed": np.array([["zürich"], ["oslo"]]),
    }
    got = round_trip(pair, sent, copy=True)
    assert got["raw"].tolist() == [[b"a\x00"], [b"\xff\xfe"]] and type(got["raw"][0, 0]) is bytes
    assert got["text"].tolist() == [["zürich"], ["straße"]] and type(got["text"][0, 0]) is str
    assert got["fixed"].dtype == sent["fixed"].dtype and got["fixed"].tolist() == sent["fixed"].tolist()


def test_a_region_grows_by_replacement_and_old_views_stay_readable(pair):
    region, peer = Region("t"), PeerRegion()
    small = round_trip(pair, {"x": np.arange(4, dtype=np.float64)}, copy=False, region=region, peer=peer)["x"]
    size = region.size
    big = np.arange(1 << 16, dtype=np.float64)
    got = round_trip(pair, {"x": big}, copy=False, region=region, peer=peer)["x"]
    assert region.size > size and region.size >= big.nbytes
    np.testing.assert_array_equal(got, big)
    assert small.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_the_receiver_marks_the_senders_region_when_it_takes_the_tensors(pair):
    a, b = pair
    region, peer = Region("t"), PeerRegion()
    send_tensors(a, INFER, region, {"x": np.ones(2)})
    assert not region.taken()
    kind, body, fd = recv_frame(b)
    read_tensors(body, fd, peer, copy=False, take=True)
    assert region.taken()
    send_tensors(a, INFER, region, {"x": np.ones(2)})
    assert not region.taken()  # every frame starts untaken


def test_a_frame_that_does_not_match_its_table_is_a_protocol_error(pair):
    a, b = pair
    send_tensors(a, RESULT, Region("t"), {"x": np.ones(2)})
    kind, body, fd = recv_frame(b)
    with pytest.raises(ProtocolError):
        read_tensors(body[:-3], fd, PeerRegion(), copy=True)


# ---------------------------------------------------------------------------------------------
# The parent and its workers

MODEL_PY = """
import os
import time

import numpy as np


class Model:
    def __init__(self, scale=2.0):
        self.scale = scale

    def load(self, model_dir, device):
        self.pid = os.getpid()

    def predict(self, inputs):
        x = inputs["x"]
        if (x[:, 0] == -1).any():
            os._exit(7)
        if (x[:, 0] == -2).any():
            time.sleep(float(x[0, 1]))
        if (x[:, 0] == -3).any():
            raise MemoryError("simulated")
        if (x[:, 0] == -4).any():
            raise SystemExit("Stub process 'm_0_0' is not healthy.")
        return {"y": x * self.scale, "pid": np.full((len(x), 1), self.pid, np.int64)}
"""


def write_model(root: Path, name: str = "m", **spec: object) -> tuple[dict, Path]:
    """A model folder as rendered: <version>/package/ and <version>/snooze_runtime.json."""
    version = root / name / "1"
    (version / "package").mkdir(parents=True)
    (version / "package" / "snooze_model.py").write_text(textwrap.dedent(MODEL_PY))
    raw = {
        "format": 1, "model_id": name, "kind": "custom", "entrypoint": "snooze_model.py", "max_batch_size": 8,
        "worker": "preforked", "inputs": [{"name": "x", "datatype": "FP32", "dims": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "dims": [2]}, {"name": "pid", "datatype": "INT64", "dims": [1]}],
        **spec,
    }  # fmt: skip
    (version / "snooze_runtime.json").write_text(json.dumps(raw))
    return raw, version / "package"


@pytest.fixture
def triton() -> Iterator[subprocess.Popen[bytes]]:
    """A process standing in for tritonserver: the parents it gets exit with it."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def journal(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "journal"
    folder.mkdir()
    monkeypatch.setenv("SNOOZE_JOURNAL_DIR", str(folder))
    return folder


def parent_records(journal: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(journal.glob("prefork-*.parent"))]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)  # X: being reaped
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def loaded(triton, journal) -> Iterator:
    """Load stand-ins in this process; all unloaded before the fake Triton goes (a stand-in whose worker
    dies ends its process, as a stub does: here that would be pytest)."""
    made: list[PreforkedModel] = []

    def load(raw: dict, package: Path) -> PreforkedModel:
        model = PreforkedModel(parse_spec(raw), str(package), server_pid=triton.pid)
        made.append(model)
        model.load(str(package), "cpu")
        return model

    yield load
    for model in made:
        model.unload()


def test_one_parent_forks_a_worker_per_instance_and_an_unload_ends_it(tmp_path, triton, journal, loaded):
    raw, package = write_model(tmp_path)
    first, second = loaded(raw, package), loaded(raw, package)
    [record] = parent_records(journal)  # one parent for the same preload set
    assert record["preload"] == ["numpy"] and record["triton_pid"] == triton.pid
    workers = {first.worker_pid, second.worker_pid}
    assert len(workers) == 2 and {c.pid for c in psutil.Process(record["pid"]).children()} == workers
    x = np.array([[1, 2], [3, 4]], np.float32)
    out = first.predict({"x": x})
    np.testing.assert_array_equal(out["y"], x * 2)
    assert out["pid"].ravel().tolist() == [first.worker_pid] * 2  # ran in the worker, not here
    note = journal / f"{os.getpid()}-{start_ticks()}.worker"
    assert json.loads(note.read_text())["pid"] == second.worker_pid  # the last stand-in's note (same process)
    first.unload()
    assert gone(first.worker_pid) and not gone(second.worker_pid)  # returned once the worker is gone
    second.unload()
    assert gone(second.worker_pid) and not gone(record["pid"])  # the parent stays for the next cold start


def test_another_preload_set_or_env_gets_its_own_parent(tmp_path, journal, loaded):
    loaded(*write_model(tmp_path, "a"))
    loaded(*write_model(tmp_path, "b", preload=["json"]))
    loaded(*write_model(tmp_path, "c", env={"SNOOZE_TEST_ENV": "1"}))
    loaded(*write_model(tmp_path, "d"))
    records = parent_records(journal)
    assert len(records) == 3 and sorted(r["preload"] for r in records) == [["numpy"], ["numpy"], ["numpy", "json"]]


def test_the_parent_warms_what_it_preloads_before_forking_unless_told_not_to(tmp_path, journal, loaded):
    model = loaded(*write_model(tmp_path, "a"))
    loaded(*write_model(tmp_path, "b", env={"SNOOZE_PREFORK_WARM_KERNELS": "0"}))
    assert sorted(list(r["warm_secs"]) for r in parent_records(journal)) == [[], ["numpy"]]
    np.testing.assert_array_equal(model.predict({"x": np.ones((1, 2), np.float32)})["y"], [[2, 2]])


def test_kernel_warmers_skip_what_failed_to_import_and_survive_their_own_failure(monkeypatch):
    from python_backend import prefork_preload

    def broken() -> None:
        raise RuntimeError("no BLAS today")

    monkeypatch.setitem(prefork_preload.KERNEL_WARMERS, "numpy", broken)
    assert prefork_preload.warm_kernels({"numpy": 0.1, "json": 0.0, "torch": 0.0}, {"torch": "ImportError"}) == {
        "numpy": pytest.approx(0, abs=1)  # timed, logged, not raised
    }


def test_the_torch_warmer_runs_on_the_cpu_only():
    torch = pytest.importorskip("torch")
    from python_backend.prefork_preload import warm_kernels

    assert set(warm_kernels({"torch": 0.0}, {})) == {"torch"}
    assert not torch.cuda.is_initialized()


def test_the_parent_ends_with_its_triton_and_takes_its_workers(tmp_path, triton, journal):
    stub, worker = run_stub(tmp_path, triton, "idle")
    [record] = parent_records(journal)
    triton.kill()
    triton.wait()
    until(lambda: gone(record["pid"]) and gone(worker), "the parent and its worker to end", timeout=15, interval=0.02)
    assert parent_records(journal) == []  # its record left with it
    assert stub.wait(10) != 0  # and the stub with its worker (a real stub ends with Triton anyway)


def test_a_dead_parent_is_started_again_by_the_next_load(tmp_path, journal, loaded):
    raw, package = write_model(tmp_path)
    first = loaded(raw, package)
    [record] = parent_records(journal)
    os.kill(record["pid"], signal.SIGKILL)
    until(lambda: gone(record["pid"]), "the parent to die", timeout=15, interval=0.02)
    second = loaded(raw, package)
    [again] = [r for r in parent_records(journal) if r["pid"] != record["pid"]]
    assert second.worker_pid in {c.pid for c in psutil.Process(again["pid"]).children()}
    # the first worker outlived its parent and still serves its stub
    assert first.predict({"x": np.ones((1, 2), np.float32)})["y"].tolist() == [[2.0, 2.0]]


def parents_of(key: str) -> list[int]:
    """Live parent processes whose command line names ``key`` (exited ones may linger as zombies)."""
    found = []
    for p in psutil.process_iter(["name"]):
        if p.info["name"] == "snooze-prefork" and not gone(p.pid):
            with contextlib.suppress(psutil.Error):
                if key in " ".join(p.cmdline()):
                    found.append(p.pid)
    return found


def test_parents_started_in_a_race_leave_one(tmp_path, triton, journal):
    raw, _ = write_model(tmp_path)
    identity = prefork_connect.parent_identity(parse_spec(raw), sys.executable, triton.pid)
    for _ in range(3):
        prefork_connect.start_parent(identity)
    until(lambda: parent_records(journal), "a parent", timeout=15, interval=0.02)
    # the others bind, lose and exit (a loaded machine once took over 0.5 s): one parent is left, within a bound
    until(
        lambda: len(parents_of(identity.key)) == 1 and len(parent_records(journal)) == 1,
        lambda: f"one parent left (processes {parents_of(identity.key)}, records {parent_records(journal)})",
        timeout=15,
        interval=0.05,
    )
    time.sleep(0.5)  # and it stays one
    assert len(parents_of(identity.key)) == 1 and len(parent_records(journal)) == 1


def test_failures_are_described_by_the_worker_as_the_stub_would(tmp_path, loaded):
    model = loaded(*write_model(tmp_path))
    with pytest.raises(RemoteFailure) as e:
        model.predict({"x": np.array([[-3, 0]], np.float32)})
    assert e.value.kind == "oom" and str(e.value).startswith("predict ran out of memory on a batch of 1")
    assert model.predict({"x": np.ones((1, 2), np.float32)})["y"].tolist() == [[2.0, 2.0]]  # it survives
    with pytest.raises(RemoteFailure) as e:  # not an Exception, still the model's own error
        model.predict({"x": np.array([[-4, 0]], np.float32)})
    assert e.value.kind == "model_error"  # raised in the model's own code
    assert str(e.value).startswith("predict raised SystemExit: Stub process 'm_0_0' is not healthy. at ")
    assert model.predict({"x": np.ones((1, 2), np.float32)})["y"].tolist() == [[2.0, 2.0]]


def test_a_load_failure_ends_the_worker_and_says_why(tmp_path, triton, journal):
    raw, package = write_model(tmp_path)
    (package / "snooze_model.py").write_text("import snooze_no_such_module\n")
    model = PreforkedModel(parse_spec(raw), str(package), server_pid=triton.pid)
    with pytest.raises(RemoteFailure) as e:
        model.load(str(package), "cpu")
    assert e.value.kind == "model_error" and "import raised ModuleNotFoundError" in str(e.value)
    until(lambda: gone(model.worker_pid), "the failed worker to end", timeout=15, interval=0.02)


def test_without_a_parent_the_model_loads_in_the_stub(tmp_path, journal, loaded, monkeypatch, capsys):
    monkeypatch.setattr(preforked, "find_interpreter", lambda: None)
    model = loaded(*write_model(tmp_path))
    assert model.worker_pid is None and model.direct_predict is None
    assert model.predict({"x": np.ones((1, 2), np.float32)})["pid"].tolist() == [[os.getpid()]]
    assert "loading in the stub instead" in capsys.readouterr().err
    assert parent_records(journal) == []


# ---------------------------------------------------------------------------------------------
# A worker's death ends its stub: in a child process standing in for the stub

STUB_DRIVER = """
import json, os, sys, time
import numpy as np
from python_backend.journal import RequestJournal
from python_backend.preforked import PreforkedModel
from python_backend.spec import load_spec

spec_path, triton_pid, action = sys.argv[1], int(sys.argv[2]), sys.argv[3]
package = os.path.join(os.path.dirname(spec_path), "package")
model = PreforkedModel(load_spec(spec_path), package, server_pid=triton_pid)
model.load(package, "cpu")
journal = RequestJournal.from_environment()

class Request:
    def parameters(self):
        return json.dumps({"x-request-id": "req-1"})

journal.record([Request()])
print(model.worker_pid, flush=True)
if action == "poison":
    model.predict({"x": np.array([[-1, 0]], np.float32)})
time.sleep(60)  # idle: its worker is killed from outside
"""


def run_stub(tmp_path: Path, triton, action: str) -> tuple[subprocess.Popen[str], int]:
    raw, package = write_model(tmp_path)
    stub = subprocess.Popen(
        [sys.executable, "-c", STUB_DRIVER, str(package.parent / "snooze_runtime.json"), str(triton.pid), action],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, env=os.environ.copy(),
    )  # fmt: skip
    assert stub.stdout is not None
    return stub, int(stub.stdout.readline())


def notes(journal: Path, stub_pid: int) -> tuple[dict, bytes]:
    [note] = journal.glob(f"{stub_pid}-*.worker")
    [entry] = journal.glob(f"{stub_pid}-*.journal")
    raw = entry.read_bytes()
    return json.loads(note.read_text()), raw[4 : 4 + int.from_bytes(raw[:4], "little")]


def test_a_worker_dying_in_a_batch_ends_its_stub_with_its_status(tmp_path, triton, journal):
    stub, worker = run_stub(tmp_path, triton, "poison")
    assert stub.wait(30) == 7  # the worker's exit code
    note, batch = notes(journal, stub.pid)
    assert (note["pid"], note["exit_status"], note["ran"]) == (worker, 7 << 8, True)
    assert batch == b"req-1"  # it reached the worker: never to be run again


def test_a_worker_dying_while_idle_ends_its_stub_and_clears_its_batch(tmp_path, triton, journal):
    stub, worker = run_stub(tmp_path, triton, "idle")
    os.kill(worker, signal.SIGKILL)
    assert stub.wait(30) == 128 + signal.SIGKILL
    note, batch = notes(journal, stub.pid)
    assert (note["exit_status"], note["ran"], note["ended"]) == (signal.SIGKILL, False, "while idle")
    assert batch == b""  # it never reached a live model process: the control plane may send it again


def test_a_killed_stub_takes_its_worker(tmp_path, triton, journal):
    stub, worker = run_stub(tmp_path, triton, "idle")
    stub.kill()
    stub.wait()
    until(lambda: gone(worker), "the worker to follow its stub", timeout=10, interval=0.02)


def test_the_stub_polls_briefly_for_an_answer_then_leaves_the_wait_to_recv(pair):
    a, b = pair
    started = time.perf_counter()
    preforked._poll_briefly(a, started + 0.05)  # nothing comes: back at the deadline
    assert 0.05 <= time.perf_counter() - started < 1.0
    send_json(b, READY, {})
    started = time.perf_counter()
    preforked._poll_briefly(a, started + 5.0)  # an answer is there: back at once
    assert time.perf_counter() - started < 1.0 and recv_frame(a)[0] == READY


# ---------------------------------------------------------------------------------------------
# Real parallelism in a worker: the preloaded parent must not fork with a thread pool running


TORCH_DRIVER = """
import json, sys
import numpy as np
from python_backend.preforked import PreforkedModel
from python_backend.runners import build_model
from python_backend.spec import load_spec

spec_path, triton_pid, cycles, result_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
spec = load_spec(spec_path)
package = spec_path.rsplit("/", 1)[0] + "/package"
x = np.array([[1.0, 0.5], [2.0, 0.5]], np.float32)
answers = []
for _ in range(cycles):  # a wake: a fresh worker forked from the same parent, one request, an unload
    model = PreforkedModel(spec, package, server_pid=triton_pid)
    model.load(package, "cpu")
    out = model.predict({"x": x})
    answers.append({"worker": model.worker_pid, "pid": int(out["pid"][0, 0]), "y": out["y"].tolist(),
                    "threads": int(out["threads"][0, 0])})
    model.unload()
import torch
reference = build_model(spec, package)
reference.load(package, "cpu")
with open(result_path, "w") as f:  # not stdout: the parent it started holds that open
    json.dump({"answers": answers, "reference": reference.predict({"x": x})["y"].tolist(),
               "threads": torch.get_num_threads(), "parallel_info": torch.__config__.parallel_info()}, f)
"""


# The machine's default thread count, not one a package's env left in this process (an in-process run of a
# package applies its manifest's env, e.g. OMP_NUM_THREADS=1, to os.environ).
def threads_unset() -> dict[str, str]:
    pools = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    return {k: v for k, v in os.environ.items() if k not in pools}


@pytest.mark.timeout(240)
def test_a_preforked_torch_model_running_parallel_ops_answers_like_torch_across_wakes(tmp_path, triton, journal):
    pytest.importorskip("torch")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: no op goes parallel here")
    raw, package = write_model(tmp_path, "t", preload=["torch"], max_batch_size=4)
    (package / "snooze_model.py").write_text(PARALLEL_TORCH_MODEL)
    raw["outputs"].append({"name": "threads", "datatype": "INT64", "dims": [1]})
    (package.parent / "snooze_runtime.json").write_text(json.dumps(raw))
    cycles, result_path = 20, tmp_path / "result.json"
    driver = subprocess.Popen(
        [sys.executable, "-c", TORCH_DRIVER, str(package.parent / "snooze_runtime.json"), str(triton.pid), str(cycles),
         str(result_path)],
        cwd=ROOT, env=threads_unset(),
    )  # fmt: skip
    try:
        assert driver.wait(timeout=150) == 0
    except subprocess.TimeoutExpired:
        driver.kill()
        driver.wait()
        pytest.fail("a preforked torch model hung (a worker forked with the parent's OpenMP pool running?)")
    result = json.loads(result_path.read_text())
    assert "OpenMP" in result["parallel_info"] and result["threads"] >= 2  # its ops do go parallel here
    answers = result["answers"]
    assert len(answers) == cycles and len({a["worker"] for a in answers}) == cycles
    for answer in answers:
        assert answer["pid"] == answer["worker"]  # ran in the worker
        assert answer["threads"] == result["threads"]  # the worker got the configured thread count back
        np.testing.assert_allclose(answer["y"], result["reference"], rtol=1e-5)
    [record] = parent_records(journal)
    # the parent forked with no thread pool running: numpy's OpenBLAS threads at most (they stop for a fork)
    assert record["unsafe_threads"] == 0 and record["threads"] == 1 + record["fork_safe_threads"]
    assert record["thread_pools"]["torch"] == result["threads"]


def test_a_parent_running_a_thread_that_does_not_survive_a_fork_refuses_and_the_model_loads_in_its_stub(
    tmp_path, journal, loaded, monkeypatch, capfd
):
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "snooze_starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(modules))  # the parent's interpreter finds it
    model = loaded(*write_model(tmp_path, preload=["snooze_starts_a_thread"]))
    assert model.worker_pid is None and model.in_stub is not None  # no fork: it loaded here
    assert model.predict({"x": np.ones((1, 2), np.float32)})["pid"].tolist() == [[os.getpid()]]
    [record] = parent_records(journal)
    assert record["unsafe_threads"] == 1 and not parents_children(record["pid"])
    err = capfd.readouterr().err
    assert "started by importing snooze_starts_a_thread" in err  # the parent's log says which and why
    assert "do not survive a fork" in err and "loading in the stub instead" in err


def parents_children(pid: int) -> list[int]:
    return [c.pid for c in psutil.Process(pid).children() if not gone(c.pid)]


def spare_of(parent_pid: int, timeout: float = 10.0) -> psutil.Process:
    """The parent's spare worker, once it is forked."""
    deadline = time.monotonic() + timeout
    while True:
        spares = [c for c in psutil.Process(parent_pid).children() if not gone(c.pid) and c.name() == "snooze-spare"]
        if spares:
            return spares[0]
        assert time.monotonic() < deadline, "the parent forked no spare worker"
        time.sleep(0.02)


SPARE_SPEC = {"preload": ["snooze_starts_a_thread"], "env": {"SNOOZE_PREFORK_SPARE_IMPORTS": "snooze_starts_a_thread"}}


def thread_starting_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module that stands in for onnxruntime, whose import starts a native thread (FORK_UNSAFE_IMPORTS)."""
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "snooze_starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(modules))  # the parent's interpreter finds it


def test_a_module_whose_import_starts_threads_is_imported_by_a_spare_after_its_fork(
    tmp_path, triton, journal, loaded, monkeypatch
):
    # the parent must not import the module, yet each worker should find it imported when its load starts
    thread_starting_module(tmp_path, monkeypatch)
    spec = SPARE_SPEC
    first = loaded(*write_model(tmp_path, "a", **spec))
    [record] = parent_records(journal)
    assert record["spare_imports"] == ["snooze_starts_a_thread"] and record["unsafe_threads"] == 0
    assert first.worker_pid is not None and first.in_stub is None  # forked, not refused
    assert record["threads"] == 1 + record["fork_safe_threads"]  # the parent never imported it: no thread of its
    spare = spare_of(record["pid"])  # the next one, forked after the first was handed its model
    assert spare.pid != first.worker_pid
    deadline = time.monotonic() + 10
    while len(spare.threads()) < 2:  # it imports the module after its fork: then the module's thread runs in it
        assert time.monotonic() < deadline, "the spare never imported the module"
        time.sleep(0.02)
    second = loaded(*write_model(tmp_path, "b", **spec))
    assert second.worker_pid == spare.pid  # the spare became the next worker
    assert psutil.Process(second.worker_pid).name() == "snooze-worker"
    x = np.array([[1, 2]], np.float32)
    for model in (first, second):
        out = model.predict({"x": x})
        np.testing.assert_array_equal(out["y"], x * 2)
        assert out["pid"].tolist() == [[model.worker_pid]]
    first.unload()
    second.unload()
    third = spare_of(record["pid"])
    triton.kill()  # the parent ends with its Triton, and takes its spare with it
    triton.wait()
    deadline = time.monotonic() + 10
    while not (gone(third.pid) and gone(record["pid"])) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gone(third.pid) and gone(record["pid"])


try:
    from controlplane.lifecycle import workers as control_plane_workers
except ImportError:  # the runtime's own run on Python 3.10 (make test-runtime-py310) has no control plane
    control_plane_workers = None  # type: ignore[assignment]


@pytest.mark.skipif(control_plane_workers is None, reason="the control plane is not installed (runtime-only run)")
def test_the_control_plane_charges_the_spare_as_the_parents_memory(tmp_path, journal, loaded, monkeypatch):
    assert control_plane_workers is not None
    thread_starting_module(tmp_path, monkeypatch)
    model = loaded(*write_model(tmp_path, "a", **SPARE_SPEC))
    [record] = parent_records(journal)
    spare = spare_of(record["pid"])
    deadline = time.monotonic() + 10
    while (found := control_plane_workers.parents(journal)) and found[0].spare is None:
        assert time.monotonic() < deadline, "the parent's record never named its spare"
        time.sleep(0.02)  # the record names the spare just after its fork
    [parent] = control_plane_workers.parents(journal)
    assert parent.spare is not None and parent.spare[0] == spare.pid and parent.pids() == [record["pid"], spare.pid]
    line = control_plane_workers.parent_status(parent)
    assert line["spare_pid"] == spare.pid and line["workers"] == 1 and line["spare_imports"] == SPARE_SPEC["preload"]
    from controlplane.triton.processes import held_bytes

    assert control_plane_workers.parents_bytes(journal) > held_bytes([record["pid"]])  # the spare is in it
    model.unload()
