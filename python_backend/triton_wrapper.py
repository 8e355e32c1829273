"""A Triton python model run as written, inside snoozeml's lifecycle.

A Triton model folder's ``<version>/model.py`` (a ``TritonPythonModel`` written for Triton's python backend) is
moved, unchanged, to ``<version>/triton_user_model.py``; the rendered ``model.py``
(model_repository_templates/triton_python_model.py.j2) defines the class the stub runs, made here. It imports the
user's module in ``initialize`` (as ``<version>.triton_user_model``, beside its sibling files) and hands every
call to the user's object, adding only what the lifecycle relies on:

- phase notes (``journal.note_phase``): the import and the user's ``initialize`` are noted before they run, so a
  cancelled or timed-out load knows the stub reached the model (only then is it killed) and where it hung;
- the request journal: the ids of each batch before ``execute`` runs it (a request is never run twice after a
  crash), the batch's end once ``execute`` (or the coroutine it returned) is done, and its close at ``finalize``;
- a stateful model's live sequences (``sequences.SequenceNote``), so that no idle unload ends one;
- ``finalize`` bounded in time: Triton waits for it without a limit, so one that hangs would block the unload.

Anything else the stub looks for (``is_ready``) is the user's object's. Standard library only at import time,
Python 3.10 syntax, no ``controlplane`` import: this module travels in ``<version>/python_backend/``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Coroutine
from typing import Any

from .journal import RequestJournal, note_phase
from .runners import call_with_limit
from .sequences import SequenceNote

# Triton waits for finalize without a limit; past this the instance goes away without it (as for unload()).
FINALIZE_TIMEOUT_SECS = 30.0
# The module that lets a BLS call wake a sleeping callee, where the runtime carries one.
BLS_WAKE_MODULE = "bls_wake"


def _log(model_id: str, message: str) -> None:
    print(f"snooze model '{model_id}': {message}", file=sys.stderr, flush=True)


def _install_bls_wake(model_id: str) -> None:
    """Let this model's BLS calls wake a sleeping callee, when the runtime has the module for it."""
    name = f"{__package__}.{BLS_WAKE_MODULE}"
    if importlib.util.find_spec(name) is None:
        return
    importlib.import_module(name).install(model_id)


class WrappedTritonModel:
    """The user's ``TritonPythonModel``, run by delegation (the subclass made by ``wrapped_model`` names its
    module)."""

    user_module = ""  # "<version>.triton_user_model", as the stub imported "<version>.model"
    # Until initialize sets them (a finalize after a failed initialize finds these).
    _model_id = "?"
    _journal: RequestJournal | None = None
    _sequences: SequenceNote | None = None
    _finalize: Any = None

    def initialize(self, args: dict[str, str]) -> Any:
        self._model_id = args.get("model_name", "?")
        note_phase("import")  # first: from here the stub runs the model's own code
        module = importlib.import_module(self.user_module)
        user_cls = getattr(module, "TritonPythonModel", None)
        if user_cls is None:
            raise RuntimeError(f"model '{self._model_id}': {module.__file__} defines no class TritonPythonModel")
        self._user = user_cls()
        _install_bls_wake(self._model_id)
        self._journal = RequestJournal.from_environment()
        finalize = getattr(self._user, "finalize", None)
        self._finalize = finalize if callable(finalize) else None
        if self._journal is not None:
            # A finalize is the model's clean-up: the process is not ended early at an eviction.
            self._journal.declare(unload=self._finalize is not None)
        self._sequences = SequenceNote.from_environment(self._model_id, json.loads(args.get("model_config") or "{}"))
        result = None
        initialize = getattr(self._user, "initialize", None)
        if callable(initialize):
            note_phase("initialize")
            result = initialize(args)
        note_phase("ready")
        return result

    def execute(self, requests: list[Any]) -> Any:
        journal = self._journal
        if self._sequences is not None:
            self._sequences.record(requests)
        if journal is None:
            return self._user.execute(requests)
        journal.record(requests)
        try:
            result = self._user.execute(requests)
        except BaseException:
            journal.batch_done()
            raise
        if inspect.iscoroutine(result):  # an async execute: the stub awaits what is returned
            return self._awaited(result, journal)
        journal.batch_done()
        return result

    @staticmethod
    async def _awaited(coroutine: Coroutine[Any, Any, Any], journal: RequestJournal) -> Any:
        try:
            return await coroutine
        finally:
            journal.batch_done()

    def finalize(self) -> None:
        try:
            if self._finalize is not None:
                call_with_limit(
                    self._finalize,
                    timeout=FINALIZE_TIMEOUT_SECS,
                    what="finalize",
                    name=f"snooze-finalize-{self._model_id}",
                )
        except Exception as e:  # the instance goes away regardless; say why it did not finalize cleanly
            _log(self._model_id, f"finalize: {type(e).__name__}: {e}")
        finally:
            if self._journal is not None:
                self._journal.close()
            if self._sequences is not None:
                self._sequences.close()

    def __getattr__(self, name: str) -> Any:
        # Hooks the stub looks up on the instance (is_ready) are the user's; before initialize there is none.
        user = self.__dict__.get("_user")
        if user is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(user, name)


def wrapped_model(package: str | None, user_module: str) -> type:
    """The class a rendered ``model.py`` gives the stub: ``user_module`` imported from ``package`` (the version
    folder's, as the stub imported ``model.py``), or on its own where the stub imported it without one."""
    name = f"{package}.{user_module}" if package else user_module
    return type("TritonPythonModel", (WrappedTritonModel,), {"user_module": name})
