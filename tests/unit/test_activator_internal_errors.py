"""The activator answers a failure of its own (a bug) in the protocol's error shape, naming it, rather than a bare
text 500 (HTTP) or grpc's "Unexpected <class ...>" (gRPC); its own answers (``context.abort``) pass unchanged."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest

from controlplane.gateway.grpc_adapter import GrpcActivator
from controlplane.gateway.http_adapter import HttpForwarder, create_http_app


class Broken:
    """A ModelAnswers whose forward fails as a bug would."""

    async def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("model 'm' already has a transition running")


async def test_http_answers_a_bug_as_a_kserve_error() -> None:
    async with httpx.AsyncClient() as upstream:
        app = create_http_app(Broken(), HttpForwarder("http://127.0.0.1:1", upstream), None)  # type: ignore[arg-type]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://activator") as client:
            r = await client.post("/v2/models/m/infer", content=b"{}")
    assert r.status_code == 500
    error = r.json()["error"]
    assert error.startswith("snoozeml: internal error in the activator (RuntimeError: model 'm' already has")


class Context:
    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise grpc.aio.AbortError()


@pytest.mark.parametrize("answered", [False, True])
async def test_grpc_answers_a_bug_as_internal_and_passes_its_own_answers(answered: bool) -> None:
    async def handler(request: bytes, context: Any) -> bytes:
        if answered:
            await context.abort(grpc.StatusCode.NOT_FOUND, "Request for unknown model: 'm' is not found")
        raise RuntimeError("model 'm' already has a transition running")

    context = Context()
    with pytest.raises(grpc.aio.AbortError):
        await GrpcActivator._handled(handler)(b"", context)  # type: ignore[arg-type]
    assert context.aborted is not None
    code, details = context.aborted
    if answered:
        assert (code, details) == (grpc.StatusCode.NOT_FOUND, "Request for unknown model: 'm' is not found")
    else:
        assert code is grpc.StatusCode.INTERNAL and "internal error in the activator (RuntimeError" in details
