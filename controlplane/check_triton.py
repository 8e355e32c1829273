"""`snoozectl check` of a Triton model folder: rendered as publish renders it, loaded into a real tritonserver (the
embedded one), one request sent, its outputs shown.

A snoozeml package is checked without Triton (its runtime loads it in a child process, controlplane/check.py);
a Triton model runs against Triton's own python backend (``pb_utils``), so only a Triton can run it. An ensemble is
checked with its steps, taken from the folders beside it (a Triton repository's layout).
"""

from __future__ import annotations

import queue
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from controlplane.errors import InvalidPackageError
from controlplane.render import embedded_target, render_model
from controlplane.spec import DeploymentSpec, ModelSpec, resolve
from controlplane.store.transactions import write_model

# The streamed responses of a decoupled model a check waits for at most.
MAX_STREAM_RESPONSES = 1000


def _with_steps(spec: ModelSpec, path: Path) -> list[ModelSpec]:
    """The folder's spec, and for an ensemble its steps' (folders beside it, named as the steps), nested ones too."""
    found, todo = {spec.id: spec}, [spec]
    while todo:
        current = todo.pop()
        triton = current.package.triton
        for step, _version in triton.ensemble_steps if triton is not None else ():
            if step in found:
                continue
            folder = path.parent / step
            if not folder.is_dir():
                raise InvalidPackageError(
                    f"model '{current.id}': its ensemble step '{step}' has no folder beside it ({folder})",
                    hint="check the ensemble from its Triton repository, with every step's folder beside it",
                )
            found[step] = resolve(DeploymentSpec(id=step, path=folder))
            todo.append(found[step])
    return list(found.values())


def _stream(url: str, model_id: str, inputs: list[Any], timeout: float) -> list[Any]:
    """A decoupled model's answer: every response of one streamed request, up to its final flag."""
    import tritonclient.grpc as grpcclient

    from controlplane.check import CheckFailed

    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer(model_id, inputs, enable_empty_final_response=True)
        results: list[Any] = []
        while len(results) < MAX_STREAM_RESPONSES:
            try:
                result, error = answers.get(timeout=timeout)
            except queue.Empty:
                raise CheckFailed(f"model '{model_id}': no final response within {timeout:g} s") from None
            if error is not None:
                raise CheckFailed(f"model '{model_id}' failed: {error}")
            final = result.get_response().parameters.get("triton_final_response")
            if result.get_response().outputs:
                results.append(result)
            if final is not None and final.bool_param:
                break
        return results
    finally:
        client.stop_stream()
        client.close()


def check_triton_folder(path: Path, arrays: dict[str, np.ndarray], spec: ModelSpec, timeout: float) -> Any:
    """Load ``spec`` (with an ensemble's steps) into an embedded tritonserver, send ``arrays`` once, unload; the
    outputs (a decoupled model's: its responses' stacked) and a note per output."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from controlplane.check import CheckFailed, CheckResult
    from controlplane.triton.launcher import EmbeddedTriton

    specs = _with_steps(spec, path)
    types = {t.name: t.datatype for t in spec.package.inputs}
    work = Path(tempfile.mkdtemp(prefix="snooze-check-"))
    triton = EmbeddedTriton(work / "repo", work / "triton")
    try:
        target = embedded_target()
        for each in specs:
            write_model(render_model(each, target), work / "repo")
        triton.start()
        http = httpclient.InferenceServerClient(triton.http_url.removeprefix("http://"), network_timeout=timeout)
        try:
            try:
                http.load_model(spec.id)
            except Exception as exc:  # tritonclient's InferenceServerException: Triton's reason
                raise CheckFailed(f"model '{spec.id}' did not load: {exc}") from None
            if spec.decoupled:
                inputs = [grpcclient.InferInput(n, list(a.shape), types[n]) for n, a in arrays.items()]
                for tensor, array in zip(inputs, arrays.values(), strict=True):
                    tensor.set_data_from_numpy(array)
                results = _stream(triton.grpc_url, spec.id, inputs, timeout)
                names = [t.name for t in spec.package.outputs]
                outputs = {n: np.stack([r.as_numpy(n) for r in results]) for n in names if results}
                notes = {n: f"{len(results)} streamed response(s), stacked on a first axis" for n in outputs}
            else:
                tensors = [httpclient.InferInput(n, list(a.shape), types[n]) for n, a in arrays.items()]
                for tensor, array in zip(tensors, arrays.values(), strict=True):
                    tensor.set_data_from_numpy(array, binary_data=True)
                try:
                    result = http.infer(spec.id, tensors)
                except Exception as exc:
                    raise CheckFailed(f"model '{spec.id}' failed: {exc}") from None
                outputs = {t.name: result.as_numpy(t.name) for t in spec.package.outputs}
                notes = {}
        finally:
            http.close()
    finally:
        triton.stop()
        shutil.rmtree(work, ignore_errors=True)
    return CheckResult(
        spec.id, "the embedded tritonserver", outputs, {n: str(a.dtype) for n, a in outputs.items()}, notes
    )
