"""Scale beyond what the real Triton holds here: the control plane over N published models and the fake Triton.

`bench.scale_serve` measures `snoozectl serve` with the real Triton up to 10,000 models. Beyond, this measures the
control plane alone, in a process of its own per size (`python -m bench.scale_fake --probe REPO N`): the store's
first scan of the repository, the lifecycle's start until every model has its record, the control API's listing
through its ASGI app (every model, a page of 100, by state, by id prefix; no socket), and the process's memory per
model against the same probe over an empty repository. Triton is the test tier's fake (``tests/harness/
fake_triton.py``: its repository index and model control in memory), so no number here says anything of Triton.

The repository: one tiny numpy package rendered and published once, its folder then copied N times under other ids
(the files hard-linked, each copy's record written anew with its own id).

    python -m bench.scale_fake /tmp/scale 10000 50000
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ECHO_PY, fp32, write_package

LIST_CALLS, PAGE_CALLS = 10, 50
IDLE_SECS = 15.0  # the control plane left alone after the listings: what its periodic passes cost
ROOT = Path(__file__).resolve().parent.parent


def make_repository(root: Path, n: int) -> Path:
    """``root/repo-N``: N published tiny models (``tiny-00000`` ... ), made once and kept for later runs."""
    from controlplane.render import DEPLOYMENT_FILE, embedded_target
    from controlplane.spec import DeploymentSpec, resolve
    from controlplane.store import ModelStore

    repo = root / f"repo-{n}"
    if (repo / ".complete").exists():
        return repo
    repo.mkdir(parents=True, exist_ok=True)
    package = write_package(root / "package", ECHO_PY, [fp32("x", 4)], [fp32("y", 4)])
    first = "tiny-00000"
    if n:
        ModelStore(repo, embedded_target()).publish(resolve(DeploymentSpec(id=first, path=package)))
        source = repo / first
        record = json.loads((source / DEPLOYMENT_FILE).read_text())
        files = [p.relative_to(source) for p in source.rglob("*") if p.is_file() and p.name != DEPLOYMENT_FILE]
        for i in range(1, n):
            model_id = f"tiny-{i:05d}"
            folder = repo / model_id
            if folder.exists():
                continue
            for rel in files:
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(source / rel, folder / rel)
                except OSError:  # EMLINK: a file linked 65,000 times (ext4's limit; the store copies then too)
                    shutil.copy(source / rel, folder / rel)
            mine = {**record, "deployment": {**record["deployment"], "id": model_id}}
            (folder / DEPLOYMENT_FILE).write_text(json.dumps(mine))
    (repo / ".complete").touch()
    return repo


def _ms(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"n": len(v), "p50": round(v[len(v) // 2], 1), "p99": round(v[round(0.99 * (len(v) - 1))], 1)}


async def probe(repo: Path, n: int) -> dict[str, Any]:
    """The control plane over ``repo`` in this process (run in a fresh one: its memory is what it measures)."""
    import httpx
    import psutil

    sys.path.insert(0, str(ROOT / "tests"))
    from controlplane.api.app import create_app
    from controlplane.api.services import ControlPlaneServices
    from controlplane.lifecycle.manager import LifecycleManager
    from controlplane.metrics import SnoozeMetrics
    from controlplane.render import embedded_target
    from controlplane.settings import Settings
    from controlplane.store import ModelStore
    from harness.fake_triton import FakeProcesses, FakeStubControl, FakeTriton, NoGpu  # type: ignore[import-not-found]

    work = repo.parent / f"work-{n}-{os.getpid()}"
    journal = work / "journal"
    journal.mkdir(parents=True)
    rss_before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    store = ModelStore(repo, embedded_target())
    scanned = time.perf_counter() - started
    triton = FakeTriton(repo, journal)
    processes = FakeProcesses(triton)
    settings = Settings(work_dir=work, auth="off")
    manager = LifecycleManager(
        settings, store, triton, processes=processes, journal_dir=journal,
        gpu_reader=NoGpu(), gpu_pid_map=None, cgroup=lambda: None, stub_control=FakeStubControl(processes),
    )  # fmt: skip
    started = time.perf_counter()
    await manager.start()
    live = time.perf_counter() - started
    while len(manager.states.records) < n:  # the records of the rest, made a chunk at a time after the start
        await asyncio.sleep(0.01)
    recorded = time.perf_counter() - started
    services = ControlPlaneServices(store, manager, SnoozeMetrics(), settings, triton)
    app = create_app(settings, services)
    ids = sorted(store.ids())
    rng = random.Random(0)

    async def timed(client: httpx.AsyncClient, params: dict[str, Any] | None = None) -> float:
        t = time.perf_counter()
        r = await client.get("/v1/models", params=params)
        r.raise_for_status()
        return (time.perf_counter() - t) * 1000

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api", timeout=600) as c:
        await timed(c)
        full = [await timed(c) for _ in range(LIST_CALLS)]
        pages = [await timed(c, {"limit": 100, "after": rng.choice(ids)}) for _ in range(PAGE_CALLS)] if ids else []
        ready = [await timed(c, {"state": "ready"}) for _ in range(LIST_CALLS)]
        prefix = [await timed(c, {"prefix": ids[-1][:-2]}) for _ in range(LIST_CALLS)] if ids else []
    rss = psutil.Process().memory_info().rss
    # idle: the periodic passes alone (sweep, process watch, store follow), no request; the process's CPU meanwhile
    before, idle_started = psutil.Process().cpu_times(), time.perf_counter()
    await asyncio.sleep(IDLE_SECS)
    after, idle_wall = psutil.Process().cpu_times(), time.perf_counter() - idle_started
    idle_cpu = (after.user + after.system - before.user - before.system) / idle_wall
    await manager.stop()
    return {
        "models": n,
        "store_scan_s": round(scanned, 3),
        "lifecycle_live_s": round(live, 3),
        "all_recorded_s": round(recorded, 3),
        "rss_bytes": rss,
        "rss_growth_bytes": rss - rss_before,
        "idle_cpu_pct": round(100 * idle_cpu, 1),  # of one core, over IDLE_SECS with no request
        "listing_ms": {
            "full": _ms(full),
            **({"page_100": _ms(pages), "prefix": _ms(prefix)} if ids else {}),
            "state_ready": _ms(ready),
        },
    }


def _run_probe(repo: Path, n: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.scale_fake", "--probe", str(repo), str(n)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"probe of {n} models failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(root: Path, *, sizes: list[int]) -> dict[str, Any]:
    """Each size in its own process, after one over an empty repository (the control plane's own memory)."""
    root.mkdir(parents=True, exist_ok=True)
    load = [round(x, 2) for x in os.getloadavg()]
    empty = _run_probe(make_repository(root, 0), 0)
    results = []
    for n in sizes:
        r = _run_probe(make_repository(root, n), n)
        r["rss_kib_per_model"] = round((r["rss_bytes"] - empty["rss_bytes"]) / 1024 / n, 1)
        results.append(r)
    return {
        "triton": "fake",
        "empty_rss_bytes": empty["rss_bytes"],
        "sizes": results,
        "load_average": {"start": load, "end": [round(x, 2) for x in os.getloadavg()]},
    }


if __name__ == "__main__":
    if sys.argv[1] == "--probe":
        print(json.dumps(asyncio.run(probe(Path(sys.argv[2]), int(sys.argv[3])))))
    else:
        print(json.dumps(run(Path(sys.argv[1]), sizes=[int(a) for a in sys.argv[2:]] or [10000]), indent=2))
