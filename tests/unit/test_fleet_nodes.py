"""`snoozectl fleet gateway`'s node list: --node specs, a StatefulSet's pod DNS names, and the flag errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.errors import SnoozeError
from controlplane.fleet.gateway import NodeAddress, render_fleet_bootstrap
from controlplane.fleet.nodes import fleet_nodes, needs_dns, parse_node, statefulset_nodes
from controlplane.gateway.envoy_process import EnvoyProcess


def test_a_statefulset_expands_to_its_pods_dns_names():
    nodes = statefulset_nodes("snooze-node", "snooze-nodes", 3)
    assert [n.name for n in nodes] == ["snooze-node-0", "snooze-node-1", "snooze-node-2"]
    assert [n.host for n in nodes] == [f"snooze-node-{i}.snooze-nodes" for i in range(3)]
    assert {(n.http_port, n.grpc_port, n.api_port) for n in nodes} == {(8000, 8001, 8080)}
    [node] = statefulset_nodes("snooze-node", "snooze-nodes", 1, namespace="ml", api_port=9090)
    assert node == NodeAddress("snooze-node-0", "snooze-node-0.snooze-nodes.ml.svc", 8000, 8001, 9090)
    assert node.api_url == "http://snooze-node-0.snooze-nodes.ml.svc:9090"


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("snooze-node", "snooze-nodes", 0), "--replicas 0: a fleet needs at least one node"),
        (("Snooze_Node", "snooze-nodes", 3), "--statefulset 'Snooze_Node' is not a Kubernetes name"),
        (("snooze-node", "nodes.svc", 3), "--service 'nodes.svc' is not a Kubernetes name"),
    ],
)
def test_statefulset_flags_are_checked(args: tuple[str, str, int], error: str):
    with pytest.raises(SnoozeError, match=error.replace(".", r"\.")):
        statefulset_nodes(*args)


def test_a_node_spec_with_default_or_own_ports():
    assert parse_node("node-0=10.0.0.7") == NodeAddress("node-0", "10.0.0.7", 8000, 8001, 8080)
    assert parse_node("a=host.example", http_port=1, grpc_port=2, api_port=3) == NodeAddress(
        "a", "host.example", 1, 2, 3
    )
    assert parse_node("b=localhost:9000:9001:9002") == NodeAddress("b", "localhost", 9000, 9001, 9002)


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("10.0.0.7", "is not NAME=HOST"),
        ("=10.0.0.7", "is not NAME=HOST"),
        ("node-0=", "is not NAME=HOST"),
        ("-node=10.0.0.7", "node name '-node' is not a name"),
        ("node 0=10.0.0.7", "node name 'node 0' is not a name"),
        ("n=::1", "'::1' is not a host name or IPv4 address"),
        ("n=host:8000", "'host:8000' is not a host name"),
        ("n=http://host", "is not a host name"),
        ("n=host:0:8001:8080", "http port 0 is not a port"),
        ("n=host:8000:8001:70000", "api port 70000 is not a port"),
    ],
)
def test_bad_node_specs_name_the_spec(spec: str, error: str):
    with pytest.raises(SnoozeError, match=error.replace(".", r"\.")) as caught:
        parse_node(spec)
    assert repr(spec) in caught.value.message and caught.value.hint


def test_the_node_list_from_either_flag_set():
    assert [n.name for n in fleet_nodes(["a=h1", "b=h2"])] == ["a", "b"]
    pods = fleet_nodes([], statefulset="s", service="svc", replicas=2, namespace="ns", http_port=7000)
    assert [(n.host, n.http_port) for n in pods] == [("s-0.svc.ns.svc", 7000), ("s-1.svc.ns.svc", 7000)]


@pytest.mark.parametrize(
    ("specs", "flags", "error"),
    [
        ([], {}, "no nodes: .*missing --statefulset, --service, --replicas"),
        ([], {"statefulset": "s", "replicas": 3}, "missing --service"),
        (["a=h"], {"namespace": "ns"}, "name the nodes twice"),
        (["a=h1", "a=h2"], {}, "node name\\(s\\) a given twice"),
        (["a=h:1:2:3", "b=h:1:5:6"], {}, "several nodes at h:1"),
        (["a=h"], {"grpc_port": 0}, "--node-grpc-port 0 is not a port"),
    ],
)
def test_node_list_errors(specs: list[str], flags: dict[str, object], error: str):
    with pytest.raises(SnoozeError, match=error):
        fleet_nodes(specs, **flags)  # type: ignore[arg-type]


def test_dns_only_for_names():
    assert not needs_dns([parse_node("a=10.0.0.1"), parse_node("b=127.0.0.1")])
    assert needs_dns([parse_node("a=10.0.0.1"), parse_node("b=localhost")])


def test_the_statefulset_bootstrap_hashes_pod_names_and_resolves_pod_dns_names(tmp_path: Path):
    """Ring positions come from the pod names, so a rescheduled pod (new IP, same name) keeps its models."""
    nodes = statefulset_nodes("snooze-node", "snooze-nodes", 3, namespace="ml")
    bootstrap = render_fleet_bootstrap(nodes, host="0.0.0.0", http_port=8000, grpc_port=8001, dns=True)
    assert bootstrap.count("type: STRICT_DNS") == 2 and "use_hostname_for_hashing: true" in bootstrap
    for n in nodes:
        assert bootstrap.count(f'hostname: "{n.name}"') == 2  # the HTTP and the gRPC cluster
        assert bootstrap.count(f'address: "{n.host}"') == 2
    EnvoyProcess(bootstrap, tmp_path).validate()


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ([], "no nodes"),
        (["--node", "a=h", "--statefulset", "s", "--service", "svc", "--replicas", "2"], "name the nodes twice"),
        (["--node", "a"], "--node 'a' is not NAME=HOST"),
        (["--statefulset", "s", "--service", "svc", "--replicas", "0"], "at least one node"),
    ],
)
def test_the_gateway_command_refuses_bad_node_flags(args: list[str], error: str):
    result = CliRunner().invoke(app, ["fleet", "gateway", *args, "--no-auth"])
    assert result.exit_code == 1
    assert "error:" in result.output and error in result.output and "fix:" in result.output
