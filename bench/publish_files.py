"""What publishing costs in files: the file system's own operations, then ``publish_all`` of N tiny packages into a
fresh repository, optionally against another checkout's code (a baseline), interleaved and repeated.

Publishing 10,000 packages is the file system's work (docs/measurements.md,
"50,000 models with the fast fake again, and what a publish's files cost (2026-12-07)"): each package is a model folder
of its own, and a folder or a file made costs far more than a link on some file systems. This measures both, so a
change to what a model folder holds can be judged in the same run:

    python -m bench.publish_files /tmp/pf 2000 --rounds 3 --baseline /path/to/other/checkout

Each publish runs in a process of its own (``--publish``), with the checkout's code first on its path.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OPS = 3000  # file-system operations of each kind per round


def fs_ops(root: Path, n: int = OPS) -> dict[str, float]:
    """Microseconds per operation: mkdir, a file made in a new folder and in an old one, a link, a rename."""
    shutil.rmtree(root, ignore_errors=True)
    (root / "d").mkdir(parents=True)
    source = root / "source"
    source.write_bytes(b"x" * 5000)
    old = root / "old"
    old.mkdir()
    costs: dict[str, float] = {}

    def timed(name: str, op: Any) -> None:
        started = time.perf_counter()
        for i in range(n):
            op(i)
        costs[name] = round(1e6 * (time.perf_counter() - started) / n, 1)

    timed("mkdir_us", lambda i: os.mkdir(root / "d" / f"m{i}"))
    timed("file_in_new_folder_us", lambda i: (root / "d" / f"m{i}" / "f").write_bytes(b"y" * 600))
    timed("file_in_old_folder_us", lambda i: (old / f"f{i}").write_bytes(b"y" * 600))
    timed("link_us", lambda i: os.link(source, root / "d" / f"m{i}" / "l"))
    timed("rename_us", lambda i: os.rename(root / "d" / f"m{i}", root / "d" / f"n{i}"))
    shutil.rmtree(root, ignore_errors=True)
    return costs


def publish(root: Path, n: int) -> dict[str, float]:
    """In this process: ``publish_all`` of ``n`` tiny packages into a fresh repository; ms a package."""
    from bench.scale import make_packages
    from controlplane.publishing import Publishing, publish_all
    from controlplane.render import embedded_target
    from controlplane.spec import DeploymentSpec
    from controlplane.store import ModelStore

    shutil.rmtree(root, ignore_errors=True)
    packages = make_packages(root / "packages", n)
    store = ModelStore(root / "repo", embedded_target())
    progress = Publishing()
    progress.plan([DeploymentSpec(id=p.name, path=p) for p in packages])
    started, cpu = time.perf_counter(), time.process_time()
    publish_all(store, progress, say=lambda _: None)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    assert progress.published == n, f"{progress.published} of {n} published: {progress.failed}"
    inodes = sum(1 for _ in (root / "repo" / packages[0].name).rglob("*")) + 1
    return {"ms_per_package": round(1000 * wall / n, 3), "cpu_ms_per_package": round(1000 * cpu / n, 3),
            "entries_per_model": inodes}  # fmt: skip


def _publish_in(code: Path, root: Path, n: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--publish", str(root), str(n)]  # the code's own modules
    done = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"publish with the code of {code} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(root: Path, n: int, *, rounds: int, baseline: Path | None) -> dict[str, Any]:
    """``rounds`` rounds, each: the file-system operations, then a publish with each checkout (baseline first)."""
    load = [round(x, 2) for x in os.getloadavg()]
    codes = {"main": ROOT, **({"baseline": baseline} if baseline is not None else {})}
    ops: list[dict[str, float]] = []
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in codes}
    for i in range(rounds):
        ops.append(fs_ops(root / "ops"))
        for name, code in sorted(codes.items()):  # baseline, then main: alternated round by round
            runs[name].append(_publish_in(code, root / f"{name}-{i}", n))
            shutil.rmtree(root / f"{name}-{i}", ignore_errors=True)
    medians = {name: statistics.median(r["ms_per_package"] for r in rs) for name, rs in runs.items()}
    result: dict[str, Any] = {
        "packages": n,
        "rounds": rounds,
        "fs_ops_median": {k: statistics.median(o[k] for o in ops) for k in ops[0]},
        "publish": runs,
        "ms_per_package_median": medians,
        "load_average": {"start": load, "end": [round(x, 2) for x in os.getloadavg()]},
    }
    if baseline is not None:
        result["main_over_baseline"] = round(medians["main"] / medians["baseline"], 3)
    return result


def main() -> None:
    if sys.argv[1:2] == ["--publish"]:
        print(json.dumps(publish(Path(sys.argv[2]), int(sys.argv[3]))))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path, nargs="?", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("packages", type=int, nargs="?", default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout, published the same way")
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="publish-files-"))
    print(json.dumps(run(root, args.packages, rounds=args.rounds, baseline=args.baseline), indent=2))


if __name__ == "__main__":
    main()
