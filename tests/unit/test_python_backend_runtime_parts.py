"""Spec parsing, error mapping, the user-code thread and model building of the python-backend runtime."""

from __future__ import annotations

import ast
import json
import pathlib
import sys
import threading
import time

import pytest

import python_backend
from python_backend.errors import describe_failure, is_oom, traceback_summary
from python_backend.runners import CallingThread, UserThread, build_model, device_for, runner_for
from python_backend.spec import SpecError, load_spec, parse_spec

BASE = {
    "format": 1,
    "model_id": "m1",
    "kind": "custom",
    "entrypoint": "snooze_model.py",
    "max_batch_size": 2,
    "inputs": [{"name": "x", "datatype": "FP32", "dims": [3]}],
    "outputs": [{"name": "y", "datatype": "FP32", "dims": [3]}],
}


def test_parse_spec_defaults():
    spec = parse_spec(BASE)
    assert spec.tensor_format == "numpy" and spec.class_name == "Model"
    assert spec.params == {} and spec.env == {} and spec.request_timeout_secs is None
    assert spec.worker == "in-stub" and spec.preload == ()
    assert spec.inputs[0].dtype.name == "float32"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"format": 2}, "format 2 is not supported"),
        ({"kind": "torch"}, "'kind' is 'torch'"),
        ({"entrypoint": None}, "needs 'entrypoint'"),
        ({"kind": "onnx"}, "needs 'onnx_file'"),
        ({"tensor_format": "arrow"}, "'tensor_format' is 'arrow'"),
        ({"env": {"A": 1}}, "'env' must map names to string values"),
        ({"max_batch_size": -1}, "'max_batch_size' must be an integer >= 0"),
        ({"inputs": [{"name": "x", "datatype": "BF16", "dims": [1]}]}, "datatype 'BF16' is not supported"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "dims": [-2]}]}, "dims must be a list of integers"),
        ({"outputs": []}, "must each declare at least one tensor"),
        ({"worker": "forked"}, "'worker' is 'forked'; expected one of ['in-stub', 'preforked']"),
        ({"preload": ["torch", "no such"]}, "'preload' must be a list of module names"),
    ],
)
def test_parse_spec_rejects(change, needle):
    with pytest.raises(SpecError) as e:
        parse_spec({**BASE, **change}, source="x/snooze_runtime.json")
    assert needle in str(e.value) and str(e.value).startswith("x/snooze_runtime.json: ")


def test_load_spec_missing_file_says_what_to_do(tmp_path):
    with pytest.raises(SpecError, match="re-render the model"):
        load_spec(str(tmp_path / "snooze_runtime.json"))


def test_oom_detection():
    assert is_oom(MemoryError())
    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 20 MiB"))
    assert is_oom(RuntimeError("[ONNXRuntimeError] : 6 : Failed to allocate memory: out of memory"))
    assert not is_oom(ValueError("shape mismatch"))


def _inner():
    raise KeyError("boom")


def _outer():
    _inner()


def test_internal_error_carries_innermost_frames():
    try:
        _outer()
    except KeyError as e:
        kind, message = describe_failure(e, "m1", "predict", 4)
        summary = traceback_summary(e)
    assert kind == "internal"
    assert summary.startswith("test_python_backend_runtime_parts.py:") and " in _inner <- " in summary
    assert message == (
        f"[snooze:internal] model 'm1': predict raised KeyError: 'boom' at {summary}; fix the model's predict"
    )


def test_device_for_instance_kind():
    assert device_for("CPU", "0") == "cpu"
    assert device_for("GPU", "1") == "cuda:1"
    assert device_for("MODEL", "0") == "cpu"


def test_user_thread_runs_every_call_on_one_thread():
    worker = UserThread("t")
    try:
        ids = {worker.call(threading.get_ident) for _ in range(3)}
        assert len(ids) == 1 and threading.get_ident() not in ids
        with pytest.raises(ZeroDivisionError):
            worker.call(lambda: 1 / 0)
    finally:
        worker.stop()


def test_user_thread_timeout_then_busy_then_recovers():
    worker = UserThread("t")
    release = threading.Event()
    try:
        with pytest.raises(Exception) as e:
            worker.call(release.wait, timeout=0.1)
        assert e.value.kind == "timeout"
        assert "did not finish within request_timeout_secs=0.1 s" in str(e.value)
        with pytest.raises(Exception) as e:
            worker.call(lambda: 1)
        assert e.value.kind == "timeout" and "still running a predict call" in str(e.value)
        release.set()
        deadline = time.monotonic() + 5
        while worker.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.call(lambda: 7, timeout=1) == 7
    finally:
        release.set()
        worker.stop()


def test_user_thread_without_timeout_waits_however_long_the_call_takes():
    worker = UserThread("t")
    try:
        assert worker.call(lambda: time.sleep(0.3) or "slow", timeout=None) == "slow"
        # beyond what a lock wait accepts (threading.TIMEOUT_MAX): no limit, not an OverflowError
        assert worker.call(lambda: "huge", timeout=1e300) == "huge"
        assert not worker.busy
    finally:
        worker.stop()


def test_user_thread_stop_does_not_wait_for_an_overrunning_call():
    worker = UserThread("t")
    release = threading.Event()
    try:
        with pytest.raises(Exception, match="did not finish"):
            worker.call(release.wait, timeout=0.05)
        start = time.monotonic()
        worker.stop()
        assert time.monotonic() - start < 0.5 and worker.busy
    finally:
        release.set()
    worker._thread.join(5)  # the loop ends once the overrunning call returns
    assert not worker._thread.is_alive()


def test_user_thread_passes_user_timeout_error_through():
    worker = UserThread("t")

    def raises_timeout():
        raise TimeoutError("upstream service timed out")

    try:
        with pytest.raises(TimeoutError, match="upstream service"):
            worker.call(raises_timeout, timeout=5)
        assert not worker.busy
    finally:
        worker.stop()


@pytest.mark.parametrize(
    ("timeout", "runner"), [(60, UserThread), (0.5, UserThread), (None, CallingThread), (0, CallingThread)]
)
def test_a_thread_hand_off_only_when_there_is_a_limit_to_enforce(timeout, runner):
    spec = parse_spec({**BASE, "request_timeout_secs": timeout})
    worker = runner_for(spec, "t")
    try:
        assert type(worker) is runner
    finally:
        worker.stop()


def test_calling_thread_runs_calls_inline_and_limited_calls_on_a_thread_of_their_own():
    worker = CallingThread("t")
    here = threading.get_ident()
    assert worker.call(threading.get_ident) == here
    with pytest.raises(ZeroDivisionError):
        worker.call(lambda: 1 / 0)
    assert worker.call(threading.get_ident, timeout=5, what="unload") != here
    release = threading.Event()
    try:
        with pytest.raises(Exception) as e:
            worker.call(release.wait, timeout=0.05, what="unload")
        assert e.value.kind == "timeout" and "unload did not finish within" in str(e.value)
        assert not worker.busy
    finally:
        release.set()
    worker.stop()


def test_build_model_imports_entrypoint_with_params(tmp_path, monkeypatch):
    # build_model puts package/ on sys.path and imports modules: undo both afterwards.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    package = tmp_path / "package"
    package.mkdir()
    (package / "helper_mod_pbunit.py").write_text("FACTOR = 3\n")
    (package / "entry_pbunit.py").write_text(
        "from helper_mod_pbunit import FACTOR\n"
        "class Net:\n"
        "    def __init__(self, scale):\n"
        "        self.scale = scale * FACTOR\n"
        "    def load(self, model_dir, device): pass\n"
        "    def predict(self, inputs): return inputs\n"
    )
    spec = parse_spec({**BASE, "entrypoint": "entry_pbunit.py", "class_name": "Net", "params": {"scale": 2}})
    assert build_model(spec, str(package)).scale == 6
    assert sys.path[0] == str(package)
    with pytest.raises(SpecError, match="defines no class 'Nope'"):
        build_model(parse_spec({**BASE, "entrypoint": "entry_pbunit.py", "class_name": "Nope"}), str(package))
    with pytest.raises(SpecError, match="entrypoint 'nope.py' is not in"):
        build_model(parse_spec({**BASE, "entrypoint": "nope.py"}), str(package))


def test_runtime_files_are_self_contained_and_portable():
    files = python_backend.runtime_files()
    names = {pathlib.Path(f).name for f in files}
    assert "triton_model.py" in names and all(pathlib.Path(f).is_file() for f in files)
    allowed = set(sys.stdlib_module_names) | {"numpy"}  # the standard library and numpy, nothing else
    for path in files:
        # feature_version: the official image's python backend embeds Python 3.10
        tree = ast.parse(pathlib.Path(path).read_text(), feature_version=(3, 10))
        for node in tree.body:  # module level only: lazy imports inside functions are allowed
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                needed = f"{node.module}.py" if node.module else "__init__.py"
                assert needed in names, f"{path} needs {needed}, which is not copied"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                roots = {a.name.split(".")[0] for a in node.names} if isinstance(node, ast.Import) else {
                    node.module.split(".")[0]}
                assert roots <= allowed, f"{path} imports {roots - allowed} at module level"


def test_spec_file_round_trip(tmp_path):
    path = tmp_path / "snooze_runtime.json"
    path.write_text(json.dumps({**BASE, "request_timeout_secs": 0, "env": {"A": "1"}}))
    spec = load_spec(str(path))
    assert spec.request_timeout_secs is None and spec.env == {"A": "1"}
