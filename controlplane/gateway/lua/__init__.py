"""The gateway's Lua programs, one ``<name>.lua`` file each, filled in by ``program``.

A file starts with a header of ``--#`` lines naming its parameters (dropped from the program). Each
``{{ name }}`` is replaced by the value given for ``name``, verbatim: callers pass Lua text (a number, a
long-bracket string from ``lua_string``, or a constant that needs no quoting inside the file's quotes).
A line ``--#include <file>.lua`` is replaced by that file (shared pieces: the hold call, the protobuf walk).
"""

from __future__ import annotations

import re
from importlib import resources

_PLACEHOLDER = re.compile(r"\{\{ (\w+) \}\}")
_INCLUDE = re.compile(r"^--#include (\S+)\n", re.M)


def _source(name: str) -> str:
    text = resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
    text = _INCLUDE.sub(lambda m: _source(m.group(1)), text)
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("--# "))


def lua_string(text: str) -> str:
    """A Lua long-bracket string literal of ``text``: no escapes inside, it reads as written."""
    level = 1
    while f"]{'=' * level}]" in text:
        level += 1
    return f"[{'=' * level}[{text}]{'=' * level}]"


def program(name: str, **params: object) -> str:
    """The Lua program ``<name>.lua`` with its parameters filled in; every placeholder must be given, and
    every parameter given must be used (a misspelt name fails here rather than in Envoy)."""
    source = _source(f"{name}.lua")
    used = set(_PLACEHOLDER.findall(source))
    if missing := used - params.keys():
        raise KeyError(f"{name}.lua needs {sorted(missing)}")
    if unused := params.keys() - used:
        raise KeyError(f"{name}.lua has no {sorted(unused)}")
    return _PLACEHOLDER.sub(lambda m: str(params[m.group(1)]), source)
