"""Building the model object an instance serves, and the watchdog that limits its predict calls.

Standard library + numpy at import time: onnxruntime is imported inside OnnxRunner.load, and the
user's module only when the instance initialises (after the spec's env is applied).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from .errors import PredictTimeout
from .import_probe import import_model_class
from .spec import RuntimeKind, RuntimeSpec, SpecError
from .strings import decode_text, encode_text

ONNX_STRING = "tensor(string)"  # an onnxruntime NodeArg's type for a string tensor


def device_for(instance_kind: str, device_id: str) -> str:
    """The `device` string handed to `load`: "cuda:N" for a GPU instance, else "cpu"."""
    return f"cuda:{int(device_id or 0)}" if instance_kind.upper() == "GPU" else "cpu"


def import_user_class(spec: RuntimeSpec, package_dir: str) -> type:
    """Import the class named by the spec from the package's entrypoint file.

    The entrypoint is imported under its own module name (snooze_model.py -> `snooze_model`) with
    package/ first on sys.path, so the package's sibling modules import the way they do on the
    author's machine.
    """
    entrypoint = spec.entrypoint
    if entrypoint is None:  # load_spec refuses a custom spec without one; a spec built in code may lack it
        raise SpecError(f"model '{spec.model_id}': no entrypoint; name the .py file in the package manifest")
    entry_file = os.path.join(package_dir, entrypoint)
    if not os.path.isfile(entry_file):
        raise SpecError(
            f"model '{spec.model_id}': entrypoint {entrypoint!r} is not in {package_dir}; "
            "fix 'entrypoint' in the package manifest or add the file"
        )
    cls, missing = import_model_class(package_dir, entrypoint, spec.class_name)
    if cls is None:
        raise SpecError(
            f"model '{spec.model_id}': {entrypoint} defines no class {spec.class_name!r}; "
            "fix 'class' in the package manifest or rename the class"
        )
    if missing:
        raise SpecError(
            f"model '{spec.model_id}': class {spec.class_name} in {entrypoint} has no {missing}; "
            "a model needs load(model_dir, device) and predict(inputs)"
        )
    return cls


class _Session(Protocol):
    """What OnnxRunner uses of an onnxruntime InferenceSession (onnxruntime publishes no types)."""

    def run(self, output_names: list[str], input_feed: dict[str, Any]) -> list[Any]: ...


class OnnxRunner:
    """The user-model contract around an onnxruntime session.

    Serves ONNX models on a Triton without the onnxruntime backend (the embedded one). Keyword
    arguments (the spec's params) set onnxruntime SessionOptions fields, e.g. intra_op_num_threads:
    onnxruntime otherwise starts one thread per core in every instance.

    String tensors (ONNX ``tensor(string)``) are read from the session at load: their inputs arrive as
    Triton's BYTES (object arrays of bytes) and are decoded as UTF-8 text, their outputs go back as bytes
    (strings.py says why). A model without them runs the session as it is, at no cost per request.
    """

    def __init__(self, onnx_file: str, output_names: list[str], **session_options: Any) -> None:
        self.onnx_file = onnx_file
        self.output_names = output_names
        self.session_options = session_options
        self.session: _Session | None = None
        self.text_inputs: tuple[str, ...] = ()
        self._text_outputs: tuple[int, ...] = ()  # positions in output_names
        # Per request, before the batch is collated (batching.BatchPlan): a request whose text is not UTF-8
        # fails alone. None when the model takes no text.
        self.prepare_inputs: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self.predict: Callable[[dict[str, Any]], dict[str, Any]] = self._run

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
        self.session = session = ort.InferenceSession(path, sess_options=options, providers=providers)
        self.text_inputs = tuple(i.name for i in session.get_inputs() if i.type == ONNX_STRING)
        text_outputs = {o.name for o in session.get_outputs() if o.type == ONNX_STRING}
        self._text_outputs = tuple(i for i, name in enumerate(self.output_names) if name in text_outputs)
        self.prepare_inputs = self._decode_inputs if self.text_inputs else None
        self.predict = self._run_text if self.text_inputs or self._text_outputs else self._run

    def _loaded(self) -> _Session:
        if self.session is None:
            raise RuntimeError(f"{self.onnx_file}: predict called while not loaded")
        return self.session

    def _run(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return dict(zip(self.output_names, self._loaded().run(self.output_names, inputs), strict=True))

    def _decode_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        decoded = dict(inputs)
        for name in self.text_inputs:
            if name in decoded:
                decoded[name] = decode_text(decoded[name], name)
        return decoded

    def _run_text(self, inputs: dict[str, Any]) -> dict[str, Any]:
        # Inputs the plan decoded already pass through decode_text unchanged.
        results = self._loaded().run(self.output_names, self._decode_inputs(inputs))
        for i in self._text_outputs:
            results[i] = encode_text(results[i], f"output '{self.output_names[i]}'")
        return dict(zip(self.output_names, results, strict=True))

    def unload(self) -> None:
        self.session = None


def build_model(spec: RuntimeSpec, package_dir: str) -> Any:
    """Instantiate the model this process runs itself: the user's `Model(**params)` or an OnnxRunner.

    Whatever the spec's `worker`: the stub chooses between this and a preforked worker
    (triton_model.py); a preforked worker, and a stub that cannot get one, run it with this."""
    if spec.kind == RuntimeKind.ONNX:
        if spec.onnx_file is None:  # load_spec refuses an onnx spec without one; a spec built in code may lack it
            raise SpecError(f"model '{spec.model_id}': no onnx_file; name the .onnx file in the runtime spec")
        return OnnxRunner(spec.onnx_file, [t.name for t in spec.outputs], **spec.params)
    return import_user_class(spec, package_dir)(**spec.params)


class _Call:
    """One call run on a thread of its own, and its outcome."""

    __slots__ = ("fn", "args", "done", "result", "error")

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # handed to the caller
            self.error = e
        self.done.set()


def call_with_limit(fn: Callable[..., Any], *args: Any, timeout: float, what: str, name: str) -> Any:
    """fn(*args) on a thread of its own; PredictTimeout after `timeout` seconds, the call left running.

    For unload at finalize: Triton waits for finalize without a limit, and Python cannot stop a thread,
    so a hanging call is left behind (a daemon thread: the stub process exits after finalize anyway).
    """
    call = _Call(fn, args)
    threading.Thread(target=call.run, name=name, daemon=True).start()
    if not call.done.wait(timeout):
        raise PredictTimeout(f"{what} did not finish within {timeout:g} s; make {what} faster")
    if call.error is not None:
        raise call.error  # its traceback still holds the user's frames
    return call.result


# How often an idle watchdog looks for a call in progress; a call is never timed out late because of
# it (the deadline counts from the call's own start), this only bounds how soon one is noticed.
WATCHDOG_IDLE_POLL_SECS = 0.5
WATCHDOG_MAX_SLEEP_SECS = 3600.0


class PredictWatchdog:
    """Enforces request_timeout_secs on predict calls that run on the stub's own thread.

    User code (import, load, predict) runs on the stub's thread, the one Triton calls initialize and
    execute on, so thread-local state set up in load (torch grad mode, CUDA device and streams) holds
    in predict, and a batch costs no hand-off to another thread.

    The request path pays two attribute stores and a clock read per batch, nothing else: the watchdog is
    a thread of its own that sleeps until the deadline of the call in progress, and the stub's thread
    never waits on it. Its protocol with the stub's thread:

    - `begin(requests)` before a batch: publishes a claim box holding the requests;
    - `started = time.monotonic()` before each predict call, `started = None` after the batch;
    - `finish(box)` after the batch: True if the stub's thread claimed the requests (answer them),
      False if the watchdog did (it has answered them already).

    Whoever pops the box first answers its requests: list.pop is atomic, so the two threads never
    both answer one request. When a call overruns, `on_overrun(requests, started)` runs on this
    thread: Python cannot stop the call, so it answers the requests with the timeout and then ends
    the process (the call would hold the instance, and whatever memory it holds, for as long as it
    runs); Triton's request queue then goes to a fresh process once the model is recovered.
    """

    def __init__(self, timeout: float, on_overrun: Callable[[Any, float], None], name: str) -> None:
        self.timeout = timeout
        self.box: list[Any] = []
        self.started: float | None = None
        self._on_overrun = on_overrun
        self._stopped = False
        self._idle_poll = min(timeout / 2, WATCHDOG_IDLE_POLL_SECS)
        # Daemon: the stub process exits after finalize whatever this thread does.
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def begin(self, requests: Any) -> list[Any]:
        box = self.box = [requests]
        return box

    @staticmethod
    def finish(box: list[Any]) -> bool:
        try:
            box.pop()
        except IndexError:
            return False
        return True

    def _loop(self) -> None:
        monotonic, sleep = time.monotonic, time.sleep
        while not self._stopped:
            box = self.box  # read before started: a start never belongs to an older box than this one
            started = self.started
            if started is None:
                sleep(self._idle_poll)
                continue
            wait = started + self.timeout - monotonic()
            if wait > 0:
                sleep(min(wait, WATCHDOG_MAX_SLEEP_SECS))  # time.sleep refuses what no limit needs
                continue
            try:
                requests = box.pop()
            except IndexError:  # the batch ended as the deadline came: nothing to answer
                continue
            self._on_overrun(requests, started)
            return

    def stop(self) -> None:
        self._stopped = True
