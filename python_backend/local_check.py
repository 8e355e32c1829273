"""`snoozectl check` runs this in a child process: load the model the way a Triton instance does
(same spec, env, class import and batch validation), run one predict, and write the outputs.

Usage: python -m python_backend.local_check SPEC_JSON PACKAGE_DIR INPUTS_NPZ DEVICE OUT_NPZ
Exit 0 with OUT_NPZ written, or 1 with the model's own traceback on stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback

import numpy as np

from .batching import run_batch
from .errors import Failure
from .runners import build_model
from .spec import load_spec

RETURNED_KEY = "__snooze_returned_dtypes__"  # in OUT_NPZ: JSON {output: dtype predict returned}


def main(argv: list[str]) -> int:
    spec_path, package_dir, inputs_path, device, out_path = argv
    # A one-off check runs the model here, never in a preforked worker (no Triton, no parent to share).
    spec = load_spec(spec_path)
    os.environ.update(spec.env)
    with np.load(inputs_path, allow_pickle=True) as data:
        inputs = {name: data[name] for name in data.files}
    # The model's own prints must not mix with anything this process reports.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            model = build_model(spec, package_dir)
            model.load(package_dir, device)
        except Exception:
            print(f"model '{spec.model_id}' failed to load on '{device}':", file=sys.stderr)
            traceback.print_exc()
            return 1
        returned: dict[str, str] = {}  # what predict itself gave, before the runtime conformed it

        def predict(batch):
            outputs = model.predict(batch)
            if isinstance(outputs, dict):
                returned.update({str(k): str(np.asarray(v).dtype) for k, v in outputs.items()})
            return outputs

        (result,) = run_batch(spec, [inputs], predict)
        if hasattr(model, "unload"):
            model.unload()
    if isinstance(result, Failure):
        print(result.message, file=sys.stderr)
        return 1
    np.savez(out_path, **result, **{RETURNED_KEY: np.array(json.dumps(returned))})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
