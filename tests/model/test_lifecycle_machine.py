"""The lifecycle as a state machine: seeded random sequences of operations against the real
``LifecycleManager`` over a fake Triton (``harness.fake_triton``), with every invariant checked after every step
(``LifecycleWorld.check``).

The seed is printed; ``SNOOZE_MACHINE_SEED=<seed>`` replays a run and ``SNOOZE_MACHINE_RUNS`` sets how many
sequences run. A failing sequence is shrunk (operations dropped while the same invariant still fails) and
printed as the calls of a test: keep it in ``test_lifecycle_sequences.py``.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from harness.lifecycle_world import ENSEMBLE, MODELS, SIZES_MB, LifecycleWorld, Violation

RUNS = int(os.environ.get("SNOOZE_MACHINE_RUNS", "70"))
STEPS_PER_RUN = 80
MIN_STEPS = 5000
SHRINK_TRIES = 400

Op = tuple[str, tuple[Any, ...], float]  # (world method, its arguments, virtual seconds after it)
GAPS = (0.0, 0.01, 0.05, 0.3, 1.0)
DOZE_AFTER_SECS = 1.0  # below the world's idle timeout (5 s): idle preforked models doze, then unload
DOZE_RUNS = int(os.environ.get("SNOOZE_MACHINE_DOZE_RUNS", "25"))


def doze_start(model: str) -> list[Op]:
    """With dozing, each run starts with every model published preforked and woken: most steps meet a loaded one."""
    return [("publish", (model, 60, 1, "preforked"), 0.05), ("request", (model, None), 0.3)]


def random_op(rnd: random.Random, paused: bool, doze: bool = False) -> Op:
    m = rnd.choice(MODELS)
    any_ = rnd.choice((*MODELS, ENSEMBLE))  # a model or the ensemble over some of them
    choices: dict[str, tuple[Any, ...]] = {
        "request": (any_, rnd.choice((None, None, 0.3, 2.0))),
        "burst": (any_, rnd.randint(2, 10)),
        "publish_ensemble_api": (tuple(rnd.sample(MODELS, rnd.choice((1, 2, 2, 3)))), rnd.choice((1, 5, 20))),
        "tick": (rnd.choice((0.1, 0.5, 1.0, 3.0, 7.0)),),
        "publish": (m, rnd.choice(SIZES_MB), rnd.choice((1, 1, 2))),
        "delete": (any_,),
        "api_load": (any_, rnd.choice((None, 1, 2, 3))),
        "api_unload": (any_,),
        "api_override": (m, rnd.choice((None, 4, 16))),
        "crash": (m,),
        "script_load": (m, rnd.choice(("oom", "hang", "error")), rnd.choice((0.05, 0.5))),
        "unload_hang": (m,),
        "stop_during_hung_load": (m, rnd.choice(("stop", "unload", "delete", "publish"))),
        "remote_publish": (m, rnd.choice(SIZES_MB)),
        "republish_while_waiting": (m, rnd.choice(("hang", "ok")), rnd.randint(1, 4)),
        "remote_delete": (m,),
        "resume" if paused else "pause": (),
        "hold": (m,),
        "release": (),
        "restart": (),
    }
    weights = {"request": 6, "burst": 2, "tick": 4, "publish": 3, "doze": 3}
    if doze:  # a doze as the sweep or an eviction asks for one, at any moment
        choices["doze"] = (m,)
    name = rnd.choices(list(choices), [weights.get(k, 1) for k in choices])[0]
    args = choices[name]
    if doze and name == "publish":  # most models preforked: they doze when idle (dozing.py)
        args = (*args, rnd.choice(("in-stub", "preforked", "preforked", "preforked")))
    return name, args, rnd.choice(GAPS)


def play(ops: list[Op], doze: bool = False) -> tuple[str | None, int]:
    """Run ``ops`` in a fresh world; the first violation (or None) and the steps taken. ``doze``: idle preforked
    models doze after DOZE_AFTER_SECS."""
    tmp = Path(tempfile.mkdtemp(prefix="snooze-machine-"))
    patches = pytest.MonkeyPatch()
    world = LifecycleWorld(tmp, monkeypatch=patches, **({"doze_after_secs": DOZE_AFTER_SECS} if doze else {}))
    try:
        for name, args, gap in ops:
            world.step(getattr(world, name)(*args), gap)
        world.close()
        return None, world.steps
    except Violation as e:
        world.abandon()
        return str(e), world.steps
    finally:
        patches.undo()
        shutil.rmtree(tmp, ignore_errors=True)


def shrink(ops: list[Op], failure: str, doze: bool = False) -> list[Op]:
    """Drop operations one at a time while the same invariant still fails."""
    kind = failure.split(":")[0].split("'")[0]
    i, tries = 0, 0
    while i < len(ops) and tries < SHRINK_TRIES:
        tries += 1
        trial = ops[:i] + ops[i + 1 :]
        found, _ = play(trial, doze)
        if found is not None and found.split(":")[0].split("'")[0] == kind:
            ops = trial
        else:
            i += 1
    return ops


def as_test(ops: list[Op]) -> str:
    return "\n".join(f"    world.step(world.{name}({', '.join(map(repr, args))}), {gap})" for name, args, gap in ops)


# Random seeds are not in the default tier yet: on some it may still find an open violation (a deleted model's
# record can outlive the delete when a remote delete meets a local one), and 5,000 steps cost 10-45 s on this
# 2-core machine. A test that passed either way would prove nothing, so they run on demand,
# `pytest -m slow tests/model/test_lifecycle_machine.py`, and fail on what they find, with a shrunk sequence. The
# default tier runs one fixed seed. Fixed from what it found (test_lifecycle_sequences.py): the budget overcommit
# after a restart (SNOOZE_MACHINE_SEED=2866959472; the world also checks that Triton's peak stays within the
# budget plus one model), orphan memory of a model deleted across a restart, a request run twice after a crash
# and a republish (the fake's), settle() spinning the event loop.
@pytest.mark.slow
def test_the_lifecycle_keeps_its_invariants_under_random_operations(capsys):
    machine(capsys, int(os.environ.get("SNOOZE_MACHINE_SEED") or random.randrange(2**32)))


# The default tier: one fixed seed's 70 sequences (5,600 steps; 10-20 s here), the same every run. They passed when
# chosen; a change to the lifecycle that breaks an invariant on their path fails here, with its shrunk sequence.
DEFAULT_SEED = 9349476


def test_the_lifecycle_keeps_its_invariants_on_a_fixed_seed(capsys):
    machine(capsys, DEFAULT_SEED)


# Dozing in every interleaving: three models in four preforked, dozing after 1 s idle; the world's invariants hold (a
# request never runs twice, the budget counts what the stubs hold, dozing or woken) and every call is answered.
DOZE_SEED = 4311


def test_the_lifecycle_keeps_its_invariants_with_dozing_models_on_a_fixed_seed(capsys):
    machine(capsys, DOZE_SEED, doze=True)


@pytest.mark.slow
def test_the_lifecycle_keeps_its_invariants_with_dozing_models_under_random_operations(capsys):
    """Fresh seeds of the dozing machine, on demand as the other random seeds (SNOOZE_MACHINE_SEED replays one)."""
    machine(capsys, int(os.environ.get("SNOOZE_MACHINE_SEED") or random.randrange(2**32)), doze=True)


def machine(capsys: pytest.CaptureFixture[str], run_seed: int, *, doze: bool = False) -> None:
    with capsys.disabled():
        print(f"\nlifecycle state machine: seed {run_seed} (SNOOZE_MACHINE_SEED={run_seed} replays it)")
    logging.getLogger("snoozeml").setLevel(logging.CRITICAL)
    rnd = random.Random(run_seed)
    steps = 0
    try:
        for run in range(DOZE_RUNS if doze else RUNS):
            ops: list[Op] = [op for m in MODELS for op in doze_start(m)] if doze else []
            paused = False
            for _ in range(STEPS_PER_RUN):
                ops.append(random_op(rnd, paused, doze))
                paused = {"pause": True, "resume": False, "restart": False}.get(ops[-1][0], paused)
            failure, taken = play(ops, doze)
            steps += taken
            if failure is not None:
                short = shrink(ops, failure, doze)
                again, _ = play(short, doze)
                pytest.fail(
                    f"seed {run_seed}, run {run}: {failure}\nshrunk to {len(short)} steps ({again}):\n{as_test(short)}"
                )
    finally:
        logging.getLogger("snoozeml").setLevel(logging.NOTSET)
        with capsys.disabled():
            print(f"lifecycle state machine: {steps} steps (seed {run_seed})")
    if not doze and RUNS * STEPS_PER_RUN >= MIN_STEPS:
        assert steps >= MIN_STEPS
