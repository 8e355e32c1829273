"""`make bench` / `python -m bench`: every benchmark against the embedded stack, one report.

    python -m bench                       # all default sections (15-20 min on 2 cores), writes bench/report.md
    python -m bench --quick               # short durations, few cycles (smoke test, about 2 min)
    python -m bench --only coldstart      # one section (repeatable), merged into the report.json in --out-dir
    python -m bench --out-dir /tmp/b      # write report.md, report.json and plots/ elsewhere
    python -m bench --replay trace.csv    # keep-alive policies over your own trace (CSV lines model,timestamp)

Each section is one module of bench/sections/, found through bench/registry.py; the list below comes from them.
Loopback only; each measurement is bounded in time and requests. report.json (every number, as measured) is written
next to report.md and is not committed: a run with --only merges into the report.json it finds in --out-dir, so a
report built over several runs needs the report.json of the earlier ones.
"""

from __future__ import annotations

import os

# Before numpy/grpc load, here and in every child (Triton and its stubs inherit this environment):
# one BLAS thread everywhere, so a predict costs the same in a stub and in-process; no gRPC fork
# handlers (the bench spawns workers while grpc.aio channels are open).
for _k, _v in {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "GRPC_ENABLE_FORK_SUPPORT": "0",
}.items():
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from bench import report  # noqa: E402
from bench.common import machine  # noqa: E402
from bench.registry import Registry, RunContext, Section, sections  # noqa: E402
from bench.sections.keepalive import REPLAY  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent


def _parser(registry: Registry) -> argparse.ArgumentParser:
    listing = "\n".join(
        f"  {s.name:<20} {s.about}" + ("" if s.default else " [not in a default run]") for s in registry.sections()
    )
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        epilog=f"sections, in the order they run and report:\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="short durations, few cycles (smoke test)")
    parser.add_argument(
        "--only",
        action="append",
        choices=registry.names(),
        metavar="SECTION",
        help="run only this section (repeatable); the others stay as the report.json in --out-dir has them",
    )
    parser.add_argument("--out-dir", type=Path, default=BENCH_DIR, help="where report.md, report.json, plots/ go")
    parser.add_argument(
        "--replay",
        type=Path,
        metavar="TRACE_FILE",
        help=f"replay the keep-alive policies over this trace (CSV lines 'model,timestamp'); implies --only {REPLAY}",
    )
    parser.add_argument(
        "--cold-start-secs",
        type=float,
        metavar="SECS",
        help="with --replay: the cold-start cost of every model in the trace (default: the example model of the "
        "same name, else 1.0)",
    )
    return parser


def _command(args: argparse.Namespace) -> str:
    return (
        "python -m bench"
        + (" --quick" if args.quick else "")
        + "".join(f" --only {s}" for s in args.only or () if s != REPLAY or not args.replay)
        + (f" --replay {args.replay}" if args.replay else "")
    )


def _run_section(section: Section, root: Path, results: dict[str, Any], quick: bool, options: dict[str, Any]) -> None:
    """Run one section into ``results``; raises what it raised, or when its data lacks a key it declares."""
    params = dict(section.quick if quick else section.params)
    data = asyncio.run(section.run(root, params, RunContext(results["sections"], options)))
    if missing := section.missing(data):
        raise RuntimeError(f"its run returned no {', '.join(missing)}, which its section declares in keys")
    results["sections"][section.name] = data


def main(argv: list[str] | None = None) -> int:
    registry = sections()
    parser = _parser(registry)
    args = parser.parse_args(argv)
    if args.replay is not None:
        if not args.replay.is_file():
            parser.error(f"--replay {args.replay}: no such file (expected CSV lines 'model,timestamp')")
        args.only = [*(args.only or ()), REPLAY]
    elif REPLAY in (args.only or ()):
        parser.error(f"--only {REPLAY} needs --replay TRACE_FILE")
    chosen = set(args.only or registry.names(default_only=True))
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "report.json"

    results: dict[str, Any] = {"sections": {}, "section_meta": {}}
    if args.only and json_path.exists():  # a partial run updates the sections it ran, keeps the others
        results = json.loads(json_path.read_text())
    elif args.only:
        print(f"[bench] no {json_path}: the report holds only the sections run now", file=sys.stderr)
    started = time.perf_counter()
    results.update(
        {
            "command": _command(args),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": machine(),
            "quick": args.quick,
        }
    )
    failed = []
    options = {"replay": args.replay, "cold_start_secs": args.cold_start_secs}
    with tempfile.TemporaryDirectory(prefix="snooze-bench-") as tmp:
        for section in (s for s in registry.sections() if s.name in chosen):
            print(f"[bench] {section.name} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            try:
                _run_section(section, Path(tmp) / section.name, results, args.quick, options)
            except Exception as exc:  # noqa: BLE001 - one broken section must not lose the others
                traceback.print_exc()
                results["sections"].pop(section.name, None)
                failed.append(f"{section.name}: {type(exc).__name__}: {exc}")
            wall = time.perf_counter() - t0
            results["section_meta"][section.name] = {
                "wall_s": round(wall, 1),
                "quick": args.quick,
                "finished": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            }
            print(f"[bench] {section.name} done in {wall:.0f} s", file=sys.stderr, flush=True)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    results["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    results["failed"] = failed
    path = report.write(results, out_dir, registry)
    print(f"[bench] wrote {path} in {results['wall_s']:.0f} s", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
