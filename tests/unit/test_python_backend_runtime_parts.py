"""Spec parsing, error mapping, the predict watchdog and model building of the python-backend runtime."""

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
from python_backend.runners import PredictWatchdog, build_model, call_with_limit, device_for
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


def test_model_error_carries_innermost_frames():
    try:
        _outer()
    except KeyError as e:
        kind, message = describe_failure(e, "m1", "predict", 4)
        summary = traceback_summary(e)
    assert kind == "model_error"  # raised in the model's code (this file), not in the runtime
    assert summary.startswith("test_python_backend_runtime_parts.py:") and " in _inner <- " in summary
    assert message == (
        f"[snooze:model_error] model 'm1': predict raised KeyError: 'boom' at {summary}; fix the model's predict"
    )


def test_a_missing_module_in_load_is_the_models_error_and_says_where_to_install():
    try:
        exec(compile("import sklearnx_not_installed\n", "snooze_model.py", "exec"), {})
    except ImportError as e:
        kind, message = describe_failure(e, "m1", "load", None)
    assert kind == "model_error"
    assert message.startswith(
        "[snooze:model_error] model 'm1': load raised ModuleNotFoundError: No module named 'sklearnx_not_installed'"
    )
    assert message.endswith("docs/packages.md#dependencies)")


def test_a_failure_inside_the_runtime_stays_internal():
    import python_backend.errors as errors

    try:
        errors.without_prefix("k", "m", None)  # type: ignore[arg-type]  # the runtime's own code fails
    except AttributeError as e:
        e.__traceback__ = e.__traceback__.tb_next  # the runtime's frames only, as when the runtime catches it
        kind, message = describe_failure(e, "m1", "predict", 1)
    assert kind == "internal" and message.startswith("[snooze:internal] model 'm1': predict raised AttributeError")


def test_device_for_instance_kind():
    assert device_for("CPU", "0") == "cpu"
    assert device_for("GPU", "1") == "cuda:1"
    assert device_for("MODEL", "0") == "cpu"


def test_call_with_limit_runs_on_a_thread_of_its_own_and_leaves_an_overrunning_call_behind():
    here = threading.get_ident()
    assert call_with_limit(threading.get_ident, timeout=5, what="unload", name="t") != here
    with pytest.raises(ZeroDivisionError):
        call_with_limit(lambda: 1 / 0, timeout=5, what="unload", name="t")
    release = threading.Event()
    try:
        started = time.monotonic()
        with pytest.raises(Exception) as e:
            call_with_limit(release.wait, timeout=0.1, what="unload", name="t")
        assert e.value.kind == "timeout" and "unload did not finish within 0.1 s" in str(e.value)
        assert time.monotonic() - started < 1.0
    finally:
        release.set()


class Stub:
    """Drives a PredictWatchdog the way triton_model.execute does, on this (the 'stub's') thread."""

    def __init__(self, timeout: float) -> None:
        self.overruns: list[tuple[object, float, float]] = []
        self.watch = PredictWatchdog(timeout, self._overran, "test-watchdog")

    def _overran(self, requests: object, started: float) -> None:
        self.overruns.append((requests, started, time.monotonic()))

    def execute(self, requests: object, *predict_secs: float) -> bool:
        box = self.watch.begin(requests)
        try:
            for secs in predict_secs:  # one predict call per collation group
                self.watch.started = time.monotonic()
                time.sleep(secs)
        finally:
            self.watch.started = None
        return self.watch.finish(box)


def test_watchdog_answers_a_call_that_overruns_at_its_deadline_and_the_stub_answers_nothing():
    stub = Stub(0.3)
    try:
        assert stub.execute("fast", 0.01)
        assert not stub.execute("slow", 0.8)  # the watchdog claimed these requests
        [(requests, started, fired)] = stub.overruns
        assert requests == "slow" and 0.3 <= fired - started < 0.7
        assert not stub.watch._thread.is_alive()  # it answers one overrun: the process ends after it
    finally:
        stub.watch.stop()


def test_watchdog_limits_each_predict_call_not_the_batch_and_leaves_calls_within_it_alone():
    stub = Stub(0.6)
    try:
        # Busy for well over the limit in all: many short batches, and one batch of two groups each
        # within the limit, which a per-batch deadline would have cut.
        for _ in range(30):
            assert stub.execute("short", 0.03)
        assert stub.execute("two groups", 0.35, 0.35)
        time.sleep(0.5)  # idle, then a call noticed by the idle poll still gets its whole limit
        assert stub.execute("after idle", 0.3)
        assert stub.overruns == []
    finally:
        stub.watch.stop()


def test_watchdog_stops_when_asked():
    stub = Stub(0.2)
    stub.watch.stop()
    stub.watch._thread.join(2)
    assert not stub.watch._thread.is_alive()


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
                roots = (
                    {a.name.split(".")[0] for a in node.names}
                    if isinstance(node, ast.Import)
                    else {node.module.split(".")[0]}
                )
                assert roots <= allowed, f"{path} imports {roots - allowed} at module level"


def test_spec_file_round_trip(tmp_path):
    path = tmp_path / "snooze_runtime.json"
    path.write_text(json.dumps({**BASE, "request_timeout_secs": 0, "env": {"A": "1"}}))
    spec = load_spec(str(path))
    assert spec.request_timeout_secs is None and spec.env == {"A": "1"}


def test_watchdog_with_a_limit_beyond_what_sleep_accepts_still_runs():
    stub = Stub(1e300)
    try:
        assert stub.execute("any", 0.8)  # long enough to be seen by the idle poll
        assert stub.watch._thread.is_alive() and stub.overruns == []
    finally:
        stub.watch.stop()


class _Refusal(Exception):
    snooze_error = "invalid_input"


class _NegativeCounts(_Refusal, ValueError):
    pass


class _Other(ValueError):
    snooze_error = "something else"


def test_a_refusal_is_declared_by_the_exception_class_never_read_from_its_message():
    def kind_of(exc: BaseException, stage: str = "predict") -> tuple[str, str]:
        try:
            raise exc
        except Exception as e:
            return describe_failure(e, "m1", stage, 2)

    assert kind_of(_NegativeCounts("counts must be >= 0")) == (
        "invalid_input",
        "[snooze:invalid_input] model 'm1': predict refused the input: counts must be >= 0",
    )
    assert kind_of(_Refusal())[1].endswith("predict refused the input: _Refusal")
    for exc in (ValueError("invalid input: counts must be >= 0"), _Other("x")):  # words or another value: no
        assert kind_of(exc)[0] == "model_error"
    assert kind_of(_NegativeCounts("weights"), "load")[0] == "model_error"  # a load cannot refuse an input
