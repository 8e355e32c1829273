"""A corpus of real architectures, served with the default settings through one running stack.

Each model is published asleep, called over HTTP (its cold start) and gRPC through the gateway, compared with
its framework in-process (bit-identical; within 1e-5 where a conversion ran), left to idle-unload, then woken
again over gRPC and HTTP. The torch architectures served as custom torch models (in-stub and preforked) are
the slow tier. Each model's cold and warm times go to ``$SNOOZE_CORPUS_TIMES`` (JSON lines) when it is set:
``bench/corpus_times.py`` runs this module and prints them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from harness import corpus_models as C
from harness.probes import until
from harness.serve import Serve

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_SKL2ONNX = importlib.util.find_spec("skl2onnx") is not None
pytestmark = [
    pytest.mark.integration,
    pytest.mark.torch,
    pytest.mark.skipif(not (HAS_TORCH and HAS_SKL2ONNX), reason="needs torch and skl2onnx (make install-dev)"),
]

IDLE_SECS = 2.0
ARCHS = ["resnet", "mobilenet", "vit", "gru", "text-encoder"]
LIGHT = [f"onnx-{a}" for a in ARCHS] + [
    "sklearn-pipeline",
    "sklearn-gbt",
    "onnx-sklearn-pipeline",
    "onnx-sklearn-gbt",
    "onnx-scalar",
    "onnx-stateful-gru",
    "onnx-detector",
    "text-bytes",
    "onnx-text-sklearn-cities",
    "onnx-text-normalizer",
    "onnx-text-label-encoder",
]
HEAVY = [f"torch-{a}-{w}" for w in ("in-stub", "preforked") for a in ARCHS]


def _build(root: Path, case_id: str) -> C.Case:
    special = {
        "onnx-scalar": C.scalar_case,
        "onnx-stateful-gru": C.stateful_case,
        "onnx-detector": C.detector_case,
        "text-bytes": C.text_case,
        "onnx-text-sklearn-cities": C.sklearn_cities_case,
        "onnx-text-normalizer": C.string_normalizer_case,
        "onnx-text-label-encoder": C.label_encoder_case,
    }
    if case_id in special:
        return special[case_id](root)
    if case_id.startswith("torch-"):
        worker = "preforked" if case_id.endswith("-preforked") else "in-stub"
        return C.torch_custom_case(root, case_id.removeprefix("torch-").removesuffix(f"-{worker}"), worker)
    if case_id.startswith("onnx-sklearn-"):
        return C.sklearn_onnx_case(root, case_id.removeprefix("onnx-sklearn-"))
    if case_id.startswith("sklearn-"):
        return C.sklearn_custom_case(root, case_id.removeprefix("sklearn-"))
    return C.onnx_torch_case(root, case_id.removeprefix("onnx-"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Serve, dict[str, C.Case]]]:
    """ONE stack for the whole corpus; every model published (asleep) before the first test (the heavy ones too:
    a publish is cheap, their loads run only in the slow tier)."""
    root = tmp_path_factory.mktemp("corpus")
    wanted = LIGHT + HEAVY
    env = {
        **os.environ,
        "SNOOZE_SWEEP_INTERVAL_SECS": "0.5",
        "SNOOZE_SHUTDOWN_GRACE_SECS": "5",
        "SNOOZE_TRITON_EXIT_TIMEOUT_SECS": "2",
    }
    serve = Serve(root / "work", env)
    cases: dict[str, C.Case] = {}
    try:
        serve.start(ready=True)
        with serve.api(None) as api:
            for case_id in wanted:
                case = _build(root / "packages", case_id)
                detail = api.publish_path(case.path, case.id, idle_timeout_secs=IDLE_SECS, **case.deployment)
                case.deployment["notes"] = detail.get("notes") or []
                cases[case.id] = case
        yield serve, cases
    finally:
        serve.stop()


def _wire(array: np.ndarray) -> str:
    return (
        "BYTES" if array.dtype == object else {"float32": "FP32", "float64": "FP64", "int64": "INT64"}[str(array.dtype)]
    )


def infer(serve: Serve, protocol: str, model_id: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    if protocol == "http":
        lib, client, kw = httpclient, httpclient.InferenceServerClient(serve.http_url, network_timeout=120.0), {}
    else:
        lib, client, kw = grpcclient, grpcclient.InferenceServerClient(serve.grpc_url), {"client_timeout": 120.0}
    try:
        tensors = []
        for name, array in inputs.items():
            tensor = lib.InferInput(name, list(array.shape), _wire(array))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        result = client.infer(model_id, tensors, **kw)
        response = result.get_response() if protocol == "http" else result.get_response(as_json=True)
        names = [o["name"] for o in response["outputs"]]
        return {name: result.as_numpy(name) for name in names}
    finally:
        client.close()


def check(case: C.Case, got: dict[str, np.ndarray], how: str) -> None:
    for name, want in case.expected.items():
        have = got[name]
        if have.shape != want.shape and have.size == want.size:  # a rank-0 output per row: [batch, 1] on the wire
            have = have.reshape(want.shape)
        if case.atol == 0:
            np.testing.assert_array_equal(have, want, err_msg=f"{case.id} {name} ({how})")
        elif np.issubdtype(want.dtype, np.integer):
            np.testing.assert_array_equal(have, want, err_msg=f"{case.id} {name} ({how})")
        else:
            np.testing.assert_allclose(have, want, rtol=0, atol=case.atol, err_msg=f"{case.id} {name} ({how})")


def call(serve: Serve, case: C.Case, protocol: str) -> dict[str, np.ndarray]:
    """One answer of the case: one request, or for the state model 20, each carrying the state it got back."""
    if "steps" not in case.inputs:
        return infer(serve, protocol, case.id, case.inputs)
    h = np.zeros((2, 1, 128), np.float32)
    for x in case.inputs["steps"]:
        out = infer(serve, protocol, case.id, {"x": x, "h": h})
        h = out["h_out"]
    return out


def state(serve: Serve, model_id: str) -> dict:
    with serve.api(None) as api:
        return api.get(model_id)["status"]


def _record(case: C.Case, **times: float) -> None:
    path = os.environ.get("SNOOZE_CORPUS_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"model": case.id, "what": case.what, **times}) + "\n")


def _run(corpus: tuple[Serve, dict[str, C.Case]], case_id: str) -> None:
    serve, cases = corpus
    case = cases[case_id]
    assert state(serve, case.id)["state"] == "unloaded"  # asleep
    started = time.perf_counter()
    check(case, call(serve, case, "http"), "http, cold")
    cold = time.perf_counter() - started
    started = time.perf_counter()
    check(case, call(serve, case, "grpc"), "grpc, warm")
    warm = time.perf_counter() - started
    status = state(serve, case.id)
    until(lambda: state(serve, case.id)["state"] == "unloaded", f"{case.id} idle-unloaded", timeout=60)
    started = time.perf_counter()
    check(case, call(serve, case, "grpc"), "grpc, woken again")
    woken = time.perf_counter() - started
    check(case, call(serve, case, "http"), "http, after waking")
    again = state(serve, case.id)
    _record(
        case,
        cold_secs=cold,
        warm_secs=warm,
        woken_secs=woken,
        warmup_first=status.get("warmup"),
        warmup_after=again.get("warmup"),
        server_cold_secs=status.get("last_cold_start_secs"),
    )
    if case.id == "onnx-detector":
        # The generated [1,3,1,1] image fails the two-scale head: skipped, said in the status; the next load is
        # warmed with the image size the client sent.
        assert status["warmup"].startswith("skipped (signature input [1,3,1,1] failed: "), status["warmup"]
        assert again["warmup"] == "learned", again["warmup"]
        said = serve.log.read_text(errors="replace").count("model 'onnx-detector': warmup: skipped (")
        assert said == 1, f"the control plane said the skipped warm-up {said} times"
    elif case.id == "onnx-stateful-gru":
        assert any("max_batch_size 0" in n and "first (batch) axis" in n for n in case.deployment["notes"])
    else:
        assert status["warmup"] in ("signature", "learned"), (case.id, status["warmup"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case_id", LIGHT)
def test_a_corpus_model_answers_as_its_framework_asleep_awake_and_woken(corpus, case_id: str) -> None:
    _run(corpus, case_id)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case_id", HEAVY)
def test_a_torch_architecture_served_as_a_custom_model(corpus, case_id: str) -> None:
    _run(corpus, case_id)
