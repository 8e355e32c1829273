"""`TritonPythonModel`: the adapter between Triton's python-backend stub and a snoozeml model.

A rendered model's `model.py` re-exports this class (model_repository_templates/python_model.py.j2).
`triton_python_backend_utils` exists only inside the stub, so it is imported in `initialize`; all
batching policy lives in batching.py, testable without Triton.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .batching import BatchPlan
from .doze import DozeControl
from .errors import INVALID_INPUT, Failure, PredictTimeout, describe_failure, prefix
from .exits import OVERRUN_EXIT_CODE
from .journal import RequestJournal, note_phase
from .runners import PredictWatchdog, build_model, call_with_limit, device_for
from .sequences import SEQUENCE_END, SEQUENCE_START, SequenceNote
from .spec import RuntimeKind, RuntimeSpec, load_spec, spec_path
from .warmup import (
    LEARNED,
    SAMPLES,
    WarmupNote,
    declared_outputs,
    learned_arrays,
    read_learned,
    sample_source,
    shapes_of,
    warmup_samples,
)

PACKAGE_DIR = "package"
# Set by the control plane on a config that carries a client's override (controlplane/lifecycle/overrides.py).
OVERRIDE_PARAMETER = "snooze_config_override"
# finalize waits this long for the model's unload(): Triton waits for finalize without a limit, so
# a hanging unload() would block the model's unload forever; the stub process exits after finalize
# and frees the model's memory anyway.
UNLOAD_TIMEOUT_SECS = 30.0


@dataclasses.dataclass(frozen=True)
class Sequence:
    """What a stateful model's ``predict(inputs, sequence)`` learns about its request."""

    correlation_id: int | str
    start: bool
    end: bool


def takes_sequence(predict: Any) -> bool:
    """A ``predict`` with a second positional parameter gets the request's ``Sequence`` (duck-typed:
    a one-argument ``predict`` keeps working on a stateful model)."""
    try:
        params = list(inspect.signature(predict).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _sequence_of(request: Any) -> Sequence:
    flags = request.flags()
    return Sequence(request.correlation_id(), bool(flags & SEQUENCE_START), bool(flags & SEQUENCE_END))


def declares_unload(model: Any) -> bool:
    """Whether the user's model has an ``unload()`` (a preforked model answers for its worker's)."""
    declared = getattr(model, "declares_unload", None)
    if isinstance(declared, bool):
        return declared
    return callable(getattr(model, "unload", None))


def _log(model_id: str, message: str) -> None:
    print(f"snooze model '{model_id}': {message}", file=sys.stderr, flush=True)


def _serving_model(spec: RuntimeSpec, package_dir: str) -> Any:
    """What this instance serves: the model itself, or for `worker: "preforked"` its stand-in
    (preforked.py: the model runs in a worker process forked from a preloaded parent)."""
    if spec.worker == "preforked":
        from .preforked import PreforkedModel  # only preforked models load that machinery

        return PreforkedModel(spec, package_dir)
    return build_model(spec, package_dir)


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
        # A client's config override (a repository load through the gateway, which marks it) may change
        # max_batch_size: Triton's config is then what it batches by, so the runtime's limit follows it.
        config = json.loads(args.get("model_config") or "{}")
        config_batch = int(config.get("max_batch_size") or 0)
        if spec.batched and config_batch > 0 and OVERRIDE_PARAMETER in (config.get("parameters") or {}):
            self._spec = spec = dataclasses.replace(spec, max_batch_size=config_batch)
        # Before any user import: libraries read their settings (OMP_NUM_THREADS, ...) at import time.
        os.environ.update(spec.env)
        # User code prints freely; stdout of the stub is not the model's to use, and stderr reaches
        # Triton's log. Process-wide: unload at finalize runs on a thread of its own.
        sys.stdout = sys.stderr

        package_dir = os.path.join(version_dir, PACKAGE_DIR)
        device = device_for(args.get("model_instance_kind", "CPU"), args.get("model_instance_device_id", "0"))
        self._instance = args.get("model_instance_name", spec.model_id)
        stage = "import"
        try:
            note_phase("import")
            self._model = _serving_model(spec, package_dir)
            stage = "load"
            note_phase("load")
            self._model.load(package_dir, device)
        except Exception as e:
            # The kind prefix tells the control plane an out-of-memory load apart from a broken model.
            raise RuntimeError(describe_failure(e, spec.model_id, stage, None)[1]) from None
        _log(spec.model_id, f"loaded ({spec.kind}, {spec.tensor_format} tensors) on {device}")
        # A preforked model's worker is a process of its own: the stub's thread talks to it directly.
        self._direct = getattr(self._model, "direct_stream" if spec.decoupled else "direct_predict", None)
        self._journal = RequestJournal.from_environment()
        if self._journal is not None:
            self._journal.declare(unload=declares_unload(self._model))
        # A stateful model notes until when one of its sequences may be live (the control plane keeps it in use).
        self._sequences = SequenceNote.from_environment(spec.model_id, json.loads(args.get("model_config") or "{}"))
        # Decided once here, not per request: the compiled signature and the bound calls of the request path.
        # An ONNX model's per-request conversion (its text inputs decoded) runs in the plan, before collation.
        prepare = getattr(self._model, "prepare_inputs", None) if spec.kind == RuntimeKind.ONNX else None
        self._plan = BatchPlan(spec, prepare)
        # Rank-0 tensors: [1] on the wire (config dims [1], reshape []), [] for the model (see _scalar_inputs).
        self._scalars = tuple(t.name for t in spec.inputs if t.dims == ())
        self._scalar_outputs = tuple(t.name for t in spec.outputs if t.dims == ())
        self._timeout = spec.request_timeout_secs
        self._response_cls = pb_utils.InferenceResponse
        self._tensor_cls = pb_utils.Tensor
        # predict runs on this thread (a preforked model's: in its worker, this thread waiting for the
        # answer); with a time limit, a watchdog beside it answers a call that overruns it.
        self._user_predict = self._direct or self._model.predict
        self._predict = self._user_predict
        # A stateful model whose predict takes the request's Sequence: one call per request.
        self._per_sequence = spec.sequence and not spec.decoupled and takes_sequence(self._user_predict)
        self._warm_answer: tuple[dict[str, Any], Any] | None = None
        # Notes the warm-up's outcome and the first real request's shapes for the control plane (learned warm-ups).
        self._note = WarmupNote.from_environment(spec.model_id) if not spec.decoupled and not spec.sequence else None
        self._learn = self._note is not None
        if not spec.decoupled and not spec.sequence:  # the renderer gives those no warm-up sample
            note_phase("warm-up")
            self._warm_up(args, spec)
        note_phase("ready")
        # A preforked model may doze (doze.py): its worker ends while this stub stays; its next batch wakes it.
        self._doze = DozeControl.for_model(self._model, spec.model_id, self._journal)
        self._watch: PredictWatchdog | None = None
        if self._timeout:
            self._watch = PredictWatchdog(self._timeout, self._overran, f"snooze-watchdog-{self._instance}")
            self._predict = self._watched(self._watch, self._user_predict)

    def execute(self, requests: list) -> list | None:
        doze = self._doze
        if doze is None:
            return self._execute_journaled(requests)
        with doze.lock:  # a doze never runs beside a batch; a dozing instance wakes first
            failure = doze.wake_for_batch()  # a failed wake reached no worker: the batch is answered with it
            return self._execute_journaled(requests) if failure is None else self._refuse(requests, failure)

    def _refuse(self, requests: list, failure: Failure) -> list | None:
        """Every request of the batch answered with ``failure`` (a decoupled model's through its sender)."""
        if not self._spec.decoupled:
            return [self._response(failure)] * len(requests)
        final = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            with contextlib.suppress(Exception):  # a client that left is not answered
                request.get_response_sender().send(self._response_cls(error=self._error(failure)), flags=final)
        return None

    def _execute_journaled(self, requests: list) -> list | None:
        journal = self._journal
        if self._sequences is not None:
            self._sequences.record(requests)
        if self._learn and self._warm_answer is None:  # the first real batch (Triton's warm-up is answered first)
            self._learn_shapes(requests)
        if journal is None:
            return self._execute(requests)
        journal.record(requests)
        try:
            return self._execute(requests)
        finally:
            journal.batch_done()

    def _execute(self, requests: list) -> list | None:
        if self._spec.decoupled:
            for request in requests:
                self._stream(request)
            return None
        warm = self._warm_answer
        if warm is not None:  # the instance's first batch: Triton's warm-up, already run in _warm_up
            answer = self._warmed(requests, warm)
            if answer is not None:
                return answer
        watch = self._watch
        if watch is None:
            return [self._response(result) for result in self._run(requests)]
        box = watch.begin(requests)
        try:
            results = self._run(requests)
        finally:
            watch.started = None
        if not watch.finish(box):
            return [None] * len(requests)  # the watchdog answered them: predict overran its limit
        return [self._response(result) for result in results]

    def _warmed(self, requests: list, warm: tuple[dict[str, Any], Any]) -> list | None:
        """Triton's run of the warm-up sample this instance ran already: its answer, without a second predict."""
        sample, result = warm
        self._warm_answer = None
        if len(requests) != 1:
            return None
        arrays = {t.name(): t.as_numpy() for t in requests[0].inputs()}
        if arrays.keys() != sample.keys() or not all(_same(arrays[k], v) for k, v in sample.items()):
            return None
        return [self._response(result)]

    def _learn_shapes(self, requests: list) -> None:
        """Once per load: the first real request's input shapes and datatypes (never data) to the note."""
        self._learn = False
        try:
            arrays = {t.name(): t.as_numpy() for t in requests[0].inputs()}
            self._note.write(learned=shapes_of(self._spec, arrays))  # type: ignore[union-attr]
        except Exception as e:  # a note is an optimisation: the request goes on
            _log(self._spec.model_id, f"could not note the request's shapes for later warm-ups: {e}")

    def _warm_up(self, args: dict[str, str], spec: RuntimeSpec) -> None:
        """The config's warm-up samples through predict, before Triton runs them (see warmup.py for why Triton
        must never run a failing one). A shipped sample that fails fails the load with the model's own error;
        generated or learned inputs that fail are said once and the model loads."""
        try:
            samples = warmup_samples(json.loads(args.get("model_config") or "{}"), args["model_repository"])
        except (OSError, ValueError, KeyError) as e:  # an unreadable sample: Triton's own run reports it
            _log(spec.model_id, f"could not read the warm-up sample ({e}); Triton runs it")
            return
        learned = read_learned(args["model_repository"])
        for name, arrays in samples:
            source = sample_source(name)
            run = arrays
            if source != SAMPLES and learned is not None:
                run = learned_arrays(spec, learned) or arrays
                source = LEARNED if run is not arrays else source
            if self._scalars:
                run = self._scalar_inputs(run)
            try:
                [result] = self._plan.run([run], self._user_predict)
            except BaseException as e:  # as _run: SystemExit and the like are the model's failure too
                result = Failure(*describe_failure(e, spec.model_id, "predict", None))
            if type(result) is Failure and source != SAMPLES:
                ordered = {t.name: run[t.name] for t in spec.inputs if t.name in run}
                skipped = (
                    f"skipped ({source} input {_shapes_text(ordered)} failed: {result.message}; "
                    'ship samples or set "warmup": false)'
                )
                _log(spec.model_id, f"warm-up {skipped}")
                if self._note is not None:
                    self._note.write(source=source, skipped=skipped)
                self._warm_answer = (arrays, declared_outputs(spec))  # Triton's run gets outputs, never the failure
                continue
            if self._note is not None:
                self._note.write(source=source)
            # Triton's run of the config's sample comes next: answered from here (a copy: a preforked worker's
            # answer is a view of a region its next answer reuses).
            kept: dict[str, Any] | Failure
            if type(result) is Failure:
                kept = result
            elif run is arrays:
                kept = {k: np.array(v, copy=True) for k, v in result.items()}
            else:
                kept = declared_outputs(spec)
            self._warm_answer = (arrays, kept)
            if type(result) is Failure:
                with contextlib.suppress(Exception):
                    unload = getattr(self._model, "unload", None)
                    if callable(unload):
                        unload()
                raise RuntimeError(
                    f"{result.message} (in the load's warm-up inference '{name}': inputs from the signature or "
                    "the package's 'warmup' samples; \"warmup\": false in snooze_model.json turns it off)"
                )

    def _run(self, requests: list) -> list:
        if self._per_sequence:
            return [self._run_in_sequence(request) for request in requests]
        return self._run_batch(requests)

    def _run_in_sequence(self, request: Any) -> Any:
        """A stateful model's request: its own ``predict(inputs, sequence)`` call (requests of different
        sequences in one batch are not collated: each has its own state)."""
        try:
            sequence = _sequence_of(request)
            if not sequence.correlation_id:  # the direct strategy's filler for an idle batch slot: no sequence
                return Failure(INVALID_INPUT, f"{prefix(INVALID_INPUT, self._spec.model_id)} a null request, not run")
            return self._run_batch([request], lambda inputs: self._predict(inputs, sequence))[0]
        except BaseException as e:
            return Failure(*describe_failure(e, self._spec.model_id, "predict", None))

    def _run_batch(self, requests: list, predict: Any = None) -> list:
        """One result or framed Failure per request: nothing escapes for Triton to word instead.

        The plan turns what user code raises into per-request failures; this catches the rest (a
        BaseException such as SystemExit from predict, a fault of the runtime itself), so that every
        error a client gets starts with the kind prefix and never reads as one of Triton's own answers
        (the gateway retries Triton's dead-stub answer, controlplane/triton/dead_stub.py).
        """
        try:
            arrays = [{t.name(): t.as_numpy() for t in request.inputs()} for request in requests]
            if self._scalars:
                arrays = [self._scalar_inputs(a) for a in arrays]
            return self._plan.run(arrays, predict or self._predict)
        except BaseException as e:
            return [Failure(*describe_failure(e, self._spec.model_id, "predict", None))] * len(requests)

    def _stream(self, request: Any) -> None:
        """A decoupled model's request: one response per result predict yields, in order, then the final
        flag; a failure is the last response (those before it stay sent). A cancelled request (the client
        went away) stops predict's generator before it computes the next result.

        ``request_timeout_secs`` does not apply to a stream (its length is the model's to choose).
        """
        final = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        sender = request.get_response_sender()
        results = None
        try:
            arrays = {t.name(): t.as_numpy() for t in request.inputs()}
            if self._scalars:
                arrays = self._scalar_inputs(arrays)
            results = self._plan.stream(arrays, self._user_predict)
            for result in results:
                response = self._response(result)
                if response.has_error():
                    sender.send(response, flags=final)
                    return
                sender.send(response)
                if request.is_cancelled():
                    break
        except BaseException as e:  # a fault of the runtime, or SystemExit from predict: the model's error
            failure = Failure(*describe_failure(e, self._spec.model_id, "predict", None))
            try:
                sender.send(self._response_cls(error=self._error(failure)), flags=final)
            except Exception as gone:  # the request may be over already (a send to a client that left)
                _log(self._spec.model_id, f"could not end a stream with its error: {gone}")
            return
        finally:
            if results is not None:
                results.close()
        sender.send(flags=final)

    def finalize(self) -> None:
        if self._doze is not None:
            self._doze.close()
        unload = getattr(self._model, "unload", None)
        if self._watch is not None:
            self._watch.stop()
        if callable(unload):
            try:
                call_with_limit(
                    unload, timeout=UNLOAD_TIMEOUT_SECS, what="unload", name=f"snooze-unload-{self._instance}"
                )
            except Exception as e:  # the instance goes away regardless; say why it did not unload cleanly
                _log(self._spec.model_id, describe_failure(e, self._spec.model_id, "unload", None)[1])
        if self._journal is not None:
            self._journal.close()
        if self._sequences is not None:
            self._sequences.close()
        if self._note is not None:
            self._note.close()

    @staticmethod
    def _watched(watch: PredictWatchdog, predict: Callable[..., Any]) -> Callable[..., Any]:
        """``predict``, each call's start told to ``watch`` (the one thing the request path adds for it)."""

        def predict_watched(inputs: Any, *sequence: Any) -> Any:
            watch.started = time.monotonic()
            return predict(inputs, *sequence)

        return predict_watched

    def _overran(self, requests: list, started: float) -> None:
        """On the watchdog's thread: answer the overrunning batch with the timeout, then end the process.

        Python cannot stop the call, and while it runs the instance takes no other batch (Triton holds
        them in its queue), so the instance is given a fresh process: the control plane sees this one
        end (exit code OVERRUN_EXIT_CODE) and recovers the model as after a crash, and the queued
        requests are served by the new process. Answered through each request's response sender
        (allowed for non-decoupled models since Triton 23.10): the stub's thread is inside the call.
        """
        spec = self._spec
        failure = Failure(
            *describe_failure(
                PredictTimeout(
                    f"predict did not finish within request_timeout_secs={self._timeout:g} s; make predict "
                    "faster, send smaller batches or raise request_timeout_secs. Python cannot stop the call, "
                    "so this instance's process ends and the model is restarted"
                ),
                spec.model_id,
                "predict",
                None,
            )
        )
        final = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            try:
                request.get_response_sender().send(self._response_cls(error=self._error(failure)), flags=final)
            except Exception as e:  # the client may be gone; the others still get their answer
                _log(spec.model_id, f"could not send the timeout answer: {e}")
        _log(
            spec.model_id,
            f"predict overran request_timeout_secs={self._timeout:g} s (running for "
            f"{time.monotonic() - started:.1f} s); ending this instance's process (exit code "
            f"{OVERRUN_EXIT_CODE}) so that the model restarts",
        )
        os._exit(OVERRUN_EXIT_CODE)

    def _scalar_inputs(self, arrays: dict[str, Any]) -> dict[str, Any]:
        """A rank-0 input as the model declares it: ``[]`` (``[batch]`` when batching) from the wire's ``[1]``
        (``[batch, 1]``); Triton's reshape may have done it already."""
        out = dict(arrays)
        for name in self._scalars:
            array = out.get(name)
            if array is None:
                continue
            if self._spec.batched:
                if array.ndim == 2 and array.shape[1] == 1:
                    out[name] = array.reshape(array.shape[0])
            elif array.shape == (1,):
                out[name] = array.reshape(())
        return out

    def _scalar_outputs_wire(self, result: dict[str, Any]) -> dict[str, Any]:
        """A rank-0 output back to the wire's shape: ``[1]`` (``[batch, 1]``), what its config's dims say."""
        out = dict(result)
        for name in self._scalar_outputs:
            array = out.get(name)
            if array is not None and array.ndim == (1 if self._spec.batched else 0):
                out[name] = array.reshape(array.shape + (1,))
        return out

    def _response(self, result: Any) -> Any:
        if type(result) is Failure:
            return self._response_cls(error=self._error(result))
        if self._scalar_outputs:
            result = self._scalar_outputs_wire(result)
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


def _shapes_text(arrays: dict[str, Any]) -> str:
    """A warm-up's inputs for a message: ``[1,3,1,1]`` for one input, ``x [1,2], text [1,1]`` for several."""
    shapes = {k: "[" + ",".join(str(d) for d in v.shape) + "]" for k, v in arrays.items()}
    return next(iter(shapes.values())) if len(shapes) == 1 else ", ".join(f"{k} {v}" for k, v in shapes.items())


def _same(a: Any, b: Any) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool((a == b).all())
