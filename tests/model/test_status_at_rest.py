"""A sleeping model's status is kept on its record (``AdminOperations._at_rest``: a listing of thousands of sleeping
models builds none again) and must say what reading the record afresh (``_read``) says, after every change that
reaches a model at rest: a publish, a republish here or on another node, an ensemble over it, a failed load, a
delete and a load that brings it out of rest."""

from __future__ import annotations

from harness.lifecycle_world import LifecycleWorld


def assert_at_rest_is_current(world: LifecycleWorld) -> int:
    """Every model at rest: its kept status equals a fresh read; how many were at rest."""
    admin = world.manager.admin
    users = world.manager.groups.users()
    at_rest = 0
    for model_id in sorted(world.store.ids()):
        rec = world.manager.states.record(model_id)
        if rec.loaded or rec.op is not None or rec.access.keep_alive is not None:
            continue
        at_rest += 1
        kept = admin.status(rec.id)
        assert kept == admin._read(rec, users), rec.id
        assert admin.status(rec.id) == kept
    ids = sorted(world.store.ids())  # the listing's state filter reads states, not statuses: the same states
    assert world.manager.states_of(ids) == [s.state for s in world.manager.statuses(ids)]
    return at_rest


def test_a_sleeping_models_kept_status_follows_every_change(world: LifecycleWorld) -> None:
    s, w = world.step, world
    s(w.publish("m0", 60, idle_timeout_secs=5), 0.1)
    s(w.publish("m1", 60, 1, "preforked", idle_timeout_secs=5), 0.1)
    assert assert_at_rest_is_current(world) == 2
    first = world.manager.status("m0")
    assert world.manager.status("m0") is first  # nothing changed: the kept one

    s(w.publish("m0", 80, 2, idle_timeout_secs=9), 0.1)  # a republish while asleep: new deployment
    assert world.manager.status("m0").idle_timeout_secs == 9
    s(w.remote_publish("m1", 70), 0.0)
    s(w.tick(1.5), 0.1)  # the store follow reads the other node's publish
    world.publish_ensemble("e0", ["m0", "m1"])
    s(w.tick(1.5), 0.1)
    assert world.manager.status("e0").steps == ["m0", "m1"]
    assert world.manager.status("m0").ensembles == ["e0"]
    assert assert_at_rest_is_current(world) == 3

    s(w.script_load("m1", "error"), 0.0)  # its next load fails: FAILED, with the reason
    s(w.api_load("m1"), 0.5)
    failed = world.manager.status("m1")
    assert failed.state.value == "failed" and failed.reason
    assert_at_rest_is_current(world)

    s(w.delete("m1"), 0.5)
    assert_at_rest_is_current(world)
