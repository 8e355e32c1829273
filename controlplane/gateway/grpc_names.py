"""The KServe v2 gRPC service's name and the methods the gateway treats specially, written once.

Envoy's routes (node and fleet), the wake filter's Lua and the activator's gRPC handler all read these.
"""

from __future__ import annotations

SERVICE = "inference.GRPCInferenceService"
# Model calls whose answer for a sleeping model must differ from Triton's: Envoy routes them to the activator.
ACTIVATOR_ROUTED = (
    "ModelReady",
    "ModelMetadata",
    "ModelConfig",
    "RepositoryIndex",
    "RepositoryModelLoad",
    "RepositoryModelUnload",
)
# Everything the activator answers: the routed calls, and ModelInfer (Envoy retries it there to wake a model).
ACTIVATOR_ANSWERS = ("ModelInfer", *ACTIVATOR_ROUTED)


def path(method: str) -> str:
    """The HTTP/2 ``:path`` of ``method`` (``/inference.GRPCInferenceService/ModelInfer``)."""
    return f"/{SERVICE}/{method}"


def full_name(method: str) -> str:
    """The protobuf full name of ``method`` (``inference.GRPCInferenceService.ModelInfer``)."""
    return f"{SERVICE}.{method}"
