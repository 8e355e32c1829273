"""Triton's answer to a request for a model instance whose python-backend stub process is dead.

Triton 2.51 (python_backend r24.10, ``src/python_be.cc``: ``ModelInstanceState::ProcessRequests``
checks ``IsStubProcessAlive()`` first) fails such a request with INTERNAL and the message
``Stub process '<instance>' is not healthy.``, where ``<instance>`` is Triton's instance name
(``<model>_<group>_<n>``). The wheel's ``libtriton_python.so`` holds the two halves of that string.
Measured here: the request that was running when the process died, one queued behind it and every
later one get exactly that message; HTTP answers 500 with the body
``{"error":"Stub process 'm_0_0' is not healthy."}``, gRPC INTERNAL with it as grpc-message.

This module is the one definition of that signature. The gateway retries such an answer to the
activator, which recovers the model: the Envoy retry policy (gRPC, ``GRPC_MESSAGE_REGEX``), the Lua
filter that marks HTTP answers (``LUA_HTTP_BODY_PATTERN``) and the activator (``is_dead_stub_message``,
``is_dead_stub_http_body``) all read it from here. Only Triton's whole message counts: a model's own
error never has that shape, because the runtime starts every error it answers with
``[snooze:<kind>] model '<id>':`` (``python_backend/errors.py``).
"""

from __future__ import annotations

import re

MESSAGE_HEAD = "Stub process '"
MESSAGE_TAIL = "' is not healthy."
# Triton's instance names are built from the model id (controlplane.spec.MODEL_ID_PATTERN) and numbers.
_INSTANCE = r"[A-Za-z0-9_.\-]+"
_REGEX_SPECIAL = set(r"\.^$|?*+()[]{}")


def regex_literal(text: str) -> str:
    """``text`` as a regex matching itself, in the syntax RE2 (Envoy) and Python's ``re`` share."""
    return "".join(f"\\{c}" if c in _REGEX_SPECIAL else c for c in text)


# The whole message. Envoy's ``safe_regex`` header match must match the whole value; so must fullmatch.
GRPC_MESSAGE_REGEX = regex_literal(MESSAGE_HEAD) + _INSTANCE + regex_literal(MESSAGE_TAIL)
# Triton's HTTP error body: the KServe v2 shape, no spaces (the instance name needs no JSON escape).
_HTTP_HEAD, _HTTP_TAIL = '{"error":"', '"}'
_MESSAGE = re.compile(GRPC_MESSAGE_REGEX)
_HTTP_BODY = re.compile(regex_literal(_HTTP_HEAD) + GRPC_MESSAGE_REGEX + regex_literal(_HTTP_TAIL))


def lua_literal(text: str) -> str:
    """``text`` as a Lua pattern matching itself: ``%`` before every character that is not a letter or digit."""
    return "".join(c if c.isascii() and c.isalnum() else f"%{c}" for c in text)


# The whole HTTP body, as a Lua pattern (for ``string.find``); ``[%w_%.%-]`` is ``_INSTANCE``.
LUA_HTTP_BODY_PATTERN = (
    "^" + lua_literal(_HTTP_HEAD + MESSAGE_HEAD) + "[%w_%.%-]+" + lua_literal(MESSAGE_TAIL + _HTTP_TAIL) + "$"
)


def is_dead_stub_message(message: str) -> bool:
    """True for Triton's whole dead-stub message (a gRPC status's details), nothing else."""
    return _MESSAGE.fullmatch(message) is not None


def is_dead_stub_http_body(body: bytes | memoryview) -> bool:
    """True for Triton's HTTP error body carrying the dead-stub message, nothing else."""
    # str() decodes any buffer: Starlette types a Response's body as bytes or memoryview.
    return _HTTP_BODY.fullmatch(str(body, "utf-8", "replace")) is not None
