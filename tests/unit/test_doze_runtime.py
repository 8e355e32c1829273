"""Dozing in the runtime, without Triton: a preforked model's stand-in (``PreforkedModel``) and its ``DozeControl``
asked over the doze socket by the control plane's client (``controlplane.triton.stub_control``).

Real processes: a parent started the way a stub starts it, workers forked from it, a ``sleep`` standing in for
tritonserver. A wake whose worker dies ends its stub's process, so that case runs in a child "stub"
(``STUB_DRIVER``) whose exit code and notes are checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from controlplane.triton.processes import StubProcess
from controlplane.triton.stub_control import SocketStubControl
from harness.probes import until
from harness.wake_route import WakeRoute
from python_backend import preforked
from python_backend.bls_wake import WAKE_SOCKET
from python_backend.doze import ADMIT_PATH, ADMIT_TIMEOUT_ENV, DEFAULT_ADMIT_TIMEOUT_SECS, DOZE_SUFFIX, DozeControl
from python_backend.errors import RemoteFailure
from python_backend.journal import start_ticks
from python_backend.preforked import PreforkedModel
from python_backend.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]

# What load() and unload() do is steered by files in the package folder, so that one model shows each case.
MODEL_PY = """
import os
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.path.exists(os.path.join(HERE, name))


class Model:
    def load(self, model_dir, device):
        if _flag("load_raises"):
            raise ValueError("no weights today")
        if _flag("load_hangs"):
            time.sleep(60)
        if _flag("load_dies"):
            os._exit(9)
        self.weights = np.ones(4 * 1024 * 1024 // 8)  # touched: 4 MiB resident in the worker
        self.pid = os.getpid()

    def predict(self, inputs):
        return {"y": inputs["x"] * 2, "pid": np.full((len(inputs["x"]), 1), self.pid, np.int64)}

    def unload(self):
        if _flag("unload_hangs"):
            time.sleep(60)
"""


def write_model(root: Path, name: str = "m", **spec: object) -> tuple[dict, Path]:
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


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


def this_stub() -> StubProcess:
    """This test process, as the control plane names the stub that listens (the doze socket is its own)."""
    return StubProcess(os.getpid(), start_ticks(), "m", "m_0_0")


@pytest.fixture
def dozable(tmp_path, triton, journal) -> Iterator:
    """A loaded stand-in and its doze control (closed, and the model unloaded, at the end)."""
    made: list[tuple[PreforkedModel, DozeControl]] = []

    def load(**spec: object) -> tuple[PreforkedModel, DozeControl, Path]:
        raw, package = write_model(tmp_path, **spec)
        model = PreforkedModel(parse_spec(raw), str(package), server_pid=triton.pid)
        model.load(str(package), "cpu")
        control = DozeControl.for_model(model, "m")
        assert control is not None
        made.append((model, control))
        return model, control, package

    yield load
    for model, control in made:
        control.close()
        model.unload()


def batch(model: PreforkedModel, control: DozeControl, rows: int = 1) -> dict:
    """One batch as ``TritonPythonModel.execute`` runs it: under the doze lock, waking first."""
    with control.lock:
        if control.dozing:
            control.wake()
        return model.predict_in_worker({"x": np.ones((rows, 2), np.float32)})


def test_a_doze_ends_the_worker_and_the_next_batch_wakes_a_new_one(dozable, journal):
    model, control, _ = dozable()
    first = model.worker_pid
    assert first is not None
    stubs = SocketStubControl(journal)
    answer = stubs.doze(this_stub())
    assert answer.dozed and control.dozing
    until(lambda: gone(first), "the worker to be gone after the doze", timeout=10, interval=0.02)
    assert not list(journal.glob(f"{os.getpid()}-*.worker"))  # no note: no worker
    assert stubs.woke(this_stub()) is None
    assert not stubs.doze(this_stub()).dozed  # dozing already

    out = batch(model, control, rows=3)
    assert out["y"].tolist() == [[2.0, 2.0]] * 3
    second = model.worker_pid
    assert second not in (None, first) and out["pid"].ravel().tolist() == [second] * 3
    woke = stubs.woke(this_stub())
    assert woke is not None and woke.worker_pid == second and woke.secs is not None and woke.secs > 0
    assert not control.dozing and control.wakes == 1


def test_a_doze_waits_for_no_batch_it_is_refused_while_one_runs(dozable, journal):
    model, control, _ = dozable()
    stubs = SocketStubControl(journal)
    with control.lock:  # a batch runs
        answer = stubs.doze(this_stub())
    assert not answer.dozed and answer.busy
    assert not control.dozing and not gone(model.worker_pid or 0)
    assert stubs.doze(this_stub()).dozed  # once the batch is over


def test_a_wake_whose_load_raises_answers_with_it_and_stays_dozing(dozable, journal):
    model, control, package = dozable()
    assert SocketStubControl(journal).doze(this_stub()).dozed
    (package / "load_raises").touch()
    with pytest.raises(RemoteFailure, match="no weights today") as caught:
        batch(model, control)
    assert caught.value.kind == "model_error"
    assert control.dozing and gone(model.worker_pid or 0)
    (package / "load_raises").unlink()
    assert batch(model, control)["y"].tolist() == [[2.0, 2.0]]


def test_a_wake_past_load_timeout_ends_its_worker_and_says_so(dozable, journal):
    model, control, package = dozable(load_timeout_secs=0.5)
    assert SocketStubControl(journal).doze(this_stub()).dozed
    (package / "load_hangs").touch()
    with pytest.raises(RemoteFailure, match="load_timeout_secs=0.5") as caught:
        batch(model, control)
    assert caught.value.kind == "timeout" and control.dozing
    assert gone(model.worker_pid or 0)  # the hung worker was ended
    (package / "load_hangs").unlink()
    assert batch(model, control)["y"].tolist() == [[2.0, 2.0]]


def test_a_doze_whose_unload_hangs_ends_the_worker_within_its_bound(dozable, journal, monkeypatch):
    monkeypatch.setattr(preforked, "DOZE_UNLOAD_SECS", 0.3)
    model, control, package = dozable()
    worker = model.worker_pid
    (package / "unload_hangs").touch()
    answer = SocketStubControl(journal).doze(this_stub())
    assert answer.dozed and answer.secs is not None and answer.secs < 0.3 + preforked.WORKER_EXIT_SECS
    assert gone(worker or 0)


def test_dozing_and_batches_interleave_without_a_batch_reaching_no_worker(dozable, journal):
    model, control, _ = dozable()
    stubs = SocketStubControl(journal)
    errors: list[BaseException] = []
    stop = threading.Event()

    def batches() -> None:
        try:
            while not stop.wait(0.002):  # a gap between batches, where a doze can come
                assert batch(model, control)["y"].tolist() == [[2.0, 2.0]]
        except BaseException as e:  # reported by the test
            errors.append(e)

    runner = threading.Thread(target=batches)
    runner.start()
    dozed = 0
    for _ in range(30):
        dozed += stubs.doze(this_stub()).dozed
        time.sleep(0.01)
    stop.set()
    runner.join(30)
    assert not errors and not runner.is_alive()
    assert dozed > 0 and control.wakes >= dozed - 1  # every doze but maybe the last was woken by a batch


def test_a_model_that_loaded_in_its_stub_cannot_doze(tmp_path, journal, monkeypatch):
    monkeypatch.setattr(preforked, "find_interpreter", lambda: None)
    raw, package = write_model(tmp_path)
    model = PreforkedModel(parse_spec(raw), str(package))
    model.load(str(package), "cpu")
    assert not model.can_doze and DozeControl.for_model(model, "m") is None
    assert not list(journal.glob(f"*{DOZE_SUFFIX}"))


STUB_DRIVER = """
import json, os, sys
import numpy as np
from python_backend.doze import DozeControl
from python_backend.journal import RequestJournal
from python_backend.preforked import PreforkedModel
from python_backend.spec import load_spec

spec_path, triton_pid = sys.argv[1], int(sys.argv[2])
package = os.path.join(os.path.dirname(spec_path), "package")
model = PreforkedModel(load_spec(spec_path), package, server_pid=triton_pid)
model.load(package, "cpu")
journal = RequestJournal.from_environment()
control = DozeControl.for_model(model, "m", journal)

class Request:
    def parameters(self):
        return json.dumps({"x-request-id": "req-1"})

journal.record([Request()])
journal.batch_done()  # an earlier batch, answered
control._answer(b"doze")
open(os.path.join(package, "load_dies"), "w").close()
print("dozed", flush=True)
with control.lock:
    control.wake()  # its worker dies loading: this process ends
"""


def test_a_worker_dying_in_its_wake_ends_the_stub_with_the_batch_unjournaled(tmp_path, triton, journal):
    raw, package = write_model(tmp_path)
    stub = subprocess.Popen(
        [sys.executable, "-c", STUB_DRIVER, str(package.parent / "snooze_runtime.json"), str(triton.pid)],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, env=os.environ.copy(),
    )  # fmt: skip
    assert stub.stdout is not None and stub.stdout.readline().strip() == "dozed"
    assert stub.wait(30) == 9  # the worker's exit code
    [note] = journal.glob(f"{stub.pid}-*.worker")
    fields = json.loads(note.read_text())
    assert (fields["ran"], fields["ended"]) == (False, "waking from doze")
    [entry] = journal.glob(f"{stub.pid}-*.journal")
    raw_journal = entry.read_bytes()
    assert raw_journal[4 : 4 + int.from_bytes(raw_journal[:4], "little")] == b""  # nothing for recovery to refuse


def test_a_wake_asks_the_control_plane_for_room_before_it_forks(dozable, journal):
    model, control, _ = dozable()
    assert SocketStubControl(journal).doze(this_stub()).dozed
    with WakeRoute(journal / WAKE_SOCKET, lambda: model.worker_pid) as route:
        assert batch(model, control)["y"].tolist() == [[2.0, 2.0]]
        assert batch(model, control)["y"].tolist() == [[2.0, 2.0]]  # awake: nothing to ask
    [(path, body, worker)] = route.asks
    assert path == ADMIT_PATH + "m" and body["stub"] == [os.getpid(), start_ticks()]
    assert worker is None and model.worker_pid is not None  # asked while no worker lived; forked after
    assert 0 < body["timeout_secs"] < DEFAULT_ADMIT_TIMEOUT_SECS
    assert control.last_ask_secs is not None and control.last_wake_secs is not None
    assert control.last_ask_secs <= control.last_wake_secs


def test_a_wake_goes_ahead_when_the_control_plane_does_not_answer_within_its_bound(dozable, journal, monkeypatch):
    monkeypatch.setenv(ADMIT_TIMEOUT_ENV, "0.3")
    model, control, _ = dozable()
    assert SocketStubControl(journal).doze(this_stub()).dozed
    with WakeRoute(journal / WAKE_SOCKET) as route:
        route.hang = 5.0
        started = time.monotonic()
        assert batch(model, control)["y"].tolist() == [[2.0, 2.0]]
        assert 0.3 <= time.monotonic() - started < 4.0 and len(route.asks) == 1
        # the next wakes go ahead without asking for a while: one slow wake, not one each
        assert SocketStubControl(journal).doze(this_stub()).dozed
        assert batch(model, control)["y"].tolist() == [[2.0, 2.0]]
        assert len(route.asks) == 1 and control.last_ask_secs is None


def test_a_wake_with_no_control_plane_to_ask_goes_ahead_at_once(dozable, journal):
    model, control, _ = dozable()
    assert SocketStubControl(journal).doze(this_stub()).dozed
    assert not (journal / WAKE_SOCKET).exists()
    assert batch(model, control)["y"].tolist() == [[2.0, 2.0]]
    assert control.last_ask_secs is not None and control.last_ask_secs < 1.0
