"""The activator's KServe v2 gRPC adapter: a generic grpc.aio handler over ``handlers.ModelAnswers``;
inference messages pass as raw bytes (identity serializers)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import Message
from tritonclient.grpc import service_pb2

from controlplane.errors import SnoozeError, UnavailableError
from controlplane.gateway import grpc_names
from controlplane.gateway.handlers import ModelAnswers
from controlplane.gateway.triton_words import internal_error_message
from controlplane.triton.dead_stub import is_dead_stub_message
from controlplane.triton.journal import REQUEST_ID_HEADER

log = logging.getLogger("snoozeml.gateway")

# Not forwarded as gRPC metadata: set by the channel itself.
_GRPC_RESERVED = {"te", "content-type", "user-agent", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding"}
GRPC_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
_GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ALREADY_EXISTS,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    503: grpc.StatusCode.UNAVAILABLE,
}
# Requests and answers pass as raw bytes both ways (no serializers on either side).
_Context: TypeAlias = "grpc.aio.ServicerContext[bytes, bytes]"
_Handler: TypeAlias = Callable[[bytes, _Context], Awaitable[bytes]]


def _metadata(context: _Context) -> list[tuple[str, str | bytes]]:
    return [
        (key, value)
        for key, value in context.invocation_metadata() or ()
        if not key.startswith((":", "x-envoy-")) and key not in _GRPC_RESERVED
    ]


def _is_dead_stub(answer: bytes | grpc.aio.AioRpcError) -> bool:
    return (
        isinstance(answer, grpc.aio.AioRpcError)
        and answer.code() == grpc.StatusCode.INTERNAL
        and is_dead_stub_message(answer.details() or "")
    )


def _serialized(message: Message) -> bytes:
    """A KServe message's wire bytes (tritonclient's generated messages carry no type information)."""
    return message.SerializeToString()


def _parameter(value: service_pb2.ModelRepositoryParameter) -> Any:
    kind = value.WhichOneof("parameter_choice")
    raw = getattr(value, kind) if kind else ""
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw


class GrpcActivator:
    """The handlers of the gRPC methods Envoy sends to ``activator_grpc``; messages are raw bytes."""

    def __init__(self, answers: ModelAnswers, triton_grpc_url: str) -> None:
        self.answers = answers
        self.channel = grpc.aio.insecure_channel(triton_grpc_url, options=GRPC_OPTIONS)

    def handler(self) -> grpc.GenericRpcHandler:
        methods = {
            "ModelInfer": self.model_infer,
            "ModelReady": self.model_ready,
            "ModelMetadata": self.model_metadata,
            "ModelConfig": self.model_config,
            "RepositoryIndex": self.repository_index,
            "RepositoryModelLoad": self.repository_load,
            "RepositoryModelUnload": self.repository_unload,
        }
        return grpc.method_handlers_generic_handler(
            grpc_names.SERVICE,
            {name: grpc.unary_unary_rpc_method_handler(self._handled(fn)) for name, fn in methods.items()},
        )

    @staticmethod
    def _handled(fn: _Handler) -> _Handler:
        async def handle(request: bytes, context: _Context) -> bytes:
            try:
                return await fn(request, context)
            except grpc.aio.AbortError:
                raise  # an answer already given
            except SnoozeError as e:
                if isinstance(e, UnavailableError):
                    context.set_trailing_metadata((("retry-after", str(max(1, round(e.retry_after or 1)))),))
                await context.abort(_GRPC_CODES.get(e.status_code, grpc.StatusCode.INTERNAL), str(e))
            except Exception as e:  # a bug here: the client still gets an answer that says so, not grpc's "Unexpected"
                log.exception("activator: %s failed", getattr(fn, "__name__", "a call"))
                await context.abort(grpc.StatusCode.INTERNAL, internal_error_message(e))

        return handle

    async def _forward(self, method: str, request: bytes, context: _Context) -> bytes:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = self.channel.unary_unary(grpc_names.path(method))
        return await call(request, metadata=_metadata(context), timeout=context.time_remaining())

    async def model_infer(self, request: bytes, context: _Context) -> bytes:
        name = service_pb2.ModelInferRequest.FromString(request).model_name
        request_id = next((str(v) for k, v in context.invocation_metadata() or () if k == REQUEST_ID_HEADER), "")
        answer = await self.answers.forward(
            name,
            request_id,
            lambda: self._try_forward("ModelInfer", request, context),
            _is_dead_stub,
            timeout=context.time_remaining(),
        )
        if isinstance(answer, grpc.aio.AioRpcError):
            await context.abort(answer.code(), answer.details() or "")
        return answer

    async def _try_forward(self, method: str, request: bytes, context: _Context) -> bytes | grpc.aio.AioRpcError:
        try:
            return await self._forward(method, request, context)
        except grpc.aio.AioRpcError as e:
            return e

    async def model_ready(self, request: bytes, context: _Context) -> bytes:
        msg = service_pb2.ModelReadyRequest.FromString(request)
        versions = self.answers.served_versions(msg.name)
        ready = (not msg.version or msg.version in versions) and self.answers.ready(msg.name)
        return _serialized(service_pb2.ModelReadyResponse(ready=ready))

    async def model_metadata(self, request: bytes, context: _Context) -> bytes:
        msg = service_pb2.ModelMetadataRequest.FromString(request)
        meta = self.answers.metadata(self.answers.published(msg.name, msg.version))
        tensor = service_pb2.ModelMetadataResponse.TensorMetadata
        return _serialized(
            service_pb2.ModelMetadataResponse(
                name=meta["name"],
                versions=meta["versions"],
                platform=meta["platform"],
                inputs=[tensor(**t) for t in meta["inputs"]],
                outputs=[tensor(**t) for t in meta["outputs"]],
            )
        )

    async def model_config(self, request: bytes, context: _Context) -> bytes:
        msg = service_pb2.ModelConfigRequest.FromString(request)
        model = self.answers.published(msg.name, msg.version)
        if self.answers.loaded(msg.name):
            try:
                return await self._forward("ModelConfig", request, context)
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), e.details() or "")
        return _serialized(service_pb2.ModelConfigResponse(config=self.answers.config(model)))

    async def repository_index(self, request: bytes, context: _Context) -> bytes:
        msg = service_pb2.RepositoryIndexRequest.FromString(request)
        entries = [service_pb2.RepositoryIndexResponse.ModelIndex(**e) for e in self.answers.index(msg.ready)]
        return _serialized(service_pb2.RepositoryIndexResponse(models=entries))

    def _check_admin(self, context: _Context) -> None:
        self.answers.check_admin([(key, str(value)) for key, value in context.invocation_metadata() or ()])

    async def repository_load(self, request: bytes, context: _Context) -> bytes:
        self._check_admin(context)
        msg = service_pb2.RepositoryModelLoadRequest.FromString(request)
        self.answers.published_for_load(msg.model_name)
        parameters = {key: _parameter(value) for key, value in msg.parameters.items()}
        await self.answers.load(msg.model_name, parameters)
        return _serialized(service_pb2.RepositoryModelLoadResponse())

    async def repository_unload(self, request: bytes, context: _Context) -> bytes:
        self._check_admin(context)
        msg = service_pb2.RepositoryModelUnloadRequest.FromString(request)
        self.answers.published(msg.model_name)
        await self.answers.unload(msg.model_name)
        return _serialized(service_pb2.RepositoryModelUnloadResponse())

    async def aclose(self) -> None:
        await self.channel.close()
