"""Section native: the torch custom model against its ONNX export, load time and memory (bench/native.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.markdown import json_block
from bench.registry import Data, Rendering, RunContext, Section, register


async def run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import native

    return await native.run(root, **params)


def markdown(nat: Data, rendering: Rendering) -> list[str]:
    return ["## Native (ONNX export) vs custom torch", "", "```", json_block(nat), "```", ""]


register(
    Section(
        name="native",
        order=150,
        about="torch custom vs its ONNX export",
        params={"seconds": 5.0, "repeats": 5},
        quick={"seconds": 0.5, "repeats": 1},
        run=run,
        markdown=markdown,
        default=False,
    )
)
