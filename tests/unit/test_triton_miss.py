"""Triton's answer for a model or version it does not serve now (controlplane.triton.miss): its whole message, not
the status, since a model's own NOT_FOUND or UNAVAILABLE has run and must not be re-sent.

The messages are Triton 2.51's, measured against the wheel's tritonserver (see the module's docstring); the
gateway tests (tests/integration/gateway) send a model's own 404 and 503 through real Envoy and Triton.
"""

from __future__ import annotations

import json
import re

import pytest

from controlplane.triton.miss import LUA_HTTP_BODY_PATTERNS, is_miss_http_body, is_miss_message

TRITON_MESSAGES = [
    "Request for unknown model: 'nope' is not found",
    "Request for unknown model: 'v' has no available versions",
    "Request for unknown model: 'v' version 1 is not at ready state",
    "Request for unknown model: 'my-net.v2_x' version 12 is not found",
]
LOOKALIKES = [
    "my backend is busy",  # a Triton python model's own TritonError(UNAVAILABLE)
    "feature 'x' is not found",
    "Request for unknown model: 'v' version 1 is not at ready state yet",
    "Request for unknown model: '' is not found",
    "Request for unknown model: 'a b' is not found",
    "Request for unknown model: 'v' version x is not found",
    "upstream: Request for unknown model: 'v' is not found",
    "Request for unknown model: 'v' is not found.",
]


def _body(message: str) -> bytes:
    return json.dumps({"error": message}, separators=(",", ":")).encode()


@pytest.mark.parametrize("message", TRITON_MESSAGES)
def test_tritons_answers_are_misses(message: str) -> None:
    assert is_miss_message(message)
    assert is_miss_http_body(_body(message))


@pytest.mark.parametrize("message", LOOKALIKES)
def test_other_messages_are_not(message: str) -> None:
    assert not is_miss_message(message)
    assert not is_miss_http_body(_body(message))


def test_only_the_whole_http_body_counts() -> None:
    body = _body(TRITON_MESSAGES[0])
    assert not is_miss_http_body(body[:-1]) and not is_miss_http_body(b" " + body)


def _lua_as_regex(pattern: str) -> str:
    pattern = pattern.replace("[%w_%.%-]+", "[A-Za-z0-9_.\\-]+").replace("%d+", "[0-9]+")
    return re.sub(r"%(.)", lambda m: re.escape(m.group(1)), pattern)


def test_lua_patterns_match_what_the_python_regex_matches() -> None:
    """Each Lua pattern is one alternative of the HTTP regex spelt for Lua; together they match the same bodies."""
    for message in TRITON_MESSAGES + LOOKALIKES:
        body = _body(message).decode()
        lua = [bool(re.search(_lua_as_regex(p), body)) for p in LUA_HTTP_BODY_PATTERNS]
        assert any(lua) == is_miss_http_body(body.encode()), body
        assert sum(lua) <= 1, body
