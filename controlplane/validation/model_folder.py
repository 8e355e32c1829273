"""The model folder a static check looks at: its paths, what the checks learned of it, and its results."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controlplane.validation.report import Recorder


@dataclass
class ModelFolder:
    repo: Path
    path: Path
    rec: Recorder
    config: Any = None  # model_config_pb2.ModelConfig once parsed
    backend: str | None = None
    model_file: str | None = None
    versions: list[Path] = field(default_factory=list)
    probes: Any = None  # the ProbePool that imports packages in child processes

    @property
    def name(self) -> str:
        return self.path.name

    def rel(self, path: Path) -> str:
        try:
            return path.relative_to(self.repo).as_posix()
        except ValueError:
            return str(path)

    @property
    def batching(self) -> bool:
        return self.config is not None and self.config.max_batch_size > 0
