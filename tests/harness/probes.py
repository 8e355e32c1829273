"""The small steps every live test takes: wait for a condition (``until``, ``until_async``), each with a bound and a
message that says what it waited for; send one inference of an ``x -> y`` FP32 test model through tritonclient
(``http_infer``, ``grpc_infer``, and their asyncio twins), bounded by ``timeout`` seconds as well.

The standard library at import time: the Python 3.10 runtime run (``make test-runtime-py310``) imports this module
without the control plane's environment (tritonclient is imported by the calls that use it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as grpcaio
    import tritonclient.http as httpclient
    import tritonclient.http.aio as httpaio

T = TypeVar("T")

# What a wait waited for: a phrase, or a function asked at the timeout (to show the last state it saw).
What = str | Callable[[], str]


def _timed_out(what: What, timeout: float) -> AssertionError:
    return AssertionError(f"timed out after {timeout:g}s waiting for {what() if callable(what) else what}")


def until(condition: Callable[[], T], what: What, timeout: float = 90.0, interval: float = 0.1) -> T:
    """Call ``condition`` every ``interval`` seconds until it returns something truthy; that value. Fails after
    ``timeout`` seconds, naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout)
        time.sleep(interval)


async def until_async(
    condition: Callable[[], object], what: What, timeout: float = 60.0, interval: float = 0.1, *, in_thread: bool = True
) -> float:
    """``until`` from async code; the seconds it took. ``in_thread``: the condition blocks (HTTP calls, the process
    table), so it runs in a worker thread and the loop goes on serving; False for one that reads objects of the
    loop itself (they change only between its steps)."""
    started = time.monotonic()
    while not (await asyncio.to_thread(condition) if in_thread else condition()):
        if time.monotonic() - started >= timeout:
            raise _timed_out(what, timeout)
        await asyncio.sleep(interval)
    return time.monotonic() - started


# One inference: ``client`` is a client, or "host:port" for a client of this call alone (closed after). A client the
# caller made keeps its own HTTP timeouts; ``timeout`` bounds gRPC calls (their deadline), asyncio HTTP calls, and the
# HTTP clients made here. ``headers``: the request's own (an API key), none by default.


def http_infer(
    client: httpclient.InferenceServerClient | str,
    model: str,
    x: np.ndarray,
    *,
    headers: Mapping[str, str] | None = None,
    binary: bool = True,
    timeout: float = 60.0,
) -> np.ndarray:
    """``y`` for ``x`` over HTTP; ``binary``: the tensors in binary form, else in the JSON body."""
    import tritonclient.http as httpclient

    if isinstance(client, str):
        with httpclient.InferenceServerClient(client, connection_timeout=timeout, network_timeout=timeout) as own:
            return http_infer(own, model, x, headers=headers, binary=binary)
    inp = httpclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("y", binary_data=binary)
    # A copy: tritonclient.http adds Inference-Header-Content-Length to the dict it is given.
    return client.infer(model, [inp], outputs=[out], headers=_copy(headers)).as_numpy("y")


def grpc_infer(
    client: grpcclient.InferenceServerClient | str,
    model: str,
    x: np.ndarray,
    *,
    headers: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> np.ndarray:
    """``y`` for ``x`` over gRPC."""
    import tritonclient.grpc as grpcclient

    if isinstance(client, str):
        with grpcclient.InferenceServerClient(client) as own:
            return grpc_infer(own, model, x, headers=headers, timeout=timeout)
    inp = grpcclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp], headers=_copy(headers), client_timeout=timeout).as_numpy("y")


async def http_infer_async(
    client: httpaio.InferenceServerClient | str,
    model: str,
    x: np.ndarray,
    *,
    headers: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> np.ndarray:
    """``y`` for ``x`` over HTTP, from asyncio (tritonclient.http.aio)."""
    import tritonclient.http.aio as httpaio

    if isinstance(client, str):
        own = httpaio.InferenceServerClient(client)
        try:
            return await http_infer_async(own, model, x, headers=headers, timeout=timeout)
        finally:
            await own.close()
    inp = httpaio.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    out = httpaio.InferRequestedOutput("y")
    result = await asyncio.wait_for(client.infer(model, [inp], outputs=[out], headers=_copy(headers)), timeout)
    return result.as_numpy("y")


async def grpc_infer_async(
    client: grpcaio.InferenceServerClient | str,
    model: str,
    x: np.ndarray,
    *,
    headers: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> np.ndarray:
    """``y`` for ``x`` over gRPC, from asyncio (tritonclient.grpc.aio)."""
    import tritonclient.grpc.aio as grpcaio

    if isinstance(client, str):
        own = grpcaio.InferenceServerClient(client)
        try:
            return await grpc_infer_async(own, model, x, headers=headers, timeout=timeout)
        finally:
            await own.close()
    inp = grpcaio.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = await client.infer(model, [inp], headers=_copy(headers), client_timeout=timeout)
    return result.as_numpy("y")


def _copy(headers: Mapping[str, str] | None) -> dict[str, str] | None:
    return dict(headers) if headers is not None else None
