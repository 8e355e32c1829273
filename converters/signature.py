"""The I/O signature a package declares (its manifest), as the converters check exported models against it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# numpy dtype names the converters accept (the numpy column of controlplane/dtypes.py).
NUMPY_DTYPES = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "object",
    }
)


@dataclass(frozen=True)
class TensorDecl:
    """A declared tensor: numpy dtype name and dims without the batch axis (-1 = variable).
    `dims=None` means the dims are not checked."""

    name: str
    dtype: str
    dims: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in NUMPY_DTYPES:
            raise ValueError(
                f"tensor '{self.name}': dtype '{self.dtype}' is not a numpy dtype name; use one of "
                f"{sorted(NUMPY_DTYPES)}"
            )


@dataclass(frozen=True)
class PackageSignature:
    inputs: Sequence[TensorDecl] = field(default_factory=tuple)
    outputs: Sequence[TensorDecl] = field(default_factory=tuple)

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]
