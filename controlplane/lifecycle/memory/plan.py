"""What the accountant decides and how it is carried out: a plan of idle models to evict, in order.

The budgets (host and GPU) only decide: given what is loaded, what is measured and what a load needs, they return
a ``Plan`` (or None: it fits; or raise: it cannot fit, or everything is in use, "wait"). The unload
transitions carry it out (``Unloads.evict``, through the loader's admission and the supervisor's sweep) with
``carry_out``; the budgets never call back into them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from controlplane.errors import SnoozeError
from controlplane.lifecycle.memory.eviction import Candidate, EvictionPolicy
from controlplane.lifecycle.state import ModelRecord, ModelState

log = logging.getLogger("snoozeml.lifecycle")

# Unload ``victim`` (idle) to make room for ``for_model``; False when it turned out to be in use.
EvictFn = Callable[[ModelRecord, str, str], Awaitable[bool]]


@dataclass
class Plan:
    """Evict ``victims`` in this order (each still idle when its turn comes) until ``amount`` bytes are freed
    (None: all of them); ``reason`` labels the evictions (memory, oom, gpu_memory, gpu_oom)."""

    victims: list[ModelRecord]
    reason: str
    for_model: str
    amount: int | None = None
    # what each victim holds, as the plan counted it, and how the policy saw it (told once it is evicted)
    sizes: dict[str, int] = field(default_factory=dict)
    seen: dict[str, Candidate] = field(default_factory=dict)
    policy: EvictionPolicy | None = None
    ceiling: bool = False  # made for Triton's cgroup over its ceiling (not the models' sum over the budget)


async def carry_out(plan: Plan, evict_one: EvictFn) -> list[str]:
    """Unload the plan's victims (``evict_one``: the owner's unload) until its amount is freed; their ids."""
    freed, evicted = 0, []
    for victim in plan.victims:
        if plan.amount is not None and freed >= plan.amount:
            break
        # another load's plan may have taken it meanwhile (loads make room in parallel), or a request came
        if victim.state is not ModelState.READY or victim.op is not None or victim.held:
            continue
        try:
            unloaded = await evict_one(victim, plan.reason, plan.for_model)
        except SnoozeError as e:
            log.warning("model '%s': eviction failed: %s", victim.id, e)
            continue
        if unloaded:
            if plan.policy is not None and victim.id in plan.seen:
                plan.policy.evicted(plan.seen[victim.id])
            freed += plan.sizes.get(victim.id, 0)
            evicted.append(victim.id)
    return evicted
