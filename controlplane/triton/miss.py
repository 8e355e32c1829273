"""Triton's answer to a request for a model, or a version of one, that it does not serve at that moment.

Measured against the wheel's tritonserver 2.51 in explicit model-control mode, over HTTP and gRPC:
- a model never loaded, or unloaded: NOT_FOUND (HTTP 404), ``Request for unknown model: '<model>' is not found``
  or ``... '<model>' has no available versions``;
- a version asked for by number that Triton never loaded: NOT_FOUND, ``... '<model>' version <v> is not found``;
- a version asked for by number that was loaded and unloaded since: UNAVAILABLE (HTTP 503),
  ``... '<model>' version <v> is not at ready state`` (core's ``ModelLifeCycle::GetModel``).
HTTP's body is ``{"error":"<message>"}``; gRPC carries the message as the status's details.

None of these ran the request, so the gateway re-sends it to the activator, which wakes the model. The status
alone does not tell: a model's own error may carry the same one (a Triton python model's ``TritonError`` with
``NOT_FOUND`` or ``UNAVAILABLE``, after it ran), and re-sending that would run the request twice. Only Triton's
whole message counts: the Envoy retry policy (gRPC, ``GRPC_MESSAGE_REGEXES``), the Lua filter that marks HTTP
answers (``LUA_HTTP_BODY_PATTERNS``) and the tests read it from here.
"""

from __future__ import annotations

import re

from controlplane.triton.dead_stub import lua_literal, regex_literal

HEAD = "Request for unknown model: '"
# What follows the model's name; VERSION stands for a version number.
VERSION = "<v>"
TAILS = (
    "' is not found",
    "' has no available versions",
    f"' version {VERSION} is not found",
    f"' version {VERSION} is not at ready state",
)
_MODEL = r"[A-Za-z0-9_.\-]+"  # controlplane.spec.MODEL_ID_PATTERN's characters
_LUA_MODEL = "[%w_%.%-]+"


def _regex_tail(tail: str) -> str:
    return "[0-9]+".join(regex_literal(part) for part in tail.split(VERSION))


def _lua_tail(tail: str) -> str:
    return "%d+".join(lua_literal(part) for part in tail.split(VERSION))


# The whole message, one regex per tail (Envoy's ``safe_regex`` header match, like ``fullmatch``, must match the whole
# value; and Envoy refuses an RE2 program over 100, which one regex of all four tails is).
GRPC_MESSAGE_REGEXES = tuple(regex_literal(HEAD) + _MODEL + _regex_tail(tail) for tail in TAILS)
_HTTP_HEAD, _HTTP_TAIL = '{"error":"', '"}'
_ANY = "(?:" + "|".join(GRPC_MESSAGE_REGEXES) + ")"
_MESSAGE = re.compile(_ANY)
_HTTP_BODY = re.compile(regex_literal(_HTTP_HEAD) + _ANY + regex_literal(_HTTP_TAIL))
# The whole HTTP body, one Lua pattern per tail (Lua patterns have no alternation).
LUA_HTTP_BODY_PATTERNS = tuple(
    "^" + lua_literal(_HTTP_HEAD + HEAD) + _LUA_MODEL + _lua_tail(tail) + lua_literal(_HTTP_TAIL) + "$"
    for tail in TAILS
)


def is_miss_message(message: str) -> bool:
    """True for Triton's whole message for a model or version it does not serve now, nothing else."""
    return _MESSAGE.fullmatch(message) is not None


def is_miss_http_body(body: bytes | memoryview) -> bool:
    """True for Triton's HTTP error body carrying such a message, nothing else."""
    return _HTTP_BODY.fullmatch(str(body, "utf-8", "replace")) is not None
