"""What the memory accountant reads: a process's proportional memory (Pss, with RSS where it cannot be read) and
Triton's memory cgroup (v1 and v2, on fake /proc and /sys trees, and on this machine's own)."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from controlplane.lifecycle.memory.cgroup import TritonCgroup, cgroup_dir, headroom_bytes, read_cgroup
from controlplane.lifecycle.memory.host import MemoryBudget
from controlplane.lifecycle.memory.units import MIB
from controlplane.lifecycle.state import ModelRecord, ModelState
from controlplane.settings import Settings
from controlplane.spec import DeploymentSpec
from controlplane.store import PublishedModel
from controlplane.triton import processes
from controlplane.triton.processes import held_bytes, proportional_bytes, resident_bytes

ROLLUP = """00400000-7ffc38bd6000 ---p 00000000 00:00 0                          [rollup]
Rss:               42000 kB
Pss:               24000 kB
Pss_Anon:          20000 kB
Shared_Clean:      20000 kB
Private_Dirty:     20000 kB
"""


def fake_proc(root: Path, pid: int, *, rollup: str | None, rss_pages: int = 0, cgroup: str | None = None) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    if rollup is not None:
        (d / "smaps_rollup").write_text(rollup)
    (d / "statm").write_text(f"100000 {rss_pages} 500 10 0 2000 0\n")
    if cgroup is not None:
        (d / "cgroup").write_text(cgroup)


def test_pss_is_read_from_smaps_rollup_and_summed(tmp_path):
    fake_proc(tmp_path, 10, rollup=ROLLUP)
    fake_proc(tmp_path, 11, rollup=ROLLUP.replace("24000", "1000"))
    assert proportional_bytes(10, tmp_path) == 24000 * 1024
    assert held_bytes([10, 11, 99], tmp_path) == 25000 * 1024  # 99: gone, counts 0


def test_rss_is_the_fallback_and_said_once(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(processes, "_rss_fallback_said", False)
    fake_proc(tmp_path, 20, rollup=None, rss_pages=256)
    fake_proc(tmp_path, 21, rollup=None, rss_pages=256)
    page = os.sysconf("SC_PAGE_SIZE")
    with caplog.at_level(logging.WARNING, logger="snoozeml.processes"):
        assert held_bytes([20, 21], tmp_path) == 2 * 256 * page
        assert held_bytes([20], tmp_path) == 256 * page
    said = [r for r in caplog.records if "smaps_rollup" in r.getMessage()]
    assert len(said) == 1 and "RSS" in said[0].getMessage()


def test_a_zombie_is_not_a_fallback(tmp_path, caplog, monkeypatch):
    """A process that exited after it was listed (a zombie: no Pss, RSS 0) holds nothing, and does not use up
    the one warning that a real permission problem needs."""
    monkeypatch.setattr(processes, "_rss_fallback_said", False)
    fake_proc(tmp_path, 30, rollup="", rss_pages=0)
    with caplog.at_level(logging.WARNING, logger="snoozeml.processes"):
        assert held_bytes([30], tmp_path) == 0
    assert not [r for r in caplog.records if "smaps_rollup" in r.getMessage()]
    assert processes._rss_fallback_said is False


def test_this_process_pss_is_at_most_its_rss():
    pss, rss = proportional_bytes(os.getpid()), resident_bytes(os.getpid())
    assert pss is not None and rss is not None and 0 < pss <= rss


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_usage_less_inactive_file(tmp_path):
    proc, sys = tmp_path / "proc", tmp_path / "sys"
    fake_proc(proc, 7, rollup=ROLLUP, cgroup="0::/kubepods/pod1/triton\n")
    cg = sys / "fs/cgroup/kubepods/pod1/triton"
    write(cg / "memory.max", f"{1024 * MIB}\n")
    write(cg / "memory.current", f"{600 * MIB}\n")
    write(cg / "memory.stat", f"anon 1\nfile 2\ninactive_file {100 * MIB}\nactive_file 3\n")
    reading = TritonCgroup(lambda: 7, proc_root=proc, sys_root=sys).read()
    assert reading is not None and reading.version == 2 and reading.path == cg
    assert reading.limit == 1024 * MIB and reading.usage == 500 * MIB


def test_cgroup_v2_unlimited_and_own_namespace_root(tmp_path):
    """A container with its own cgroup namespace: its path reads '/', its files are /sys/fs/cgroup's own; 'max'
    is no limit."""
    proc, sys = tmp_path / "proc", tmp_path / "sys"
    fake_proc(proc, 7, rollup=None, cgroup="0::/\n")
    write(sys / "fs/cgroup/memory.max", "max\n")
    write(sys / "fs/cgroup/memory.current", "4096\n")
    reading = read_cgroup(cgroup_dir(7, proc, sys))  # type: ignore[arg-type]
    assert reading is not None and reading.limit is None and reading.usage == 4096


def test_cgroup_v1_on_a_hybrid_host(tmp_path):
    """cgroup v1's memory controller (a hybrid host also lists a v2 line without it); v1's 'no limit' is
    LONG_MAX rounded to a page; a path from another cgroup namespace falls back to the hierarchy's root."""
    proc, sys = tmp_path / "proc", tmp_path / "sys"
    fake_proc(proc, 8, rollup=None, cgroup="5:devices:/\n4:memory:/docker/abc\n0::/\n")
    cg = sys / "fs/cgroup/memory/docker/abc"
    write(cg / "memory.limit_in_bytes", f"{512 * MIB}\n")
    write(cg / "memory.usage_in_bytes", f"{300 * MIB}\n")
    write(cg / "memory.stat", f"inactive_file 5\ntotal_inactive_file {50 * MIB}\n")
    reading = read_cgroup(cgroup_dir(8, proc, sys))  # type: ignore[arg-type]
    assert reading is not None and (reading.version, reading.limit, reading.usage) == (1, 512 * MIB, 250 * MIB)
    write(sys / "fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    write(sys / "fs/cgroup/memory/memory.usage_in_bytes", "8192\n")
    fake_proc(proc, 9, rollup=None, cgroup="4:memory:/elsewhere\n")
    other = read_cgroup(cgroup_dir(9, proc, sys))  # type: ignore[arg-type]
    assert other is not None and other.limit is None and other.usage == 8192


def test_no_cgroup_to_read(tmp_path):
    assert TritonCgroup(lambda: None, proc_root=tmp_path, sys_root=tmp_path).read() is None
    assert TritonCgroup(lambda: 123, proc_root=tmp_path, sys_root=tmp_path).read() is None


def test_headroom_default_is_a_tenth_of_the_limit():
    assert headroom_bytes(1000 * MIB, None) == 100 * MIB
    assert headroom_bytes(1000 * MIB, 64) == 64 * MIB


def test_this_machines_cgroup_reads_where_readable():
    """This process's own cgroup, as the control plane would read Triton's beside it."""
    where = cgroup_dir(os.getpid())
    if where is None:
        pytest.skip("no memory cgroup readable here (/proc/self/cgroup names none)")
    reading = read_cgroup(where)
    if reading is None:
        pytest.skip(f"memory cgroup {where[0]} has no readable memory files")
    assert reading.usage > 0 and (reading.limit is None or reading.limit > reading.usage)


class FakeClock:
    """A ``controlplane.clock.Clock`` the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


def test_a_sweep_reads_pss_again_only_when_rss_moved_or_the_reading_aged(tmp_path):
    clock = FakeClock()
    fake_proc(tmp_path, 30, rollup=ROLLUP, rss_pages=1000)
    assert held_bytes([30], tmp_path, max_age=10, clock=clock.monotonic) == 24000 * 1024
    (tmp_path / "30" / "smaps_rollup").write_text(ROLLUP.replace("24000", "23000"))  # another process mapped more
    assert held_bytes([30], tmp_path, max_age=10, clock=clock.monotonic) == 24000 * 1024  # RSS unchanged: it stands
    assert held_bytes([30], tmp_path, clock=clock.monotonic) == 23000 * 1024  # a load's read is always fresh
    (tmp_path / "30" / "smaps_rollup").write_text(ROLLUP.replace("24000", "30000"))
    (tmp_path / "30" / "statm").write_text(f"100000 {1000 + 2 * MIB // os.sysconf('SC_PAGE_SIZE')} 0 0 0 0 0\n")
    assert held_bytes([30], tmp_path, max_age=10, clock=clock.monotonic) == 30000 * 1024  # RSS moved 2 MiB: read again
    (tmp_path / "30" / "smaps_rollup").write_text(ROLLUP.replace("24000", "29000"))
    clock.now += 9
    assert held_bytes([30], tmp_path, max_age=10, clock=clock.monotonic) == 30000 * 1024  # within 10 s: it stands
    clock.now += 2
    assert held_bytes([30], tmp_path, max_age=10, clock=clock.monotonic) == 29000 * 1024  # aged: read again


def _record(model_id: str) -> ModelRecord:
    dep = DeploymentSpec(id=model_id, path=Path("."))
    rec = ModelRecord(model_id, PublishedModel(model_id, Path("."), dep, "custom", "python", [], [], {}, {}, 60, 60))
    rec.state = ModelState.READY
    return rec


def test_a_fresh_load_counts_its_estimate_until_measured_after_its_first_request():
    """A stub measured at its load holds less than after its first request; counting only that measurement
    admitted another load into room the request took back, and the tree overran the budget until a sweep."""
    old, fresh, next_load = _record("old"), _record("fresh"), _record("next")
    old.memory.footprint, old.memory.footprint_instances = (
        40 * MIB,
        1,
    )  # measured after requests: the estimate of a new one
    records = [old, fresh, next_load]

    class States:
        def values(self) -> list[ModelRecord]:
            return records

    async def pending() -> dict[str, float]:
        return {}

    budget = MemoryBudget(Settings(memory_budget_mb=116), States(), pending=pending)  # type: ignore[arg-type]
    need = budget.estimate(fresh, 1)
    assert need == 40 * MIB
    fresh.memory.footprint, fresh.memory.footprint_instances = 34 * MIB, 1  # what its load measured, before any request
    budget.hold_floor(fresh, need)
    next_load.state = ModelState.UNLOADED
    assert budget.used(next_load) == 80 * MIB  # not 74: the fresh model will grow once it has answered
    plan = asyncio.run(budget.plan_room(next_load, budget.estimate(next_load, 1)))
    assert plan is not None and plan.amount is not None and plan.amount == 4 * MIB  # 80 + 40 over 116 (74 + 40 fitted)
    budget.measured(fresh)  # a sweep before any request: still the floor
    assert budget.used(next_load) == 80 * MIB
    fresh.access.served_seen, fresh.memory.footprint = 1, 36 * MIB  # answered, then measured again: what it holds now
    budget.measured(fresh)
    assert budget.used(next_load) == 76 * MIB
    assert asyncio.run(budget.plan_room(next_load, budget.estimate(next_load, 1))) is None
    fresh.memory.footprint = 45 * MIB
    budget.hold_floor(fresh, 40 * MIB)  # a load measured above its estimate: its measurement counts
    assert "fresh" not in budget.floors
