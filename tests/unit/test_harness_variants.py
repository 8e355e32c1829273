"""The default run's share of a parametrized test's variants (tests/harness/variants.py)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

from harness.variants import keep


def variant(scopes: dict[str, str], **params: str) -> Any:
    """What keep() reads of a pytest item: its id, its parameters, and the scope of each parametrized fixture."""
    defs = {name: [SimpleNamespace(scope=scope)] for name, scope in scopes.items()}
    nodeid = "t.py::test[" + "-".join(params.values()) + "]"
    return SimpleNamespace(
        nodeid=nodeid, callspec=SimpleNamespace(params=params), _fixtureinfo=SimpleNamespace(name2fixturedefs=defs)
    )


SCOPES = {"topology": "module", "worker": "module", "fault": "function"}
STACKS = [("embedded", "in-stub"), ("embedded", "preforked"), ("two_process", "in-stub")]


def test_every_value_of_every_parameter_runs_in_the_fewest_variants_and_stacks():
    variants = [
        variant(SCOPES, topology=t, worker=w, fault=f)
        for (t, w), f in itertools.product(STACKS, ["exit", "segv", "kill"])
    ]
    kept = keep(variants)
    assert len(kept) == 3  # three faults: no fewer can take each once
    for name, values in (("topology", {"embedded", "two_process"}), ("worker", {"in-stub", "preforked"})):
        assert {v.callspec.params[name] for v in kept} == values
    assert {v.callspec.params["fault"] for v in kept} == {"exit", "segv", "kill"}
    assert len({(v.callspec.params["topology"], v.callspec.params["worker"]) for v in kept}) == 2  # two stacks, not 3
    assert keep(list(reversed(variants))) == kept  # the same choice whatever the order (every xdist worker agrees)


def test_a_single_parameter_keeps_every_value_and_a_plain_cross_product_is_covered_greedily():
    assert len(keep([variant(SCOPES, topology=t) for t in ("embedded", "two_process")])) == 2
    many = [variant({}, a=str(a), b=str(b)) for a, b in itertools.product(range(5), range(4))]  # 20: past the search
    kept = keep(many)
    assert {v.callspec.params["a"] for v in kept} == {str(a) for a in range(5)}
    assert {v.callspec.params["b"] for v in kept} == {str(b) for b in range(4)} and len(kept) == 5
