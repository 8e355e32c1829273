"""Building the model object an instance serves, and the thread its code runs on.

Standard library + numpy at import time: onnxruntime is imported inside OnnxRunner.load, and the
user's module only when the instance initialises (after the spec's env is applied).
"""

from __future__ import annotations

import importlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import PredictTimeout
from .spec import RuntimeSpec, SpecError


def device_for(instance_kind: str, device_id: str) -> str:
    """The `device` string handed to `load`: "cuda:N" for a GPU instance, else "cpu"."""
    return f"cuda:{int(device_id or 0)}" if instance_kind.upper() == "GPU" else "cpu"


def import_user_class(spec: RuntimeSpec, package_dir: str) -> type:
    """Import the class named by the spec from the package's entrypoint file.

    The entrypoint is imported under its own module name (snooze_model.py -> `snooze_model`) with
    package/ first on sys.path, so the package's sibling modules import the way they do on the
    author's machine.
    """
    entry_file = os.path.join(package_dir, spec.entrypoint)
    if not os.path.isfile(entry_file):
        raise SpecError(
            f"model '{spec.model_id}': entrypoint {spec.entrypoint!r} is not in {package_dir}; "
            "fix 'entrypoint' in the package manifest or add the file"
        )
    if package_dir not in sys.path:
        sys.path.insert(0, package_dir)
    module_name = os.path.normpath(spec.entrypoint)[: -len(".py")].replace(os.sep, ".")
    module = importlib.import_module(module_name)
    cls = getattr(module, spec.class_name, None)
    if not isinstance(cls, type):
        raise SpecError(
            f"model '{spec.model_id}': {spec.entrypoint} defines no class {spec.class_name!r}; "
            "fix 'class' in the package manifest or rename the class"
        )
    missing = [m for m in ("load", "predict") if not callable(getattr(cls, m, None))]
    if missing:
        raise SpecError(
            f"model '{spec.model_id}': class {spec.class_name} in {spec.entrypoint} has no {missing}; "
            "a model needs load(model_dir, device) and predict(inputs)"
        )
    return cls


class OnnxRunner:
    """The user-model contract around an onnxruntime session.

    Serves ONNX models on a Triton without the onnxruntime backend (the embedded one). Keyword
    arguments (the spec's params) set onnxruntime SessionOptions fields, e.g. intra_op_num_threads:
    onnxruntime otherwise starts one thread per core in every instance.
    """

    def __init__(self, onnx_file: str, output_names: list[str], **session_options: Any) -> None:
        self.onnx_file = onnx_file
        self.output_names = output_names
        self.session_options = session_options
        self.session = None

    def load(self, model_dir: str, device: str) -> None:
        import onnxruntime as ort  # lazily: custom models must not pay for it

        options = ort.SessionOptions()
        for key, value in self.session_options.items():
            if not hasattr(options, key):
                raise SpecError(
                    f"params key {key!r} is not an onnxruntime SessionOptions field; "
                    "ONNX models take SessionOptions fields as params (e.g. intra_op_num_threads)"
                )
            setattr(options, key, value)
        providers: list[Any] = ["CPUExecutionProvider"]
        if device.startswith("cuda:"):
            if "CUDAExecutionProvider" in ort.get_available_providers():
                providers.insert(0, ("CUDAExecutionProvider", {"device_id": int(device.split(":", 1)[1])}))
            else:
                print(
                    f"snooze: {self.onnx_file}: GPU instance but onnxruntime has no CUDAExecutionProvider "
                    "(install onnxruntime-gpu); running on CPU",
                    file=sys.stderr,
                )
        path = os.path.join(model_dir, self.onnx_file)
        self.session = ort.InferenceSession(path, sess_options=options, providers=providers)

    def predict(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return dict(zip(self.output_names, self.session.run(self.output_names, inputs), strict=True))

    def unload(self) -> None:
        self.session = None


def build_model(spec: RuntimeSpec, package_dir: str) -> Any:
    """Instantiate what the instance serves: the user's `Model(**params)` or an OnnxRunner; for a
    preforked model, its stand-in (preforked.py: the model itself runs in a worker process)."""
    if spec.worker == "preforked":
        from .preforked import PreforkedModel  # only preforked models load that machinery

        return PreforkedModel(spec, package_dir)
    if spec.kind == "onnx":
        return OnnxRunner(spec.onnx_file, [t.name for t in spec.outputs], **spec.params)
    return import_user_class(spec, package_dir)(**spec.params)


_STOP = object()


class _Call:
    """One call handed to the user thread, and its outcome."""

    __slots__ = ("fn", "args", "what", "done", "finished", "result", "error", "started")

    def __init__(self, fn: Callable[..., Any], args: tuple, what: str) -> None:
        self.fn, self.args, self.what = fn, args, what
        # A bare lock, held until the call ends: the cheapest wake-up there is (an Event is a Condition
        # plus a new lock per wait), and the hand-off is most of the runtime's cost per request.
        self.done = threading.Lock()
        self.done.acquire()
        self.finished = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.started = 0.0


class UserThread:
    """One long-lived thread that runs all of an instance's user code (load, predict, unload).

    Off the stub's thread because Python cannot kill a thread: when predict overruns
    request_timeout_secs the stub's thread answers Triton with a timeout while this one carries on.
    One thread for every call, not one per call, because models keep thread-local state set up in
    load (torch grad mode, CUDA device and streams) and are not written to run concurrently with
    themselves. So after a timeout the instance stays busy: later calls fail fast with
    [snooze:timeout] until the overrunning call returns. Triton 2.51 offers no way for a model to
    report itself unhealthy; the control plane sees the timeout errors and reloads the model.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._overrun: _Call | None = None  # a call that outlived its timeout and still runs
        # Daemon: an overrunning call must not keep the stub process alive at unload.
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        jobs = self._jobs
        while True:
            call = jobs.get()
            if call is _STOP:
                return
            call.started = time.monotonic()
            try:
                call.result = call.fn(*call.args)
            except BaseException as e:  # handed to the caller, who maps it to an error response
                call.error = e
            call.finished = True
            call.done.release()

    @property
    def busy(self) -> bool:
        """True while a call that overran its timeout is still running."""
        if self._overrun is not None and self._overrun.finished:
            self._overrun = None
        return self._overrun is not None

    def call(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, what: str = "predict"
    ) -> Any:
        """Run fn(*args) on the user thread; raise PredictTimeout after `timeout` seconds (None: wait)."""
        if self.busy:
            stuck = self._overrun
            raise PredictTimeout(
                f"this instance is still running a {stuck.what} call that overran its timeout "
                f"(started {time.monotonic() - stuck.started:.0f} s ago); requests fail until it returns. "
                "Reload the model to recover now, or raise request_timeout_secs"
            )
        call = _Call(fn, args, what)
        self._jobs.put(call)
        if timeout is None or timeout > threading.TIMEOUT_MAX:
            call.done.acquire()
        elif not call.done.acquire(True, max(timeout, 0.0)):
            self._overrun = call
            raise PredictTimeout(
                f"{what} did not finish within request_timeout_secs={timeout:g} s; make {what} faster, "
                "send smaller batches or raise request_timeout_secs. The instance stays busy until the "
                "call returns (Python cannot stop it); reload the model to free it"
            )
        if call.error is not None:
            raise call.error  # its traceback still holds the user's frames
        return call.result

    def stop(self) -> None:
        """Let the thread end after its current call; never waits for an overrunning call."""
        self._jobs.put(_STOP)


class CallingThread:
    """The runner of a model without request_timeout_secs (null or 0): user code runs on the thread that
    calls it, the stub's, which also runs initialize, so import, load and predict still share one thread.

    With no limit there is nothing to answer early, so the stub's thread may as well wait inside predict
    and save the hand-off to a UserThread, most of the runtime's cost per request. A call that does have
    a limit (unload at finalize) gets a thread of its own, which can be left behind if it hangs.
    """

    busy = False  # no call is ever left running past a limit on this thread

    def __init__(self, name: str) -> None:
        self.name = name

    def call(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, what: str = "predict"
    ) -> Any:
        if timeout is None:
            return fn(*args)
        helper = UserThread(f"{self.name}-{what}")
        try:
            return helper.call(fn, *args, timeout=timeout, what=what)
        finally:
            helper.stop()

    def stop(self) -> None:
        """Nothing to stop: no thread of its own."""


def runner_for(spec: RuntimeSpec, name: str) -> UserThread | CallingThread:
    """A UserThread when predict has a time limit to enforce, else the stub's own thread."""
    return UserThread(name) if spec.request_timeout_secs else CallingThread(name)
