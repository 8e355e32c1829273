"""How a model process ended, in words: one description for the runtime and the control plane.

The stub's notes about a preforked worker (preforked.py) and the control plane's crash reports
(controlplane/triton/processes.py) both describe wait statuses with ``describe_wait_status``; the
watchdog (runners.PredictWatchdog, triton_model.py) ends an overrunning stub with
``OVERRUN_EXIT_CODE``. Standard library only: the control plane imports this module.
"""

from __future__ import annotations

import contextlib
import os
import signal

# The exit status of a stub process the watchdog ended after a predict overran request_timeout_secs.
OVERRUN_EXIT_CODE = 124


def describe_wait_status(status: int | None) -> str:
    """A wait status in words: 'exit code 3', 'killed by signal 11 (SIGSEGV)', or unknown; the watchdog's
    own exit code says why."""
    if status is None:
        return "exit status unknown"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(ValueError):
            return f"killed by signal {sig} ({signal.Signals(sig).name})"
        return f"killed by signal {sig}"
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        if code == OVERRUN_EXIT_CODE:  # the watchdog ended it: not a crash of the model's code
            return f"exit code {code}: predict overran request_timeout_secs and the runtime ended the process"
        return f"exit code {code}"
    return f"wait status {status}"
