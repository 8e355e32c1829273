"""The memory budget: what each model holds, what a load will need, and which idle model to evict.

The budget (``SNOOZE_MEMORY_BUDGET_MB``) is for the whole Triton tree where it can be seen: tritonserver's own
proportional memory (``server``, its Pss, read before each admission and at each sweep) counts beside the models;
where tritonserver cannot be seen (a remote Triton), the budget is for the models alone.

A model's footprint is measured (the Pss of its model processes and of their preforked workers, where they can be
seen; read again each sweep, ``Loader.remeasure``) or declared (its ``memory_mb``); a load
reserves its estimate from before it makes room until it is measured, so that loads running at once never count
the same free bytes. A model never measured nor declared is estimated at the largest model measured so far (not
the average: five such loads at once overran a 400 MiB budget by 30%); before anything was measured, such a load
runs alone (``Admission.make_room``). A reload that builds new instances beside the old ones (a republish) reserves
the new version's estimate beside what the old one holds: Triton holds both until the old one exits. The
preloaded parents of preforked models hold memory of their own, counted once as ``overhead``. When a load would
exceed the budget, idle models are unloaded until it fits: pre-warmed models no request has used yet first, then
in the order of the eviction policy (``eviction``: GreedyDual-Size-Frequency or least recently used). A pre-warm
itself only loads where its estimate fits the free budget (``fits``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from controlplane.errors import UnavailableError
from controlplane.lifecycle.memory.cgroup import CgroupMemory, headroom_bytes
from controlplane.lifecycle.memory.eviction import Candidate, EvictionPolicy, bets_first, eviction_policy
from controlplane.lifecycle.memory.plan import Plan
from controlplane.lifecycle.memory.units import MIB
from controlplane.lifecycle.state import ModelRecord, ModelState, ModelStates
from controlplane.settings import Settings

if TYPE_CHECKING:
    from controlplane.lifecycle.groups import Groups

log = logging.getLogger("snoozeml.lifecycle")


class BudgetInUse(UnavailableError):
    """The budget is full of models in use (requests in flight) or loading: nothing idle to evict now."""


# How many recent loads' growth of tritonserver itself its expected growth is the median of.
SERVER_GROWTH_WINDOW = 16

# What a miss costs when a model's load was never timed here (seconds): about a python model's cold start.
DEFAULT_LOAD_SECS = 1.0


def declared_bytes(rec: ModelRecord) -> int | None:
    mb = rec.model.deployment.memory_mb
    return int(mb * MIB) if mb else None


class MemoryBudget:
    def __init__(
        self,
        settings: Settings,
        states: ModelStates,
        *,
        pending: Callable[[], Awaitable[dict[str, float]]],
        server_memory: Callable[[], int | None] | None = None,
        cgroup: Callable[[], CgroupMemory | None] | None = None,
        groups: Groups | None = None,
        refresh: Callable[[list[ModelRecord]], Awaitable[list[int]]] | None = None,
    ) -> None:
        """``groups``: the ensembles (an ensemble holds no process; evicting one frees its steps); ``refresh``:
        Triton's reading of models' last accesses, returning the requests each served since the last one, in one
        call (``TritonReadings.refresh_all``)."""
        self.settings = settings
        self.states = states
        self.groups = groups
        self._pending = pending
        self._refresh = refresh
        self.policy: EvictionPolicy = eviction_policy(settings.eviction_policy)
        # Bytes Triton holds for models without a record (unpublished, being unloaded), by model: TritonSync's
        self.unrecorded: dict[str, int] = {}
        # Bytes held outside any model: the preloaded parents of preforked models (measured at their loads).
        self.overhead = 0
        # tritonserver's own proportional bytes (``measure_server``); 0 where it cannot be seen (a remote Triton)
        self.server = 0
        self._server_memory = server_memory
        # Triton's memory cgroup as last read (``measure_server``); None where it cannot be read
        self.cgroup: CgroupMemory | None = None
        self._cgroup = cgroup
        # what tritonserver grew by across recent loads (its side of each model's shared memory, ...), clamped at 0
        self._server_growths: deque[int] = deque(maxlen=SERVER_GROWTH_WINDOW)
        # By model: the estimate a load was admitted on, counted as a floor under what it measures until a
        # measurement taken after its first request (``hold_floor``, ``measured``)
        self.floors: dict[str, int] = {}

    @property
    def server_growth(self) -> int:
        """What tritonserver itself is expected to grow by during a load: the median of the recent loads' growth
        (a load reserves it beside the model's estimate; measured about 2 MiB per python model)."""
        if not self._server_growths:
            return 0
        return sorted(self._server_growths)[len(self._server_growths) // 2]

    def note_server_growth(self, before: int) -> None:
        """A load ended and ``measure_server`` read the server again: note what it grew by since ``before``."""
        if before and self.server:
            self._server_growths.append(max(self.server - before, 0))

    async def measure_server(self) -> int:
        """Read tritonserver's own memory (Pss; not its model processes') and Triton's cgroup again; the server's
        bytes (0: unseen)."""
        if self._server_memory is not None:
            measured: int | None = await asyncio.to_thread(self._server_memory)
            self.server = measured or 0
        if self._cgroup is not None:
            self.cgroup = await asyncio.to_thread(self._cgroup)
        return self.server

    @property
    def ceiling(self) -> int | None:
        """The container's ceiling in bytes: Triton's cgroup limit less the headroom; None without a limit."""
        cg = self.cgroup
        if cg is None or cg.limit is None:
            return None
        return cg.limit - headroom_bytes(cg.limit, self.settings.memory_headroom_mb)

    @property
    def budget_mb(self) -> float | None:
        """The budget: SNOOZE_MEMORY_BUDGET_MB, else the container's ceiling (its cgroup limit less the headroom),
        else None (no limit)."""
        if self.settings.memory_budget_mb is not None:
            return self.settings.memory_budget_mb
        ceiling = self.ceiling
        return ceiling / MIB if ceiling is not None else None

    def _budget_name(self) -> str:
        if self.settings.memory_budget_mb is not None:
            return f"SNOOZE_MEMORY_BUDGET_MB={self.settings.memory_budget_mb:g}"
        budget = self.budget_mb or 0
        return f"the memory budget ({budget:.0f} MiB: the container's limit less SNOOZE_MEMORY_HEADROOM_MB)"

    def check_server(self) -> None:
        """Log an error when tritonserver alone holds the whole budget: no model can load."""
        budget = self.budget_mb
        if budget is not None and self.server >= budget * MIB:
            log.error(
                "%s is not more than tritonserver's own memory (%.0f MiB, measured): no model can load; raise it by "
                "at least the memory of the models to keep loaded",
                self._budget_name(),
                self.server / MIB,
            )

    def estimate(self, rec: ModelRecord, instances: int, *, own: bool = True) -> int:
        """Bytes the model will hold with ``instances``: the larger of its last measurement and its declared
        memory_mb (a republish may declare more than the previous version measured), else the largest model
        measured so far (conservative: a load admitted on the average overruns the budget by the difference;
        per instance, scaled), else 0. ``own=False``: its own measurement is not what it holds awake (it was
        measured dozing), so only the declared figure or the largest model's count."""
        if self.groups is not None and self.groups.is_ensemble(rec):
            return 0  # no process of its own: its steps are models of their own, each charged
        dep = rec.model.deployment
        declared = dep.memory_mb * MIB / dep.instances if dep.memory_mb else 0
        if own and rec.memory.footprint and rec.memory.footprint_instances:
            per = max(rec.memory.footprint / rec.memory.footprint_instances, declared)
        elif declared:
            per = declared
        else:
            per = max(
                (
                    r.memory.footprint / r.memory.footprint_instances
                    for r in self.states.values()
                    if r is not rec and r.memory.footprint and r.memory.footprint_instances
                ),
                default=0,
            )
        return int(per * instances)

    def hold_floor(self, rec: ModelRecord, estimate: int) -> None:
        """A load admitted on ``estimate`` ended and was measured. A stub measured before its first request holds
        less than it will once it has answered (a model loaded for the first time has no growth noted yet):
        counting only that measurement freed room until the next sweep saw the growth, and loads admitted into
        that room left the tree over the budget (churn: 452 MiB against 400). So the estimate stays counted
        until ``measured`` sees the model measured after a request."""
        if estimate > (rec.memory.footprint or 0):
            self.floors[rec.id] = estimate
        else:
            self.floors.pop(rec.id, None)

    def measured(self, rec: ModelRecord) -> None:
        """A sweep measured the model again: once a request was served before that reading, what it holds is
        what was read, and the floor goes."""
        if rec.access.served_seen:
            self.floors.pop(rec.id, None)

    def dozed(self, rec: ModelRecord) -> None:
        """The model dozed or woke (``lifecycle/dozing.py``): its footprint was just read, and counts as it is."""
        self.floors.pop(rec.id, None)

    def held(self, rec: ModelRecord) -> int:
        """Bytes a loaded model counts for: its footprint, at least what its load in flight reserved and what its
        last load was admitted on until measured after a request (``hold_floor``), and a dozing model whose wake
        was admitted what it held awake while something holds it (``Admission.wake_room``), or while a stub's asked
        wake is unheard (``RequestPath.admit_doze_wake``)."""
        doze = rec.doze
        admitted = (doze.wake_admitted and doze.dozing and rec.in_use) or doze.waking
        waking = (doze.awake_footprint or 0) if admitted else 0
        return max(rec.memory.footprint or 0, rec.memory.reserved, self.floors.get(rec.id, 0), waking)

    def group_bytes(self, rec: ModelRecord) -> int:
        """What evicting ``rec`` frees besides its own: an ensemble's steps that only it holds (``groups``)."""
        if self.groups is None or not self.groups.is_ensemble(rec):
            return 0
        return self.groups.group_bytes(rec, {r.id: self.held(r) for r in self.states.values() if r.holds_memory})

    def used(self, exclude: ModelRecord | None, *, reserved: bool = True) -> int:
        """Bytes held beside ``exclude``: by tritonserver itself, by loaded models, and (``reserved``) set aside by
        loads in flight."""
        used = self.server + self.overhead + sum(self.unrecorded.values())
        for r in self.states.values():
            if r is exclude:
                continue
            if r.state is ModelState.LOADING:
                used += r.memory.reserved if reserved else 0
            elif r.holds_memory:  # a loaded model being reloaded or rescaled: its reservation covers the swap
                used += self.held(r)
        return used

    def fits(self, rec: ModelRecord, need: int) -> bool:
        """Whether ``need`` more bytes fit the budget beside what the other models hold, without evicting."""
        if self.budget_mb is None:
            return True
        return self.used(rec) + need <= int(self.budget_mb * MIB)

    def free(self, rec: ModelRecord) -> int:
        """Bytes of the budget not held beside ``rec`` (negative when over it)."""
        return int((self.budget_mb or 0) * MIB) - self.used(rec)

    async def plan_room(self, rec: ModelRecord, need: int, *, beside: int = 0) -> Plan | None:
        """What to evict so that ``need`` more bytes fit (``beside``: what the model's loaded version holds while a
        reload builds the new one beside it): None when it fits; UnavailableError when it never can; BudgetInUse
        ("wait") when nothing idle is left to evict. Carried out (``plan.carry_out``), then asked again."""
        if self.budget_mb is None:
            return None
        budget = int(self.budget_mb * MIB)
        room = budget - self.server  # what tritonserver itself leaves to the models
        if need > room:
            if self.server:
                raise UnavailableError(
                    f"model '{rec.id}' needs about {need / MIB:.0f} MiB, but {self._budget_name()} "
                    f"leaves {max(room, 0) / MIB:.0f} MiB for models beside "
                    f"tritonserver's own {self.server / MIB:.0f} MiB (measured; the budget is for the whole "
                    "Triton tree)",
                    hint=f"raise SNOOZE_MEMORY_BUDGET_MB to at least {(self.server + need) / MIB:.0f}, or load the "
                    "model with fewer instances",
                )
            raise UnavailableError(
                f"model '{rec.id}' needs about {need / MIB:.0f} MiB, more than the whole memory budget "
                f"({self.budget_mb:g} MiB)",
                hint="raise SNOOZE_MEMORY_BUDGET_MB, or load the model with fewer instances",
            )
        # A swap larger than the room left (a model over half of it) evicts every idle model and goes ahead:
        # Triton holds both versions only until the old one exits (the budget plus one model at most).
        need = min(need + beside, room)
        over = self.used(rec) + need - budget
        if over <= 0:
            return None
        plan = await self.plan_evict(rec, over, "memory")
        if not plan.victims:
            raise self._in_use(rec, need)
        return plan

    def _in_use(self, rec: ModelRecord, need: int) -> BudgetInUse:
        busy = sorted(
            r.id
            for r in self.states.values()
            if r is not rec
            and (r.memory.footprint or r.memory.reserved)
            and r.state in (ModelState.READY, ModelState.LOADING, ModelState.UNLOADING)
        )
        parents = f", {self.overhead / MIB:.0f} MiB of it by preloaded parents" if self.overhead else ""
        if self.server:
            parents += f", {self.server / MIB:.0f} MiB by tritonserver itself"
        return BudgetInUse(
            f"memory budget full: model '{rec.id}' needs about {need / MIB:.0f} MiB and "
            f"{self.used(rec) / MIB:.0f} of {self.budget_mb:g} MiB are held by models in use "
            f"({', '.join(busy)}){parents}",
            hint="retry when they are idle, or raise SNOOZE_MEMORY_BUDGET_MB",
            retry_after=5,
        )

    def still_over(self, rec: ModelRecord, need: int, *, beside: int = 0) -> BudgetInUse | None:
        """After a plan was carried out and freed nothing: the "wait" to raise (None: it fits after all)."""
        if self.budget_mb is None:
            return None
        room = int(self.budget_mb * MIB) - self.server
        need = min(need + beside, room)
        return self._in_use(rec, need) if self.used(rec) + need > int(self.budget_mb * MIB) else None

    async def plan_enforce(self, rec: ModelRecord | None = None) -> Plan | None:
        """What to evict (idle models, not ``rec``) so that what the models hold fits the budget again, and
        Triton's cgroup stays under its ceiling; None when both hold (or one model alone is left).

        Admission keeps loads within the budget on their estimates, but a load can measure more: a republish
        between the estimate and Triton's read of the files, a model never measured; loaded models and
        tritonserver itself grow (each sweep reads them again); and a restarted control plane adopts whatever
        Triton holds. Best effort: models in use stay, and one model alone may exceed it.
        """
        if self.budget_mb is None:
            return None
        # what is held, not what loads in flight reserved: those make their own room
        over = self.used(None, reserved=False) - int(self.budget_mb * MIB)
        # the container's own count: over its ceiling, evict whatever the per-model sums say
        ceiling = self.ceiling
        over_cgroup = self.cgroup.usage - ceiling if self.cgroup is not None and ceiling is not None else 0
        if max(over, over_cgroup) <= 0 or sum(1 for r in self.states.values() if r.holds_memory) <= 1:
            return None
        plan = await self.plan_evict(rec, max(over, over_cgroup), "memory")
        plan.ceiling = over_cgroup > over
        return plan

    def enforced(
        self, plan: Plan, evicted: list[str], rec: ModelRecord | None = None, *, estimate: int | None = None
    ) -> None:
        """Say what ``plan_enforce``'s plan, carried out, evicted."""
        if plan.ceiling and self.cgroup is not None:
            log.warning(
                "Triton's cgroup holds %.0f MiB, %.0f MiB over its limit (%.0f MiB) less the headroom (the models "
                "count %.0f MiB); evicted %s",
                self.cgroup.usage / MIB,
                (plan.amount or 0) / MIB,
                (self.cgroup.limit or 0) / MIB,
                self.used(None, reserved=False) / MIB,
                ", ".join(evicted) or "nothing (the others are in use)",
            )
            return
        log.warning(
            "the Triton tree holds %.0f MiB more than the memory budget (%g MiB; tritonserver itself %.0f MiB)%s; "
            "evicted %s",
            (plan.amount or 0) / MIB,
            self.budget_mb,
            self.server / MIB,
            f" after '{rec.id}' measured {(rec.memory.footprint or 0) / MIB:.0f} MiB"
            f"{f' (estimated {estimate / MIB:.0f} MiB)' if estimate is not None else ''}"
            if rec is not None
            else "",
            ", ".join(evicted) or "nothing (the others are in use)",
        )

    def totals(self) -> dict[str, int | None]:
        """Both counts, for status: what the budget counts (models, tritonserver, parents: proportional bytes) and
        the budget itself; Triton's cgroup usage (working set), its limit and the ceiling (None: not readable)."""
        budget = self.budget_mb
        cg = self.cgroup
        return {
            "accounted_bytes": self.used(None, reserved=False),
            "models_bytes": self.used(None, reserved=False) - self.server - self.overhead,
            "budget_bytes": int(budget * MIB) if budget is not None else None,
            "cgroup_usage_bytes": cg.usage if cg is not None else None,
            "cgroup_limit_bytes": cg.limit if cg is not None else None,
            "cgroup_ceiling_bytes": self.ceiling,
        }

    def candidate(self, rec: ModelRecord) -> Candidate:
        own = rec.memory.footprint or self.estimate(rec, rec.instances or rec.model.deployment.instances)
        return Candidate(
            rec.id,
            size_bytes=own + self.group_bytes(rec),
            cost_secs=rec.load.last_cold_start or DEFAULT_LOAD_SECS,
            last_access=rec.idle_since,
        )

    def eviction_order(self, records: list[ModelRecord]) -> list[ModelRecord]:
        """``records`` in eviction order: a pre-warm nobody used yet first (it was a bet), then the policy's."""
        by_id = {r.id: r for r in records}
        ranked = [by_id[c.id] for c in self.policy.order([self.candidate(r) for r in records])]
        return bets_first(ranked, lambda r: r.prewarmed_unused)

    def loaded(self, rec: ModelRecord) -> None:
        self.policy.loaded(rec.id)

    def forget(self, model_id: str) -> None:
        """The model was deleted: its frequency goes with it."""
        self.policy.forget(model_id)
        self.floors.pop(model_id, None)

    def accessed(self, rec: ModelRecord, count: float) -> None:
        """``count`` requests for the model were served since the last call (Triton's statistics)."""
        self.policy.accessed(rec.id, count)

    async def plan_evict(self, rec: ModelRecord | None, amount: int, reason: str) -> Plan:
        """Idle models but ``rec``, in ``eviction_order``, to unload until ``amount`` bytes are freed. Their last
        accesses are read from Triton first: a request that took the warm path (straight to Triton) since the last
        sweep counts, or the order would go by when the sweep last looked rather than by use."""
        pending = await self._pending()
        loaded = [r for r in self.states.values() if r is not rec and r.state is ModelState.READY]
        if self._refresh is not None and loaded:
            for r, served in zip(loaded, await self._refresh(loaded), strict=True):
                if served:
                    self.accessed(r, served)
        candidates = self.eviction_order(loaded)
        victims = [v for v in candidates if v.op is None and not v.held and pending.get(v.id, 0.0) <= 0]
        return Plan(
            victims,
            reason,
            rec.id if rec is not None else "the memory budget",
            amount=amount,
            sizes={v.id: self.held(v) + self.group_bytes(v) for v in victims},
            seen={v.id: self.candidate(v) for v in victims},
            policy=self.policy,
        )
