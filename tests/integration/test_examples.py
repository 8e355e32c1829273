"""The example packages, rendered for the embedded target, served by the real tritonserver and
queried with the standard tritonclient HTTP and gRPC clients: exact answers, dynamic batching."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient

from controlplane.render import embedded_target
from controlplane.spec import discover, resolve_all
from controlplane.store import render_repository
from controlplane.triton.client import TritonAdminClient
from controlplane.triton.launcher import EmbeddedTriton

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "models"
HAS_TORCH = importlib.util.find_spec("torch") is not None


def _example_module(relpath: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def examples_loaded(embedded_triton: EmbeddedTriton) -> EmbeddedTriton:
    onnx_file = EXAMPLES / "onnx-mlp" / "model.onnx"
    if not onnx_file.exists():  # `make test` generates it; a bare pytest run may not have
        import onnx

        onnx.save(_example_module("examples/make_onnx_example.py", "make_onnx_example").build(), str(onnx_file))
    specs = [s for s in resolve_all(discover(EXAMPLES)) if HAS_TORCH or s.id != "torch-mlp"]
    render_repository(specs, embedded_triton.model_repository, embedded_target())

    async def load_all() -> None:
        async with TritonAdminClient(embedded_triton.http_url) as admin:
            for spec in specs:
                await admin.load(spec.id)

    asyncio.run(load_all())
    return embedded_triton


@pytest.fixture(params=["http", "grpc"])
def client(request: pytest.FixtureRequest, examples_loaded: EmbeddedTriton):
    if request.param == "http":
        c = httpclient.InferenceServerClient(examples_loaded.http_url.removeprefix("http://"))
        yield httpclient, c
    else:
        c = grpcclient.InferenceServerClient(examples_loaded.grpc_url)
        yield grpcclient, c
    c.close()


def infer(lib, c, model: str, arrays: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
    inputs = []
    for name, array in arrays.items():
        datatype = "BYTES" if array.dtype == object else {"float32": "FP32", "int64": "INT64"}[str(array.dtype)]
        tensor = lib.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    result = c.infer(model, inputs, outputs=[lib.InferRequestedOutput(o) for o in outputs])
    return {o: result.as_numpy(o) for o in outputs}


def test_numpy_model_exact_answer(client) -> None:
    lib, c = client
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    weights = np.arange(12, dtype=np.float32).reshape(4, 3) / 10.0
    expected = 2.0 * (x @ weights + np.array([0.5, -0.5, 1.0], dtype=np.float32))  # scale param = 2
    got = infer(lib, c, "numpy-linear", {"x": x}, ["y"])["y"]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_onnx_model_matches_reference(client) -> None:
    lib, c = client
    reference = _example_module("examples/make_onnx_example.py", "make_onnx_example").reference
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    got = infer(lib, c, "onnx-mlp", {"input": x}, ["output"])["output"]
    np.testing.assert_allclose(got, reference(x), rtol=1e-5, atol=1e-6)


def test_mixed_dtypes_with_strings(client) -> None:
    lib, c = client
    values = np.array([[1, 2, 3, 4], [0.5, 0.5, 0.5, 0.5]], dtype=np.float32)
    factor = np.array([[3], [2]], dtype=np.int64)
    text = np.array([[b"world"], ["snöoze".encode()]], dtype=object)
    got = infer(
        lib, c, "text-features", {"values": values, "factor": factor, "text": text}, ["scaled", "greeting", "length"]
    )
    np.testing.assert_array_equal(got["scaled"], values * factor)
    assert got["greeting"].ravel().tolist() == [b"hello, world", "hello, snöoze".encode()]
    assert got["length"].ravel().tolist() == [5, len("snöoze".encode())]


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed (pip install torch==2.13.0)")
def test_lazy_torch_model_matches_torch(client) -> None:
    import torch

    lib, c = client
    module = _example_module("examples/models/torch-mlp/snooze_model.py", "torch_example")._build_module()
    x = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    with torch.inference_mode():
        expected = module(torch.from_numpy(x)).numpy()
    got = infer(lib, c, "torch-mlp", {"features": x}, ["logits"])["logits"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_bad_input_gets_a_clear_error(client) -> None:
    lib, c = client
    x = np.zeros((1, 5), dtype=np.float32)  # the model wants 4 features
    with pytest.raises(Exception, match="x"):
        infer(lib, c, "numpy-linear", {"x": x}, ["y"])


def test_dynamic_batching_groups_concurrent_requests(examples_loaded: EmbeddedTriton) -> None:
    async def run() -> tuple[int, int]:
        async with TritonAdminClient(examples_loaded.http_url) as admin:
            before = await admin.model_stats("numpy-linear")
        client = grpcaio.InferenceServerClient(examples_loaded.grpc_url)
        x = np.ones((1, 4), dtype=np.float32)

        async def one() -> None:
            tensor = grpcaio.InferInput("x", [1, 4], "FP32")
            tensor.set_data_from_numpy(x)
            await client.infer("numpy-linear", [tensor])

        await asyncio.gather(*(one() for _ in range(256)))
        await client.close()
        async with TritonAdminClient(examples_loaded.http_url) as admin:
            after = await admin.model_stats("numpy-linear")
        return after.inference_count - before.inference_count, after.execution_count - before.execution_count

    inferences, executions = asyncio.run(run())
    assert inferences == 256
    assert executions < inferences, f"{executions} executions for {inferences} requests: no batching happened"
