"""Ensembles and their steps, as one group in the lifecycle.

An ensemble (``platform: "ensemble"``) is a model of models: Triton runs each request through its steps (other
models, by name), inside Triton, where the gateway never sees that traffic. Triton's own statistics do, so a step
that an ensemble uses is "in use" by the usual reading of its ``last_inference``. On top of that:

- a wake of the ensemble wakes its steps first (``RequestPath.ensure_ready``), each once (its own single flight);
- from the moment the ensemble starts loading until it has left memory, each step is pinned (held as a user,
  ``ModelRecord.in_use``): neither idle-unloaded nor evicted on its own, whatever its own timer says;
- a step shared by two ensembles, or also called directly, is one model: loaded once, charged once;
- the eviction policy weighs the ensemble as the group it is: its size is what its steps hold that no other
  loaded ensemble pins, and evicting it unloads those steps too (``Unloads.evict``).

An ensemble holds no process of its own: it is charged nothing itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from controlplane.errors import SnoozeError
from controlplane.lifecycle.state import ModelRecord, ModelState, ModelStates
from controlplane.spec.schema import PackageKind
from controlplane.store import PublishedModel

log = logging.getLogger("snoozeml.lifecycle")
T = TypeVar("T")


class StepsChanged(Exception):
    """A model was republished with other ensemble steps (or became or stopped being an ensemble) while it waited to
    load: ``Groups.steps_first`` wakes the new steps first."""


# The states in which an ensemble holds its steps: from the start of its load until it has left memory.
_HOLDING = (ModelState.LOADING, ModelState.READY, ModelState.UNLOADING)


def ensemble_steps(model: PublishedModel) -> tuple[str, ...]:
    """The models an ensemble's steps name, in order, each once (as publishing read them from its config's
    ``ensemble_scheduling``); () for a model that is no ensemble."""
    if model.kind != PackageKind.TRITON_ENSEMBLE:
        return ()
    return tuple(dict.fromkeys(name for name, _version in model.ensemble_steps))


class Groups:
    """Which steps each ensemble uses, and the pins a loaded ensemble holds on them."""

    def __init__(self, states: ModelStates) -> None:
        self.states = states
        self._steps: dict[tuple[str, str], tuple[str, ...]] = {}  # (model, publish token) -> its steps
        self.pins: dict[str, tuple[str, ...]] = {}  # ensemble -> the steps it holds now
        states.listeners.append(self._on_state)

    def steps(self, rec: ModelRecord) -> tuple[str, ...]:
        """The ensemble's steps (() for any other model); read once per publish."""
        key = (rec.id, rec.model.publish)
        if key not in self._steps:
            self._steps[key] = ensemble_steps(rec.model)
        return self._steps[key]

    def is_ensemble(self, rec: ModelRecord) -> bool:
        return bool(self.steps(rec))

    def users(self) -> dict[str, list[str]]:
        """Each model some ensemble's steps name -> those ensembles (for status), loaded or not: the ensembles the
        store's catalog holds (kept by kind) and those recorded as one (another node's, before a scan), not a pass
        over every record (57 ms a listing at 50,000 models); each read once per publish (cached), as its record
        has it."""
        users: dict[str, list[str]] = {}
        catalog = self.states.store.ids_of_kind(PackageKind.TRITON_ENSEMBLE)
        for ensemble in sorted(self.states.ensembles.union(catalog)):
            rec = self.states.get(ensemble)
            if rec is None or rec.model.kind is not PackageKind.TRITON_ENSEMBLE:
                continue
            for step in self.steps(rec):
                users.setdefault(step, []).append(rec.id)
        return {step: sorted(ensembles) for step, ensembles in users.items()}

    def group_bytes(self, rec: ModelRecord, held: dict[str, int]) -> int:
        """What evicting the ensemble ``rec`` frees besides itself: what its steps hold (``held``: bytes per model)
        that no other ensemble pins and no one else uses."""
        return sum(held.get(step, 0) for step in self.exclusive_steps(rec))

    def exclusive_steps(self, rec: ModelRecord) -> list[str]:
        """The steps ``rec`` pins that nothing else holds: no other ensemble's pin, no other user."""
        mine = self.pins.get(rec.id, ())
        others = {s for e, steps in self.pins.items() if e != rec.id for s in steps}
        exclusive = []
        for step in mine:
            step_rec = self.states.get(step)
            if step_rec is not None and step not in others and step_rec.in_use <= mine.count(step):
                exclusive.append(step)
        return exclusive

    async def steps_first(
        self,
        rec: ModelRecord,
        wake: Callable[[str], Awaitable[object]],
        then: Callable[[tuple[str, ...]], Awaitable[T]],
    ) -> T:
        """``then(steps)`` once ``rec``'s ensemble steps are woken (``wake`` each, side by side; () for any other
        model), the steps held from before their wake until ``then`` returns (the ensemble's pin holds them from its
        load on). A republish that gives it other steps meanwhile (they differ once woken, or ``then`` raises
        ``StepsChanged``) starts over with those."""
        while True:
            steps = self.steps(rec)
            with self.holding(steps):
                if steps:
                    await asyncio.gather(*(wake(step) for step in steps))
                if self.steps(rec) != steps:
                    continue
                try:
                    return await then(steps)
                except StepsChanged:
                    continue

    def still_woken(self, rec: ModelRecord, steps: tuple[str, ...]) -> None:
        """Before the ensemble's own load starts: ``StepsChanged`` (``steps_first`` wakes them again) when a republish
        gave it other steps, or a step woken for it is no longer READY (a delete, an API unload or a republish took
        it out since: the hold keeps only idleness and eviction away). Triton would load the ensemble over a step on
        its way out, and take it down with the step behind the records (SNOOZE_MACHINE_SEED=1418949119)."""
        if self.steps(rec) != steps:
            raise StepsChanged
        for step in steps:
            step_rec = self.states.get(step)
            if step_rec is None or step_rec.state is not ModelState.READY:
                raise StepsChanged

    @contextlib.contextmanager
    def holding(self, steps: tuple[str, ...]) -> Iterator[None]:
        """Hold ``steps`` as users while the block runs: an ensemble's wake holds its steps from before it wakes
        them until its own load pins them (a step woken first would otherwise sit idle, unpinned, while the others
        load, and be idle-unloaded under the ensemble's load: Triton then loads it itself, behind the lifecycle)."""
        held = []
        for step in steps:
            try:
                step_rec = self.states.record(step)
            except SnoozeError:  # a step that is not published fails its own wake, saying so
                continue
            step_rec.in_use += 1
            held.append(step_rec)
        try:
            yield
        finally:
            for step_rec in held:
                step_rec.in_use -= 1

    def _on_state(self, model_id: str, state: ModelState | None) -> None:
        """Told every state change, synchronously: an ensemble pins its steps while it holds them."""
        rec = self.states.get(model_id)
        holding = rec is not None and state in _HOLDING
        steps = self.steps(rec) if rec is not None and holding else ()
        if self.pins.get(model_id, ()) == steps:
            return
        self._release(model_id)
        held = []
        for step in steps:
            try:
                held.append(self.states.record(step))
            except SnoozeError:  # a step that is not published: Triton fails the ensemble's load, saying so
                log.warning("model '%s': its ensemble step '%s' is not published", model_id, step)
        for step_rec in held:
            step_rec.in_use += 1
        if held:
            self.pins[model_id] = tuple(r.id for r in held)

    def _release(self, model_id: str) -> None:
        for step in self.pins.pop(model_id, ()):
            step_rec = self.states.get(step)
            if step_rec is not None:
                step_rec.in_use -= 1
