"""Cold and warm times of the model corpus (tests/integration/test_corpus.py), for the closing note.

Runs the corpus module (``--slow`` adds the custom torch models, in-stub and preforked) with
``SNOOZE_CORPUS_TIMES`` set, then prints one row per model: the first request's time from asleep (HTTP, the
cold start included), a warm request (gRPC), the first request after the idle unload (gRPC), the server's
measured load time, and the warm-up's source before and after the model learned its traffic's shapes.
The stateful model's times are for its 20 requests together. Usage: python -m bench.corpus_times [--slow]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    slow = "--slow" in argv
    with tempfile.TemporaryDirectory() as tmp:
        times = Path(tmp) / "times.jsonl"
        cmd = [sys.executable, "-m", "pytest", "tests/integration/test_corpus.py", "-q", "-p", "no:warnings"]
        cmd += ["-m", "slow or not slow"] if slow else []
        rc = subprocess.call(cmd, cwd=ROOT, env={**os.environ, "SNOOZE_CORPUS_TIMES": str(times)})
        rows = [json.loads(line) for line in times.read_text().splitlines()] if times.exists() else []
    load = os.getloadavg()
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (a shared, noisy machine)\n")
    print("| model | what | cold (ms) | warm (ms) | woken (ms) | server load (s) | warm-up first / after |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        server = r.get("server_cold_secs")
        print(
            f"| {r['model']} | {r['what']} | {r['cold_secs'] * 1e3:.0f} | {r['warm_secs'] * 1e3:.1f} | "
            f"{r['woken_secs'] * 1e3:.0f} | {'-' if server is None else f'{server:.2f}'} | "
            f"{_short(r.get('warmup_first'))} / {_short(r.get('warmup_after'))} |"
        )
    return rc


def _short(line: str | None) -> str:
    return "-" if not line else ("skipped" if line.startswith("skipped") else line)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
