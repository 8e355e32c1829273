"""A client's config override on a repository load (``LifecycleManager.load(override=...)``), over the fake
Triton: held through sleep and wake and an in-place rescale, ended by a load without one or a republish; a
refused override changes nothing."""

from __future__ import annotations

import pytest

from controlplane.lifecycle.overrides import ForbiddenOverrideError
from controlplane.lifecycle.state import ModelState
from harness.lifecycle_world import LifecycleWorld

OVERRIDE = {"max_batch_size": 16}


def triton_batch(w: LifecycleWorld, model: str) -> int:
    return int(w.triton.models[model].config.get("max_batch_size", 0))


def reported_batch(w: LifecycleWorld, model: str) -> int:
    """What the activator answers for the model's config while it sleeps."""
    return w.answers.config(w.store.get(model)).max_batch_size


def test_an_override_holds_through_sleep_wake_and_rescale_until_a_load_without_one(world):
    w, m = world, "m0"
    w.step(w.publish(m, 60), 0.1)
    published = reported_batch(w, m)
    assert published == 8

    w.run(w.manager.load(m, override=OVERRIDE))
    assert w.manager.states.records[m].state is ModelState.READY
    assert triton_batch(w, m) == 16 and reported_batch(w, m) == 16

    w.step(w.api_unload(m), 2.0)  # asleep: Triton no longer holds the model or its override
    assert w.manager.states.records[m].state is ModelState.UNLOADED and w.triton.models[m].state != "READY"
    assert reported_batch(w, m) == 16

    w.step(w.request(m), 1.0)  # the wake loads with the override
    assert w.manager.states.records[m].state is ModelState.READY and triton_batch(w, m) == 16

    w.run(w.manager.load(m, instances=2))  # the instance count still applies, on top of the override
    assert w.triton.models[m].count == 2 and triton_batch(w, m) == 16
    w.run(w.manager.load(m, instances=1))
    assert w.triton.models[m].count == 1 and triton_batch(w, m) == 16

    # Triton keeps an override through a load without one while the files are unchanged: the published
    # config must be sent for the override to end.
    w.run(w.manager.load(m, override=None))
    assert triton_batch(w, m) == published and reported_batch(w, m) == published
    assert w.manager.states.records[m].state is ModelState.READY and w.triton.models[m].count == 1


def test_a_republish_ends_the_override(world):
    w, m = world, "m1"
    w.step(w.publish(m, 60), 0.1)
    w.run(w.manager.load(m, override=OVERRIDE))
    assert triton_batch(w, m) == 16
    w.step(w.publish(m, 60, max_batch_size=4), 1.0)
    assert triton_batch(w, m) == 4 and reported_batch(w, m) == 4
    assert w.manager.config_override(m) is None


@pytest.mark.parametrize(
    ("override", "field"),
    [({"backend": "onnxruntime"}, "'backend'"), ({"max_batch_size": 0}, "max_batch_size 0"),
     ({"input": []}, "'input'"), ({"parameters": {"snooze_generation": {"string_value": "x"}}}, "snooze_generation")],
)  # fmt: skip
def test_a_forbidden_override_names_the_field_and_changes_nothing(world, override, field):
    w, m = world, "m2"
    w.step(w.publish(m, 60), 0.1)
    w.run(w.manager.load(m, override=OVERRIDE))
    loads = w.triton.calls["load"]
    with pytest.raises(ForbiddenOverrideError, match=field) as refused:
        w.run(w.manager.load(m, override=override))
    assert f"model '{m}'" in refused.value.message and refused.value.hint
    assert w.triton.calls["load"] == loads and triton_batch(w, m) == 16
    assert w.manager.config_override(m) == OVERRIDE


def test_the_runtime_reads_the_override_mark_the_control_plane_sets():
    from controlplane.lifecycle import overrides
    from python_backend import triton_model

    assert triton_model.OVERRIDE_PARAMETER == overrides.OVERRIDE_PARAMETER
