"""`TritonPythonModel`: the adapter between Triton's python-backend stub and a snoozeml model.

A rendered model's `model.py` re-exports this class (model_repository_templates/python_model.py.j2).
`triton_python_backend_utils` exists only inside the stub, so it is imported in `initialize`; all
batching policy lives in batching.py, testable without Triton.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .batching import BatchPlan
from .errors import INVALID_INPUT, Failure, describe_failure
from .journal import RequestJournal
from .runners import build_model, device_for, runner_for
from .spec import RuntimeSpec, load_spec, spec_path

PACKAGE_DIR = "package"
# finalize waits this long for the model's unload(): Triton waits for finalize without a limit, so
# a hanging unload() would block the model's unload forever; the stub process exits after finalize
# and frees the model's memory anyway.
UNLOAD_TIMEOUT_SECS = 30.0


def _log(model_id: str, message: str) -> None:
    print(f"snooze model '{model_id}': {message}", file=sys.stderr, flush=True)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        import triton_python_backend_utils as pb_utils  # provided by the stub process

        self._pb = pb_utils
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        try:
            self._spec: RuntimeSpec = load_spec(spec_path(args["model_repository"], args["model_version"]))
        except Exception as e:
            message = describe_failure(e, args.get("model_name", "?"), "initialize", None)[1]
            raise RuntimeError(message) from None
        spec = self._spec
        # Before any user import: libraries read their settings (OMP_NUM_THREADS, ...) at import time.
        os.environ.update(spec.env)
        # User code prints freely; stdout of the stub is not the model's to use, and stderr reaches
        # Triton's log. Process-wide because user code runs on its own thread (runners.UserThread).
        sys.stdout = sys.stderr

        package_dir = os.path.join(version_dir, PACKAGE_DIR)
        device = device_for(args.get("model_instance_kind", "CPU"), args.get("model_instance_device_id", "0"))
        self._worker = runner_for(spec, f"snooze-{args.get('model_instance_name', spec.model_id)}")
        stage = "import"
        try:
            self._model = self._worker.call(build_model, spec, package_dir, what="import")
            stage = "load"
            self._worker.call(self._model.load, package_dir, device, what="load")
        except Exception as e:
            self._worker.stop()
            # The kind prefix tells the control plane an out-of-memory load apart from a broken model.
            raise RuntimeError(describe_failure(e, spec.model_id, stage, None)[1]) from None
        _log(spec.model_id, f"loaded ({spec.kind}, {spec.tensor_format} tensors) on {device}")
        # A preforked model's worker is a process of its own: its batches need no user thread here.
        self._direct = getattr(self._model, "direct_predict", None)
        self._journal = RequestJournal.from_environment()
        # Decided once here, not per request: the compiled signature and the bound calls of the request path.
        self._plan = BatchPlan(spec)
        self._user_predict = self._model.predict
        self._call = self._worker.call
        self._timeout = spec.request_timeout_secs
        self._response_cls = pb_utils.InferenceResponse
        self._tensor_cls = pb_utils.Tensor

    def execute(self, requests: list) -> list:
        if self._journal is not None:
            self._journal.record(requests)
        arrays = [{t.name(): t.as_numpy() for t in request.inputs()} for request in requests]
        return [self._response(result) for result in self._plan.run(arrays, self._predict)]

    def finalize(self) -> None:
        unload = getattr(self._model, "unload", None)
        if self._worker.busy:
            _log(self._spec.model_id, "skipping unload(): a predict call that overran its timeout still runs")
        elif callable(unload):
            try:
                self._worker.call(unload, timeout=UNLOAD_TIMEOUT_SECS, what="unload")
            except Exception as e:  # the instance goes away regardless; say why it did not unload cleanly
                _log(self._spec.model_id, describe_failure(e, self._spec.model_id, "unload", None)[1])
        self._worker.stop()
        if self._journal is not None:
            self._journal.close()

    def _predict(self, inputs: Any) -> Any:
        if self._direct is not None:
            return self._direct(inputs, self._timeout)
        return self._call(self._user_predict, inputs, timeout=self._timeout)

    def _response(self, result: Any) -> Any:
        if type(result) is Failure:
            return self._response_cls(error=self._error(result))
        try:
            tensor = self._tensor_cls
            return self._response_cls(output_tensors=[tensor(name, array) for name, array in result.items()])
        except Exception as e:  # a value pb_utils cannot serialise fails this request, not the batch
            return self._response_cls(
                error=self._error(Failure(*describe_failure(e, self._spec.model_id, "predict output", None)))
            )

    def _error(self, failure: Failure) -> Any:
        """TritonError with a code when this pb_utils supports one (older stubs take a message only).

        invalid_input -> INVALID_ARG (HTTP 400); everything else -> INTERNAL (HTTP 500). Not UNAVAILABLE
        for oom/timeout: the gateway retries gRPC UNAVAILABLE to the activator, which would run the
        inference a second time.
        """
        error_cls = self._pb.TritonError
        code = getattr(error_cls, "INVALID_ARG" if failure.kind == INVALID_INPUT else "INTERNAL", None)
        if code is None:
            return error_cls(failure.message)
        try:
            return error_cls(failure.message, code)
        except TypeError:
            return error_cls(failure.message)
