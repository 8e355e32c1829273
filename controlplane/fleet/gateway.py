"""The fleet gateway: one Envoy in front of the nodes, routing each model to the node that owns it.

Ownership is Envoy's consistent hashing (a ring of node names) on the model name with bounded load: a
model normally lives on one node, and a hot one spills onto the next node(s) of the ring, which wake
it by their own retry-to-activator path; its spilled copies unload by their own idle timeout. The
model name is put in a header by a Lua filter (HTTP: the path; gRPC: the request message's name field),
so no Python runs on the hot path. Nodes are health-checked; a dead node's models are answered by the
next node of the ring (a cold start there) and come back when it does. Several fleet gateways over the
same nodes give the same answers: the ring depends on the node names only.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from controlplane.gateway.envoy import (
    MAX_UPSTREAM,
    UNAUTHORIZED_MESSAGE,
    ApiKey,
    EnvoyProcess,
    GatewayError,
    render_template,
)
from controlplane.gateway.wake_lua import LUA_PROTOBUF_STRING_FIELD

MODEL_HEADER = "x-snooze-model"
# A node may take this % of the average load (requests in flight) before the ring's next node helps.
HASH_BALANCE_FACTOR = 150
# ring_hash: each model to its owner node (model-affine); round_robin: every node in turn (a baseline).
LB_POLICIES = ("ring_hash", "round_robin")

HTTP_LUA = f"""
function envoy_on_request(handle)
  local headers = handle:headers()
  local path = headers:get(":path") or ""
  local model = string.match(path, "^/v2/models/([^/?]+)") or string.match(path, "^/v2/repository/models/([^/?]+)")
  if model then
    headers:replace("{MODEL_HEADER}", model)
  else
    headers:remove("{MODEL_HEADER}")
  end
end
"""

# gRPC: the model name is a field of the request message (field 1; field 2 of the repository calls).
# A small protobuf walk over the first bytes of the body (5 bytes of gRPC framing, then the message).
# A ModelStreamInfer stream's body never ends, so its first message's model_name comes from Envoy's
# grpc_field_extraction filter before it (which holds the headers until that message is in).
EXTRACTION_METADATA = "envoy.filters.http.grpc_field_extraction"
STREAM_METHOD = "inference.GRPCInferenceService.ModelStreamInfer"
GRPC_LUA = f"""
local NAME_FIELD = {{
  ["/inference.GRPCInferenceService/ModelInfer"] = 1,
  ["/inference.GRPCInferenceService/ModelReady"] = 1,
  ["/inference.GRPCInferenceService/ModelMetadata"] = 1,
  ["/inference.GRPCInferenceService/ModelConfig"] = 1,
  ["/inference.GRPCInferenceService/ModelStatistics"] = 1,
  ["/inference.GRPCInferenceService/RepositoryModelLoad"] = 2,
  ["/inference.GRPCInferenceService/RepositoryModelUnload"] = 2,
}}

{LUA_PROTOBUF_STRING_FIELD}
function envoy_on_request(handle)
  handle:headers():remove("{MODEL_HEADER}")
  local path = handle:headers():get(":path")
  if path == "/inference.GRPCInferenceService/ModelStreamInfer" then
    local extracted = handle:streamInfo():dynamicMetadata():get("{EXTRACTION_METADATA}")
    local names = extracted and extracted["model_name"]
    local model = names and names[1]
    if model then
      handle:headers():replace("{MODEL_HEADER}", model)
    end
    return
  end
  local wanted = NAME_FIELD[path]
  if wanted == nil then
    return
  end
  local body = handle:body()
  if body == nil then
    return
  end
  local model = string_field(body:getBytes(0, math.min(body:length(), 4096)), wanted)
  if model then
    -- headers() again: a handle taken before body() does not outlive it
    handle:headers():replace("{MODEL_HEADER}", model)
  end
end
"""


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
        http_lua=HTTP_LUA,
        grpc_lua=GRPC_LUA,
        grpc_descriptor_set=grpc_descriptor_set(),
        stream_method=STREAM_METHOD,
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
