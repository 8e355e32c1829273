"""What reading proportional memory costs per sweep: 200 processes, one smaps_rollup read each.

    .venv/bin/python -m bench.pss_sweep [--processes 200] [--rounds 15]

The processes are forks of one parent that imported numpy (as a python-backend stub does): each maps numpy's and
libpython's pages, so the kernel walks about as many page-table entries per read as for a real stub. Three reads
of the same 200 processes, interleaved round by round, medians reported:

- ``pss``: a fresh read (``held_bytes``: /proc/<pid>/smaps_rollup), as at a load;
- ``pss_sweep``: what a sweep reads (``held_bytes(max_age=SWEEP_PSS_MAX_AGE_SECS)``: statm each, smaps_rollup
  again only for a process whose RSS moved or whose reading aged; here the rounds run within the age, so this
  is the steady state; a process is read afresh at most every 10 s, i.e. 1/10 of them per 1 s sweep);
- ``rss``: what it read before (psutil ``memory_info``: /proc/<pid>/statm);
- ``uss``: what preforked workers were read with before (psutil ``memory_full_info``: the whole /proc/<pid>/smaps).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from collections.abc import Callable

import psutil

from controlplane.triton.processes import SWEEP_PSS_MAX_AGE_SECS, held_bytes


def spawn(n: int) -> list[int]:
    import numpy  # noqa: F401  (mapped in every child, as in a stub)

    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            signal.pause()
            os._exit(0)
        pids.append(pid)
    return pids


def _rss(pids: list[int]) -> int:
    return sum(psutil.Process(p).memory_info().rss for p in pids)


def _uss(pids: list[int]) -> int:
    return sum(psutil.Process(p).memory_full_info().uss for p in pids)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    pids = spawn(args.processes)
    try:
        time.sleep(0.5)
        reads: dict[str, Callable[[list[int]], int]] = {
            "pss": held_bytes,
            "pss_sweep": lambda p: held_bytes(p, max_age=SWEEP_PSS_MAX_AGE_SECS),
            "rss": _rss,
            "uss": _uss,
        }
        secs: dict[str, list[float]] = {k: [] for k in reads}
        totals: dict[str, int] = {}
        for _ in range(args.rounds):
            for name, read in reads.items():
                t0 = time.perf_counter()
                totals[name] = read(pids)
                secs[name].append(time.perf_counter() - t0)
        load = os.getloadavg()
        print(
            f"{args.processes} processes (forks of a numpy parent), {args.rounds} rounds interleaved; "
            f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores"
        )
        for name in reads:
            med = statistics.median(secs[name])
            print(
                f"  {name}: median {med * 1e3:.1f} ms per sweep ({med / args.processes * 1e6:.0f} us per process), "
                f"total {totals[name] / 2**20:.0f} MiB"
            )
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for pid in pids:
            os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
