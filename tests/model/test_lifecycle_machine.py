"""The lifecycle as a state machine: seeded random sequences of operations against the real
``LifecycleManager`` over a fake Triton (``fake_triton``), with every invariant checked after every step
(``LifecycleWorld.check``).

The seed is printed; run again with ``SNOOZE_MACHINE_SEED=<seed>`` to replay a run, and
``SNOOZE_MACHINE_EXAMPLES`` to run more or fewer sequences. A failure is shrunk by hypothesis to a short
sequence of the world's operations: keep it in ``test_lifecycle_sequences.py``.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test
from lifecycle_world import MODELS, SIZES_MB, LifecycleWorld

EXAMPLES = int(os.environ.get("SNOOZE_MACHINE_EXAMPLES", "110"))
STEPS_PER_EXAMPLE = 80
MIN_STEPS = 5000

models = st.sampled_from(MODELS)
gaps = st.sampled_from((0.0, 0.01, 0.05, 0.3, 1.0))


class LifecycleMachine(RuleBasedStateMachine):
    steps = 0

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="snooze-machine-"))
        self.patches = pytest.MonkeyPatch()
        self.world = LifecycleWorld(self.tmp, monkeypatch=self.patches)

    def teardown(self) -> None:
        try:
            self.world.close()
        finally:
            LifecycleMachine.steps += self.world.steps
            self.patches.undo()
            shutil.rmtree(self.tmp, ignore_errors=True)

    @rule(model=models, timeout=st.sampled_from((None, None, 0.3, 2.0)), gap=gaps)
    def request(self, model, timeout, gap):
        self.world.step(self.world.request(model, timeout), gap)

    @rule(model=models, n=st.integers(2, 10), gap=gaps)
    def burst(self, model, n, gap):
        self.world.step(self.world.burst(model, n), gap)

    @rule(secs=st.sampled_from((0.1, 0.5, 1.0, 3.0, 7.0)))
    def tick(self, secs):
        self.world.step(self.world.tick(secs))

    @rule(model=models, size=st.sampled_from(SIZES_MB), instances=st.sampled_from((1, 1, 2)), gap=gaps)
    def publish(self, model, size, instances, gap):
        self.world.step(self.world.publish(model, size, instances=instances), gap)

    @rule(model=models, gap=gaps)
    def delete(self, model, gap):
        self.world.step(self.world.delete(model), gap)

    @rule(model=models, instances=st.sampled_from((None, 1, 2, 3)), gap=gaps)
    def api_load(self, model, instances, gap):
        self.world.step(self.world.api_load(model, instances), gap)

    @rule(model=models, gap=gaps)
    def api_unload(self, model, gap):
        self.world.step(self.world.api_unload(model), gap)

    @rule(model=models, gap=gaps)
    def crash(self, model, gap):
        self.world.step(self.world.crash(model), gap)

    @rule(model=models, outcome=st.sampled_from(("oom", "hang", "error")), delay=st.sampled_from((0.05, 0.5)))
    def script_load(self, model, outcome, delay):
        self.world.step(self.world.script_load(model, outcome, delay), 0)

    @rule(model=models)
    def unload_hang(self, model):
        self.world.step(self.world.unload_hang(model), 0)

    @rule(model=models, size=st.sampled_from(SIZES_MB))
    def remote_publish(self, model, size):
        self.world.step(self.world.remote_publish(model, size))

    @rule(model=models)
    def remote_delete(self, model):
        self.world.step(self.world.remote_delete(model))

    @precondition(lambda self: self.world.paused_since is None)
    @rule(gap=gaps)
    def pause(self, gap):
        self.world.step(self.world.pause(), gap)

    @precondition(lambda self: self.world.paused_since is not None)
    @rule(gap=gaps)
    def resume(self, gap):
        self.world.step(self.world.resume(), gap)

    @rule()
    def restart(self):
        self.world.step(self.world.restart())

    @invariant()
    def pauses_end(self):
        if self.world.paused_since is not None and self.world.now - self.world.paused_since > 30:
            self.world.step(self.world.resume())


def test_the_lifecycle_keeps_its_invariants_under_random_operations(capsys):
    run_seed = int(os.environ.get("SNOOZE_MACHINE_SEED") or random.randrange(2**32))
    with capsys.disabled():
        print(f"\nlifecycle state machine: seed {run_seed} (SNOOZE_MACHINE_SEED={run_seed} replays it)")
    logging.getLogger("snoozeml").setLevel(logging.CRITICAL)
    LifecycleMachine.steps = 0
    try:
        run_state_machine_as_test(
            seed(run_seed)(LifecycleMachine),
            settings=settings(
                max_examples=EXAMPLES,
                stateful_step_count=STEPS_PER_EXAMPLE,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
    finally:
        logging.getLogger("snoozeml").setLevel(logging.NOTSET)
        with capsys.disabled():
            print(f"lifecycle state machine: {LifecycleMachine.steps} steps (seed {run_seed})")
    if EXAMPLES >= 100:
        assert LifecycleMachine.steps >= MIN_STEPS
