"""Sample tensors for a signature: the one generator behind `snoozectl check`, `snoozectl validate --load`'s
inference and the parity check of an export. Numpy names only (no Triton here): callers map their types.

Values, per numpy dtype: floating types (float16/32/64 and bfloat16, through ``ml_dtypes``, which onnx
depends on) are standard normal draws rounded to the type; integers are uniform in ``[low, high)``
(default ``[0, 10)``: small enough to be valid indices of most embeddings); bools are fair coin flips;
strings (``object``) are short random words as bytes. Seeded: the same ``rng`` state gives the same arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

FLOAT_DTYPES = ("float16", "float32", "float64", "bfloat16")
INT_RANGE = (0, 10)


def numpy_dtype(name: str) -> Any:
    """The numpy dtype of a numpy name, bfloat16 included (an ``ml_dtypes`` type)."""
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def sample_array(
    dtype: str, shape: Sequence[int], rng: np.random.Generator, *, int_range: tuple[int, int] = INT_RANGE
) -> np.ndarray:
    """One array of numpy dtype name ``dtype`` (``object`` for strings) and ``shape``."""
    shape = tuple(int(d) for d in shape)
    if dtype == "object":
        words = rng.integers(0, 1000, size=shape)
        return np.vectorize(lambda n: f"w{n}".encode(), otypes=[object])(words).astype(object)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype in FLOAT_DTYPES:
        return rng.standard_normal(size=shape).astype(np.float32).astype(numpy_dtype(dtype))
    low, high = int_range
    return rng.integers(low, max(high, low + 1), size=shape).astype(dtype)
