"""File names of a model package that both the converters and the control plane write or read (the
control plane imports them from here: converters never import controlplane). Standard library only."""

from __future__ import annotations

ONNX_FILE = "model.onnx"
PLAN_FILE = "model.plan"
PYTHON_MODEL_FILE = "model.py"  # the python backend's entry point in a version folder, written by render
