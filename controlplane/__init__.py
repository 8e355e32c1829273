"""snoozeml control plane: renders model repositories, drives Triton, wakes and evicts models."""

import os as _os

# The control plane forks children (tritonserver, Envoy, converters) from a process with gRPC threads;
# gRPC's fork handlers then abort a child now and then (seen: Envoy exiting with -6 at start). Every
# child execs at once, so they are not needed. Must be set before grpc is imported.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
