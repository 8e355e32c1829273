"""Scale: render (and validate) N tiny numpy packages; control-plane RSS and idle CPU with N published
models vs none, each measured in a fresh `ServingStack` process (`python -m bench.scale --probe`) so that
the benchmark's own imports (matplotlib, tritonclient, ...) do not count."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ECHO_PY, fp32, write_package


def make_packages(root: Path, n: int) -> list[Path]:
    return [write_package(root / f"tiny-{i:04d}", ECHO_PY, [fp32("x", 4)], [fp32("y", 4)]) for i in range(n)]


def render_all(packages: list[Path], repo: Path) -> dict[str, float]:
    from controlplane.render import embedded_target, render_model
    from controlplane.spec import DeploymentSpec, resolve
    from controlplane.store.transactions import write_model

    target = embedded_target()
    t_resolve = t_render = t_write = 0.0
    for pkg in packages:
        t0 = time.perf_counter()
        spec = resolve(DeploymentSpec(id=pkg.name, path=pkg))
        t1 = time.perf_counter()
        rendered = render_model(spec, target)  # builds and checks the config against Triton's protobuf
        t2 = time.perf_counter()
        write_model(rendered, repo)  # staged folder, one rename
        t3 = time.perf_counter()
        t_resolve, t_render, t_write = t_resolve + t1 - t0, t_render + t2 - t1, t_write + t3 - t2
    total = t_resolve + t_render + t_write
    return {
        "total_s": round(total, 3),
        "per_model_ms": round(1000 * total / len(packages), 2),
        "resolve_s": round(t_resolve, 3),
        "render_s": round(t_render, 3),
        "write_s": round(t_write, 3),
    }


def validate(repo: Path, models: list[str]) -> dict[str, Any]:
    from controlplane.validation import validate_repository

    load_start = [round(v, 2) for v in os.getloadavg()]
    start = time.perf_counter()
    report = validate_repository(repo, models=models)
    secs = time.perf_counter() - start
    # As CI runs it: `snoozectl validate` in a fresh process (interpreter, imports, report), exit code 0.
    everything = [p for p in repo.iterdir() if not p.name.startswith(".")]
    selection = [] if len(models) == len(everything) else [a for m in models for a in ("--model", m)]
    cmd = [sys.executable, "-c", "from controlplane.cli import main; main()", "validate", str(repo), "--json"]
    start = time.perf_counter()
    proc = subprocess.run([*cmd, *selection], capture_output=True, text=True, check=False)
    cli_secs = time.perf_counter() - start
    return {
        "models": len(models),
        "total_s": round(secs, 3),
        "per_model_ms": round(1000 * secs / len(models), 1),
        "ok": report.ok,
        "failures": len(report.failures),
        "cli_total_s": round(cli_secs, 3),
        "cli_exit_code": proc.returncode,
        "cores": os.cpu_count(),
        "load_average_start": load_start,
    }


def probe(repo: Path, idle_secs: float) -> dict[str, Any]:
    """In a fresh interpreter: start the whole stack over `repo`, settle, then measure this process."""
    cmd = [sys.executable, "-m", "bench.scale", "--probe", str(repo), str(idle_secs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180 + idle_secs, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"scale probe failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(root: Path, *, n: int, validate_n: int, idle_secs: float) -> dict[str, Any]:
    packages = make_packages(root / "packages", n)
    repo = root / "repo"
    rendered = render_all(packages, repo)
    validated = validate(repo, [p.name for p in packages[:validate_n]])
    (root / "empty").mkdir()
    empty = probe(root / "empty", idle_secs)
    full = probe(repo, idle_secs)
    mib = 2**20
    return {
        "models": n,
        "render": rendered,
        "validate_static": {
            **validated,
            "extrapolated_total_s_for_all": round(validated["per_model_ms"] * n / 1000, 1),
            "note": "static checks; imports by one probe interpreter per core, a forked child per model",
        },
        "control_plane": {
            "process": "ServingStack (lifecycle, activator, API, Envoy and Triton supervision) in one Python process",
            "rss_mib_0_models": round(empty["rss"] / mib, 1),
            f"rss_mib_{n}_models": round(full["rss"] / mib, 1),
            f"rss_{n}_vs_0_models": round(full["rss"] / empty["rss"], 3),
            "rss_kib_per_published_model": round((full["rss"] - empty["rss"]) / 1024 / n, 1),
            "idle_window_s": idle_secs,
            "idle_cpu_share_0_models": empty["cpu_share"],
            f"idle_cpu_share_{n}_models": full["cpu_share"],
            f"triton_idle_cpu_share_{n}_models": full["triton_cpu_share"],
            "start_s_0_models": empty["start_s"],
            f"start_s_{n}_models": full["start_s"],
            "sweep_interval_secs": full["sweep_interval_secs"],
        },
    }


async def _probe_main(repo: Path, idle_secs: float) -> dict[str, Any]:
    import psutil
    from rich.console import Console

    from controlplane.settings import Settings
    from controlplane.stack import ServingStack
    from controlplane.triton.launcher import free_port

    work = repo.parent / f"probe-{repo.name}"
    settings = Settings(
        work_dir=work,
        model_repository=repo,
        http_port=free_port(),
        grpc_port=free_port(),
        api_port=free_port(),
        auth="off",
        shutdown_grace_secs=1,
        log_level="warning",
    )
    stack = ServingStack(settings, None, console=Console(file=io.StringIO()))
    start = time.perf_counter()
    await stack.start()
    try:
        start_s = time.perf_counter() - start
        assert stack.store is not None
        published = len(stack.store.ids())
        await asyncio.sleep(2.0)  # settle: first sweeps, allocator warm-up
        me = psutil.Process()
        assert stack.triton_process is not None  # start() launched it (no external Triton here)
        triton = psutil.Process(stack.triton_process.pid)
        cpu0, tcpu0, t0 = me.cpu_times(), triton.cpu_times(), time.perf_counter()
        await asyncio.sleep(idle_secs)
        cpu1, tcpu1, t1 = me.cpu_times(), triton.cpu_times(), time.perf_counter()
        rss = me.memory_info().rss
    finally:
        await stack.stop()
    wall = t1 - t0
    return {
        "published": published,
        "start_s": round(start_s, 2),
        "rss": rss,
        "cpu_share": round((cpu1.user + cpu1.system - cpu0.user - cpu0.system) / wall, 4),
        "triton_cpu_share": round((tcpu1.user + tcpu1.system - tcpu0.user - tcpu0.system) / wall, 4),
        "sweep_interval_secs": settings.sweep_interval_secs,
        "pid": os.getpid(),
    }


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--probe":
        print(json.dumps(asyncio.run(_probe_main(Path(sys.argv[2]), float(sys.argv[3])))))
    else:
        sys.exit("usage: python -m bench.scale --probe REPO IDLE_SECS  (run by python -m bench)")
