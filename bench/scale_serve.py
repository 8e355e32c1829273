"""Scale, served: `snoozectl serve --models DIR` over N tiny custom packages, as a user runs it (its own process, the
real Triton): when the API and the gateway are live, when every package is published, the listing's p50/p99 (all,
a page of 100, filtered), the control plane's memory per model, a cold wake of the last model; then the same start
again with the work dir kept (every package adopted unchanged).

    python -m bench.scale_serve ROOT 1000 10000 [--from PACKAGES --checks CHECKS]

``--from``: the N packages are copies of the package folders in PACKAGES, taken in turn (packages the project has not
seen, as a user wrote them; each copy named ``<folder>-<number>``), and the cold wakes are of the last copy of each,
whose answers are compared with ``CHECKS/<folder>.json``: ``{"requests": [{"inputs": [KServe v2 JSON tensors],
"outputs": {name: flat data}}], "atol": optional}``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common import ECHO_PY, fp32, write_package

LIST_CALLS = 30  # full listings timed per size
PAGE_CALLS = 100  # pages of 100 (and filtered listings) timed per size
START_BOUND_SECS = 900.0
IDLE_SECS = 20.0  # after a restart adopted every model: the tree left alone, its CPU read per part


def make_packages(root: Path, n: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        write_package(root / f"tiny-{i:05d}", ECHO_PY, [fp32("x", 4)], [fp32("y", 4)])
    return root


def copy_packages(sources: Path, root: Path, n: int) -> Path:
    """``n`` packages, copies of the package folders in ``sources`` in turn (their files hard-linked: publishing only
    reads them), each named after its folder and its number."""
    folders = sorted(p for p in sources.iterdir() if p.is_dir())
    if not folders:
        raise SystemExit(f"--from {sources}: no package folders in it")
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        source = folders[i % len(folders)]
        target = root / f"{source.name}-{i:05d}"
        if not target.exists():
            shutil.copytree(source, target, copy_function=os.link)
    return root


def last_copies(ids: list[str], sources: Path) -> dict[str, str]:
    """Each source folder -> the id of its last copy (``copy_packages``)."""
    last: dict[str, str] = {}
    for model in ids:
        last[model.rsplit("-", 1)[0]] = model
    return {source.name: last[source.name] for source in sorted(sources.iterdir()) if source.name in last}


def _same(got: Any, want: Any, atol: float) -> bool:
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(_same(g, w, atol) for g, w in zip(got, want, strict=True))
        )
    if isinstance(want, (int, float)) and not isinstance(want, bool) and isinstance(got, (int, float)):
        return abs(got - want) <= atol
    return bool(got == want)


def _checked_wake(run: dict[str, Any], model: str, check: dict[str, Any]) -> dict[str, Any]:
    """The model's check requests over HTTP, the first one waking it: its time, and whether every output is right."""
    url = f"http://127.0.0.1:{run['http']}/v2/models/{model}/infer"
    atol = float(check.get("atol", 0.0))
    out: dict[str, Any] = {"model": model, "right": True, "secs": None, "status": []}
    for request in check["requests"]:
        start = time.perf_counter()
        r = httpx.post(url, json={"inputs": request["inputs"]}, timeout=120)
        out["secs"] = out["secs"] if out["secs"] is not None else round(time.perf_counter() - start, 3)
        out["status"].append(r.status_code)
        if r.status_code != 200:
            out["right"], out["error"] = False, r.text[:300]
            continue
        got = {o["name"]: o["data"] for o in r.json()["outputs"]}
        for name, want in request["outputs"].items():
            if not _same(got.get(name), want, atol):
                out["right"] = False
                out.setdefault("wrong", []).append({"output": name, "got": got.get(name), "want": want})
    return out


def _free_port() -> int:
    from controlplane.triton.launcher import free_port

    return free_port()


@contextlib.contextmanager
def serving(models: Path, work_dir: Path, log: Path) -> Iterator[dict[str, Any]]:
    """`snoozectl serve` in its own process until the block ends (SIGINT, then a bounded wait)."""
    ports = {"api": _free_port(), "http": _free_port(), "grpc": _free_port()}
    cmd = [
        sys.executable, "-c", "from controlplane.cli import main; main()", "serve", "--models", str(models),
        "--work-dir", str(work_dir), "--no-auth", "--api-port", str(ports["api"]), "--http-port", str(ports["http"]),
        "--grpc-port", str(ports["grpc"]),
    ]  # fmt: skip
    with log.open("ab") as out:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield {"proc": proc, "started": started, **ports}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _until(check: Any, what: str, proc: subprocess.Popen[bytes], bound: float = START_BOUND_SECS) -> None:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"snoozectl serve exited ({proc.returncode}) while waiting for {what}")
        with contextlib.suppress(httpx.TransportError):
            if check():
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what}: not within {bound:g}s")


def summary(values: list[float]) -> dict[str, float]:
    """p50 / p99 / max of milliseconds."""
    v = sorted(values)
    return {
        "n": len(v),
        "p50": round(v[len(v) // 2], 2),
        "p99": round(v[min(len(v) - 1, round(0.99 * (len(v) - 1)))], 2),
        "max": round(v[-1], 2),
    }


def _timed(client: httpx.Client, path: str, params: dict[str, Any] | None = None) -> float:
    start = time.perf_counter()
    r = client.get(path, params=params)
    r.raise_for_status()
    return (time.perf_counter() - start) * 1000


def _start(run: dict[str, Any], api: httpx.Client) -> dict[str, Any]:
    """Seconds from the process's start to the API live, the gateway live, every package published."""
    proc, started = run["proc"], run["started"]
    _until(lambda: api.get("/health/live").status_code == 200, "the control API", proc)
    api_live = time.monotonic() - started
    _until(lambda: httpx.get(f"http://127.0.0.1:{run['http']}/v2/health/live").status_code == 200, "gateway", proc)
    gateway_live = time.monotonic() - started
    _until(lambda: not api.get("/v1/publishing").json().get("in_progress"), "every package published", proc)
    published = time.monotonic() - started
    progress = api.get("/v1/publishing").json()
    return {
        "api_live_s": round(api_live, 2),
        "gateway_live_s": round(gateway_live, 2),
        "all_published_s": round(published, 2),
        "written": progress["published"],
        "unchanged": progress["unchanged"],
        "failed": len(progress["failed"]),
    }


def _listing(api: httpx.Client, ids: list[str]) -> dict[str, Any]:
    _timed(api, "/v1/models")  # the first listing makes the records of models published since the start
    full = [_timed(api, "/v1/models") for _ in range(LIST_CALLS)]
    rng = random.Random(0)
    pages = [_timed(api, "/v1/models", {"limit": 100, "after": rng.choice(ids)}) for _ in range(PAGE_CALLS)]
    ready = [_timed(api, "/v1/models", {"state": "ready"}) for _ in range(PAGE_CALLS // 4)]
    prefix = [_timed(api, "/v1/models", {"prefix": ids[-1][:-2]}) for _ in range(PAGE_CALLS // 4)]
    return {
        "full_ms": summary(full),
        "page_100_ms": summary(pages),
        "state_ready_ms": summary(ready),
        "prefix_ms": summary(prefix),
        "summary_ms": round(_timed(api, "/v1/models:summary"), 1),
    }


def _cold_wake(run: dict[str, Any], model: str) -> dict[str, Any]:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    start = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{run['http']}/v2/models/{model}/infer", json=body, timeout=120)
    secs = time.perf_counter() - start
    answer = r.json()["outputs"][0]["data"] if r.status_code == 200 else r.text[:300]
    return {"model": model, "status": r.status_code, "secs": round(secs, 3), "right": answer == [2, 4, 6, 8]}


def _idle_cpu(run: dict[str, Any], secs: float = IDLE_SECS) -> dict[str, float]:
    """Percent of one core each part of the tree used over ``secs`` with no request: the control plane (the serve
    process), tritonserver, Envoy, and the rest (stubs, the activator's helpers)."""
    root = psutil.Process(run["proc"].pid)

    def parts() -> dict[int, tuple[str, float]]:
        seen: dict[int, tuple[str, float]] = {}
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                name = proc.name()
                part = name if name in ("tritonserver", "envoy") else "other"
                part = "control_plane" if proc.pid == root.pid else part
                t = proc.cpu_times()
                seen[proc.pid] = (part, t.user + t.system)
        return seen

    before, started = parts(), time.monotonic()
    time.sleep(secs)
    after, wall = parts(), time.monotonic() - started
    used: dict[str, float] = {}
    for pid, (part, cpu) in after.items():
        used[part] = used.get(part, 0.0) + cpu - before.get(pid, (part, 0.0))[1]
    return {part: round(100 * cpu / wall, 1) for part, cpu in sorted(used.items())}


def measure(root: Path, n: int, *, sources: Path | None = None, checks: Path | None = None) -> dict[str, Any]:
    if sources is None:
        models = make_packages(root / f"packages-{n}", n)
    else:
        models = copy_packages(sources, root / f"copies-{n}", n)
    ids = sorted(p.name for p in models.iterdir())
    work, log = root / f"work-{n}", root / f"serve-{n}.log"
    out: dict[str, Any] = {"models": n}
    for phase in ("first_start", "restart"):  # the restart keeps the work dir (the rendered repository)
        with (
            serving(models, work, log) as run,
            httpx.Client(base_url=f"http://127.0.0.1:{run['api']}", timeout=120) as api,
        ):
            out[phase] = _start(run, api)
            if phase == "restart":  # every model adopted, none asked for: what sleeping models cost the node
                out["idle_cpu_pct"] = _idle_cpu(run)
            if phase == "first_start":
                out["listing"] = _listing(api, ids) if ids else {}
                out["rss_bytes"] = psutil.Process(run["proc"].pid).memory_info().rss
                if sources is None:
                    out["cold_wake_last"] = _cold_wake(run, ids[-1]) if ids else None
                else:
                    assert checks is not None
                    out["cold_wakes"] = [
                        _checked_wake(run, model, json.loads((checks / f"{source}.json").read_text()))
                        for source, model in last_copies(ids, sources).items()
                    ]
                    out["all_right"] = all(w["right"] for w in out["cold_wakes"])
    return out


def run(root: Path, *, sizes: list[int], sources: Path | None = None, checks: Path | None = None) -> dict[str, Any]:
    """Every size in its own serve, after one with no models (the control plane's own memory)."""
    root.mkdir(parents=True, exist_ok=True)
    empty = measure(root, 0)
    results = [measure(root, n, sources=sources, checks=checks) for n in sizes]
    for r in results:
        r["rss_kib_per_model"] = round((r["rss_bytes"] - empty["rss_bytes"]) / 1024 / r["models"], 1)
    return {"empty_rss_bytes": empty["rss_bytes"], "empty_start": empty["first_start"], "sizes": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path)
    parser.add_argument("sizes", type=int, nargs="*", default=[1000])
    parser.add_argument("--from", dest="sources", type=Path, default=None, help="package folders to copy in turn")
    parser.add_argument("--checks", type=Path, default=None, help="<folder>.json per package folder of --from")
    args = parser.parse_args()
    if (args.sources is None) != (args.checks is None):
        parser.error("--from and --checks go together: the copies' answers are checked against the checks")
    print(json.dumps(run(args.root, sizes=args.sizes, sources=args.sources, checks=args.checks), indent=2))


if __name__ == "__main__":
    main()
