"""The named choices of snoozeml's settings and manifests, each an enum defined once.

``StrEnum``: a member is its value (``Worker.PREFORKED == "preforked"``, ``str()`` and JSON give
"preforked"), so TOML, JSON, environment variables and the API carry the same words as before, and
pydantic validates them and lists them in its schema.
"""

from __future__ import annotations

from enum import StrEnum


class Worker(StrEnum):
    """Where a custom model's code runs (``DeploymentSpec.worker``)."""

    IN_STUB = "in-stub"  # in its python-backend stub process
    PREFORKED = "preforked"  # in a worker forked from a parent that imported its preload modules


class KeepAliveMode(StrEnum):
    """How long a model stays loaded after a request (``DeploymentSpec.keep_alive``)."""

    FIXED = "fixed"  # idle_timeout_secs
    ADAPTIVE = "adaptive"  # learned from the model's own idle times (keepalive.py)


class EvictionMode(StrEnum):
    """Which idle model leaves memory first (``SNOOZE_EVICTION_POLICY``)."""

    LRU = "lru"  # least recently used
    GDSF = "gdsf"  # GreedyDual-Size-Frequency (the default)


class TargetName(StrEnum):
    """Which backends the serving Triton has (``SNOOZE_TARGET``, ``snoozectl validate --target``)."""

    EMBEDDED = "embedded"  # the nvidia-pytriton wheel: python backend only
    FULL = "full"  # the official image: python, onnxruntime, tensorrt


class AuthMode(StrEnum):
    ON = "on"
    OFF = "off"  # no API keys (local use only)


class TensorFormat(StrEnum):
    """How a custom model's predict receives tensors (manifest ``tensor_format``)."""

    NUMPY = "numpy"
    RAW = "raw"  # bytes and shapes, no numpy conversion


class SequenceStrategy(StrEnum):
    """Triton's sequence batcher strategy (manifest ``sequence.strategy``)."""

    DIRECT = "direct"  # a batch slot per sequence
    OLDEST = "oldest"  # dynamic batching of the oldest sequences
