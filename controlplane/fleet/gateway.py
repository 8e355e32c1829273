"""The fleet gateway: one Envoy in front of the nodes, routing each model to the node that owns it.

Ownership is Envoy's consistent hashing (a ring of node names) on the model name with bounded load: a
model normally lives on one node, and a hot one spills onto the next node(s) of the ring, which wake
it by their own retry-to-activator path; its spilled copies unload by their own idle timeout. The
ring's key is the model's name, found by Envoy's own filters (HTTP: the path; gRPC: the request message's name
field): no Python and no Lua on the hot path. Nodes are health-checked; a dead node's models are answered by the
next node of the ring (a cold start there) and come back when it does. Several fleet gateways over the
same nodes give the same answers: the ring depends on the node names only.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from controlplane.errors import GatewayError
from controlplane.gateway import grpc_names
from controlplane.gateway.envoy import MAX_UPSTREAM, UNAUTHORIZED_MESSAGE, ApiKey, render_template
from controlplane.gateway.envoy_process import EnvoyProcess

MODEL_HEADER = "x-snooze-model"
# A node may take this % of the average load (requests in flight) before the ring's next node helps.
HASH_BALANCE_FACTOR = 150
# ring_hash: each model to its owner node (model-affine); round_robin: every node in turn (a baseline).
LB_POLICIES = ("ring_hash", "round_robin")

# HTTP: the model's name from the path, as the ring's key (Envoy rewrites the :path value it hashes; no Lua).
HTTP_KEY_REGEX = r"^/v2/(?:repository/)?models/([^/?]+).*$"
# gRPC: the request message's name field, extracted by grpc_field_extraction (C++; a stream's from its first
# message), which holds the headers until the field is in; header_mutation copies it into MODEL_HEADER, where
# it renders as a one-item JSON list beside "-" for the absent other field name: the key is what is inside.
EXTRACTION_METADATA = "envoy.filters.http.grpc_field_extraction"
GRPC_KEY_REGEX = r'^-?\["(.*)"\]-?$'
GRPC_NAME_FIELDS = (
    (grpc_names.full_name("ModelInfer"), "model_name"),
    (grpc_names.full_name("ModelStreamInfer"), "model_name"),
    (grpc_names.full_name("ModelReady"), "name"),
    (grpc_names.full_name("ModelMetadata"), "name"),
    (grpc_names.full_name("ModelConfig"), "name"),
    (grpc_names.full_name("ModelStatistics"), "name"),
    (grpc_names.full_name("RepositoryModelLoad"), "model_name"),
    (grpc_names.full_name("RepositoryModelUnload"), "model_name"),
)


@dataclass(frozen=True)
class NodeAddress:
    """One node's gateway (and control API): what the fleet gateway and the fleet API talk to."""

    name: str  # stable: the ring position (a StatefulSet pod name, node-1, ...)
    host: str
    http_port: int
    grpc_port: int
    api_port: int

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.api_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"


@functools.cache
def grpc_descriptor_set() -> str:
    """Triton's gRPC service and its imports as a FileDescriptorSet (base64: the bootstrap's inline bytes), from
    the tritonclient stubs, for grpc_field_extraction."""
    from google.protobuf import descriptor_pb2
    from tritonclient.grpc import service_pb2

    out = descriptor_pb2.FileDescriptorSet()
    seen: set[str] = set()

    def add(file: object) -> None:
        if file.name in seen:  # type: ignore[attr-defined]
            return
        for dependency in file.dependencies:  # type: ignore[attr-defined]
            add(dependency)
        seen.add(file.name)  # type: ignore[attr-defined]
        file.CopyToProto(out.file.add())  # type: ignore[attr-defined]

    add(service_pb2.DESCRIPTOR)
    return base64.b64encode(out.SerializeToString()).decode()


def render_fleet_bootstrap(
    nodes: Sequence[NodeAddress],
    *,
    host: str,
    http_port: int,
    grpc_port: int,
    admin_port: int = 0,
    api_keys: Sequence[ApiKey] = (),
    buffer_bytes: int = 8 * 1024 * 1024,
    dns: bool = False,
    health_interval: str = "1s",
    hash_balance_factor: int = HASH_BALANCE_FACTOR,
    lb_policy: str = "ring_hash",
) -> str:
    """The fleet gateway's Envoy bootstrap. ``dns``: node hosts are DNS names to resolve (STRICT_DNS).
    ``lb_policy``: "ring_hash" (model-affine, the fleet's routing) or "round_robin" (a baseline)."""
    if not nodes:
        raise GatewayError("a fleet needs at least one node", hint="pass --nodes N (N >= 1)")
    if lb_policy not in LB_POLICIES:
        raise GatewayError(
            f"fleet gateway lb_policy {lb_policy!r} is not a policy", hint=f"use one of {', '.join(LB_POLICIES)}"
        )
    return render_template(
        "controlplane.fleet",
        "fleet.yaml.j2",
        nodes=list(nodes),
        host=host,
        http_port=http_port,
        grpc_port=grpc_port,
        admin_port=admin_port,
        api_keys=list(api_keys),
        buffer_bytes=buffer_bytes,
        dns=dns,
        health_interval=health_interval,
        hash_balance_factor=hash_balance_factor,
        lb_policy=lb_policy,
        model_header=MODEL_HEADER,
        http_key_regex=HTTP_KEY_REGEX,
        grpc_key_regex=GRPC_KEY_REGEX,
        grpc_name_fields=GRPC_NAME_FIELDS,
        extraction_metadata=EXTRACTION_METADATA,
        grpc_descriptor_set=grpc_descriptor_set(),
        unauthorized_message=UNAUTHORIZED_MESSAGE,
        max_upstream=MAX_UPSTREAM,
    )


class FleetGateway:
    """The fleet gateway's Envoy, as a child process."""

    def __init__(
        self, nodes: Sequence[NodeAddress], work_dir: Path, *, host: str, http_port: int, grpc_port: int,
        api_keys: Sequence[ApiKey] = (), dns: bool = False, lb_policy: str = "ring_hash",
    ) -> None:  # fmt: skip
        bootstrap = render_fleet_bootstrap(
            nodes, host=host, http_port=http_port, grpc_port=grpc_port, api_keys=api_keys, dns=dns,
            lb_policy=lb_policy,
        )  # fmt: skip
        connect = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.process = EnvoyProcess(
            bootstrap, work_dir, listen=[(connect, http_port), (connect, grpc_port)], name="fleet-gateway"
        )

    def start(self) -> None:
        self.process.start()

    def stop(self) -> None:
        self.process.stop()

    def running(self) -> bool:
        return self.process.is_running()

    def stats(self) -> dict[str, int]:
        return self.process.stats()
