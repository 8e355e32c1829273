"""snoozeml's runtime inside Triton's python-backend stub.

This package travels with every rendered python-backend model: the renderer copies
`runtime_files()` into `<repo>/<model>/<version>/python_backend/` and renders
model_repository_templates/python_model.py.j2 to `<repo>/<model>/<version>/model.py`, which
re-exports `python_backend.triton_model.TritonPythonModel`. Standard library + numpy only at import
time, Python 3.10 syntax, and no `controlplane` import (see docs/internals.md).
"""

from __future__ import annotations

import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

# The modules a model folder needs, listed rather than globbed so that stray files (tests, caches,
# editor backups) never travel into model repositories.
RUNTIME_MODULES = (
    "__init__.py",
    "batching.py",
    "bls_wake.py",
    "doze.py",
    "errors.py",
    "exits.py",
    "import_probe.py",
    "journal.py",
    "prefork_connect.py",
    "prefork_parent.py",
    "prefork_preload.py",
    "prefork_protocol.py",
    "prefork_worker.py",
    "preforked.py",
    "runners.py",
    "sequences.py",
    "spec.py",
    "strings.py",
    "triton_model.py",
    "triton_wrapper.py",
    "warmup.py",
)


def runtime_files() -> list[str]:
    """Absolute paths of the files to copy into `<model>/<version>/python_backend/`, flat."""
    return [os.path.join(PACKAGE_DIR, name) for name in RUNTIME_MODULES]
