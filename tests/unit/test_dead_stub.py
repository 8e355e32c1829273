"""The one dead-stub signature (controlplane.triton.dead_stub): Triton's whole message, nothing a model says.

What Triton 2.51 writes was measured against the wheel's tritonserver (see the module's docstring);
the gateway tests (tests/integration/gateway) check the same through real Envoy and Triton.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from controlplane.gateway.envoy import Upstream, render_bootstrap
from controlplane.gateway.envoy_process import EnvoyProcess
from controlplane.gateway.lua import lua_string
from controlplane.triton.dead_stub import (
    GRPC_MESSAGE_REGEX,
    LUA_HTTP_BODY_PATTERN,
    is_dead_stub_http_body,
    is_dead_stub_message,
)
from controlplane.triton.miss import GRPC_MESSAGE_REGEXES as MISS_REGEXES
from controlplane.triton.miss import LUA_HTTP_BODY_PATTERNS as MISS_LUA_PATTERNS
from python_backend.errors import describe_failure

# As Triton 2.51 wrote them here (HTTP body bytes, gRPC details).
TRITON_MESSAGES = ["Stub process 'm_0_0' is not healthy.", "Stub process 'my-net.v2_0_1' is not healthy."]
LOOKALIKES = [
    "feature store is not healthy",
    "Stub process 'x' said the feature store is not healthy.",  # the former gRPC pattern took this one
    "Stub process is not healthy.",
    "Stub process '' is not healthy.",
    "Stub process 'm_0_0' is not healthy",
    "Stub process 'm_0_0' is not healthy. Retry later",
    "upstream: Stub process 'm_0_0' is not healthy.",
    "Stub process 'a' b' is not healthy.",
    "cache not ready",
]


@pytest.mark.parametrize("message", TRITON_MESSAGES)
def test_tritons_answer_is_a_dead_stub(message: str):
    assert is_dead_stub_message(message)
    assert is_dead_stub_http_body(json.dumps({"error": message}, separators=(",", ":")).encode())


@pytest.mark.parametrize("message", LOOKALIKES)
def test_other_messages_are_not(message: str):
    assert not is_dead_stub_message(message)
    assert not is_dead_stub_http_body(json.dumps({"error": message}, separators=(",", ":")).encode())


def test_only_the_whole_http_body_counts():
    body = b'{"error":"Stub process \'m_0_0\' is not healthy."}'
    assert is_dead_stub_http_body(body)
    assert not is_dead_stub_http_body(body[:-1]) and not is_dead_stub_http_body(b" " + body)
    assert not is_dead_stub_http_body(b'{"error":"Stub process \'m_0_0\' is not healthy.","x":1}')


@pytest.mark.parametrize("message", TRITON_MESSAGES + LOOKALIKES)
def test_a_models_error_never_takes_the_shape(message: str):
    """The runtime frames every error a model raises: even Triton's exact words come back prefixed."""
    for stage in ("predict", "load", "predict output"):
        _, framed = describe_failure(RuntimeError(message), "m", stage, 1)
        assert framed.startswith("[snooze:internal] model 'm': ") and message in framed
        assert not is_dead_stub_message(framed)
        assert not is_dead_stub_http_body(json.dumps({"error": framed}, separators=(",", ":")).encode())


def test_lua_pattern_matches_what_the_python_regex_matches():
    """The Lua pattern is the HTTP regex spelt for Lua: same literal parts, same instance characters."""
    lua_as_regex = LUA_HTTP_BODY_PATTERN.replace("[%w_%.%-]+", "[A-Za-z0-9_.\\-]+")
    lua_as_regex = re.sub(r"%(.)", lambda m: re.escape(m.group(1)), lua_as_regex)
    for message in TRITON_MESSAGES + LOOKALIKES:
        body = json.dumps({"error": message}, separators=(",", ":"))
        assert bool(re.search(lua_as_regex, body)) == is_dead_stub_http_body(body.encode()), body


def _retriable_headers(node: object) -> list[dict]:
    if isinstance(node, dict):
        found = list(node.get("retriable_headers", []))
        return found + [h for v in node.values() for h in _retriable_headers(v)]
    if isinstance(node, list):
        return [h for v in node for h in _retriable_headers(v)]
    return []


def _strings(node: object) -> list[str]:
    if isinstance(node, dict):
        return [s for v in node.values() for s in _strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in _strings(v)]
    return [node] if isinstance(node, str) else []


def test_envoy_takes_the_signature(tmp_path: Path):
    """The rendered bootstrap carries the regex (RE2) and the Lua pattern, and Envoy accepts both."""
    bootstrap = render_bootstrap(
        host="127.0.0.1", http_port=1, grpc_port=2, admin_port=0, wake_buffer_bytes=1024,
        triton_http=Upstream("127.0.0.1", 3), triton_grpc=Upstream("127.0.0.1", 4),
        activator_http=Upstream("127.0.0.1", 5), activator_grpc=Upstream("127.0.0.1", 6),
    )  # fmt: skip
    regexes = [
        h["string_match"]["safe_regex"]["regex"]
        for h in _retriable_headers(yaml.safe_load(bootstrap))
        if h["name"] == "grpc-message"
    ]
    assert regexes and set(regexes) == {GRPC_MESSAGE_REGEX, *MISS_REGEXES}  # each ModelInfer route (small body, large)
    texts = _strings(yaml.safe_load(bootstrap))
    for pattern in (LUA_HTTP_BODY_PATTERN, *MISS_LUA_PATTERNS):
        assert sum(lua_string(pattern) in text for text in texts) == 1, pattern
    EnvoyProcess(bootstrap, tmp_path).validate()
