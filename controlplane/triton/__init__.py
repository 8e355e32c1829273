"""Triton process management (embedded launcher) and the async admin client."""

from controlplane.triton.client import (
    ModelStats,
    RepositoryEntry,
    TritonAdminClient,
    parse_pending_request_counts,
)
from controlplane.triton.embedded_dist import (
    EmbeddedTritonDist,
    detect_backends,
    find_embedded_triton,
    prepare_backend_dir,
)
from controlplane.triton.launcher import EmbeddedTriton, free_port

__all__ = [
    "EmbeddedTriton",
    "EmbeddedTritonDist",
    "ModelStats",
    "RepositoryEntry",
    "TritonAdminClient",
    "detect_backends",
    "find_embedded_triton",
    "free_port",
    "parse_pending_request_counts",
    "prepare_backend_dir",
]
