"""Where a fleet's nodes are, for `snoozectl fleet gateway`: a static list, or a StatefulSet's pods.

A node is a name (its position on the gateway's ring, so it must outlive the node's address) and a
host the fleet gateway and the fleet API reach it at. A StatefulSet's pods are stable names with
stable DNS names through their headless Service (``<pod>.<service>[.<namespace>.svc]``), whatever
their IP after a reschedule: exactly what the ring needs.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence

from controlplane.errors import SnoozeError
from controlplane.fleet.gateway import NodeAddress

# The node gateway's and control API's ports in every deployed topology (the base pod, compose).
NODE_HTTP_PORT, NODE_GRPC_PORT, NODE_API_PORT = 8000, 8001, 8080
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,62})")
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})")
_PORTS = re.compile(r"(?P<host>.+?):(?P<http>\d+):(?P<grpc>\d+):(?P<api>\d+)")
NODE_SYNTAX = "NAME=HOST or NAME=HOST:HTTP_PORT:GRPC_PORT:API_PORT"


def _port(value: str, what: str, spec: str) -> int:
    port = int(value)
    if not 1 <= port <= 65535:
        raise SnoozeError(f"--node {spec!r}: {what} port {port} is not a port", hint="ports are 1..65535")
    return port


def parse_node(
    spec: str, *, http_port: int = NODE_HTTP_PORT, grpc_port: int = NODE_GRPC_PORT, api_port: int = NODE_API_PORT
) -> NodeAddress:
    """``NAME=HOST`` (the default ports) or ``NAME=HOST:HTTP:GRPC:API`` (this node's own ports)."""
    name, eq, rest = spec.partition("=")
    if not eq or not name or not rest:
        raise SnoozeError(f"--node {spec!r} is not {NODE_SYNTAX}", hint="e.g. --node node-0=10.0.0.7")
    if not _NAME.fullmatch(name):
        raise SnoozeError(
            f"--node {spec!r}: node name {name!r} is not a name",
            hint="letters, digits, '.', '_' and '-', at most 63 characters (it places the node on the ring)",
        )
    host = rest
    ports = _PORTS.fullmatch(rest)
    if ports:
        host = ports["host"]
        http_port, grpc_port, api_port = (_port(ports[k], k, spec) for k in ("http", "grpc", "api"))
    if not _HOST.fullmatch(host):
        raise SnoozeError(
            f"--node {spec!r}: {host!r} is not a host name or IPv4 address",
            hint=f"write {NODE_SYNTAX} (IPv6 literals are not supported: use a DNS name)",
        )
    return NodeAddress(name, host, http_port, grpc_port, api_port)


def statefulset_nodes(
    statefulset: str,
    service: str,
    replicas: int,
    *,
    namespace: str | None = None,
    http_port: int = NODE_HTTP_PORT,
    grpc_port: int = NODE_GRPC_PORT,
    api_port: int = NODE_API_PORT,
) -> list[NodeAddress]:
    """The pods ``<statefulset>-0 .. -<replicas-1>``, each at its DNS name through the headless ``service``."""
    if replicas < 1:
        raise SnoozeError(
            f"--replicas {replicas}: a fleet needs at least one node",
            hint="pass the StatefulSet's spec.replicas",
        )
    for flag, value in (("--statefulset", statefulset), ("--service", service), ("--namespace", namespace)):
        if value is not None and not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", value):
            raise SnoozeError(
                f"{flag} {value!r} is not a Kubernetes name",
                hint="lower-case letters, digits and '-' (an RFC 1123 label), as in the manifests",
            )
    suffix = f".{namespace}.svc" if namespace else ""
    return [
        NodeAddress(f"{statefulset}-{i}", f"{statefulset}-{i}.{service}{suffix}", http_port, grpc_port, api_port)
        for i in range(replicas)
    ]


def check_unique(nodes: Sequence[NodeAddress]) -> None:
    """Two nodes of one name would share a ring position; two at one address are one node twice."""
    names = [n.name for n in nodes]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise SnoozeError(f"node name(s) {', '.join(twice)} given twice", hint="give every --node its own NAME")
    addresses = [f"{n.host}:{n.http_port}" for n in nodes]
    twice = sorted({a for a in addresses if addresses.count(a) > 1})
    if twice:
        raise SnoozeError(f"several nodes at {', '.join(twice)}", hint="every node needs its own host or ports")


def fleet_nodes(
    specs: Sequence[str],
    *,
    statefulset: str | None = None,
    service: str | None = None,
    replicas: int | None = None,
    namespace: str | None = None,
    http_port: int = NODE_HTTP_PORT,
    grpc_port: int = NODE_GRPC_PORT,
    api_port: int = NODE_API_PORT,
) -> list[NodeAddress]:
    """The node list of `snoozectl fleet gateway`: the ``--node`` specs, or a StatefulSet's pods."""
    ports = {"http_port": http_port, "grpc_port": grpc_port, "api_port": api_port}
    for key, port in ports.items():
        if not 1 <= port <= 65535:
            flag = "--node-" + key.replace("_", "-")
            raise SnoozeError(
                f"{flag} {port} is not a port", hint="ports are 1..65535 (the nodes' defaults: 8000, 8001, 8080)"
            )
    pod_flags = {"--statefulset": statefulset, "--service": service, "--replicas": replicas}
    if specs and any(v is not None for v in (*pod_flags.values(), namespace)):
        raise SnoozeError(
            "--node and --statefulset/--service/--replicas/--namespace name the nodes twice",
            hint="pass either --node NAME=HOST ... or --statefulset S --service SVC --replicas N",
        )
    if specs:
        nodes = [parse_node(spec, **ports) for spec in specs]
    elif all(v is not None for v in pod_flags.values()):
        assert statefulset is not None and service is not None and replicas is not None
        nodes = statefulset_nodes(statefulset, service, replicas, namespace=namespace, **ports)
    else:
        missing = [flag for flag, v in pod_flags.items() if v is None]
        raise SnoozeError(
            f"no nodes: pass --node NAME=HOST (repeat it), or a StatefulSet's pods (missing {', '.join(missing)})",
            hint="e.g. --statefulset snooze-node --service snooze-nodes --replicas 3",
        )
    check_unique(nodes)
    return nodes


def needs_dns(nodes: Sequence[NodeAddress]) -> bool:
    """Whether any host is a name to resolve (Envoy STRICT_DNS) rather than an IP address (STATIC)."""
    for n in nodes:
        try:
            ipaddress.IPv4Address(n.host)
        except ValueError:
            return True
    return False
