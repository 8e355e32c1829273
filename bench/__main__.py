"""`make bench` / `python -m bench`: every benchmark against the embedded stack, one report.

    python -m bench                       # all default sections (15-20 min on 2 cores), writes bench/report.md
    python -m bench --quick               # short durations, few cycles (smoke test, about 2 min)
    python -m bench --only coldstart      # one section (repeatable); merged into the existing report.json
    python -m bench --out-dir /tmp/b      # write report.md, report.json and plots/ elsewhere
    python -m bench --replay trace.csv    # keep-alive policies over your own trace (CSV lines model,timestamp)

Sections: gateway, gateway_filters, coldstart, batching, scale_to_zero, scale, recovery, keepalive, keepalive_live,
fleet, streaming, eviction, churn (default), gateway_targets (opt-in: the gateway's targets against the bare Envoy
hop alone, many rounds, with a twin of the gateway for the noise), gateway_routes (opt-in: what the routes cost besides
filters, each part left out in turn), envoy_cpu (opt-in: each gateway configuration's own CPU per request in
front of an Envoy that answers itself, no Triton), envoy_instructions (opt-in: the same configurations'
instructions per request, counted by callgrind: needs valgrind), native (opt-in: torch custom vs its ONNX export),
keepalive_replay (--replay). Loopback only; each
measurement is bounded in time and requests. keepalive replays the keep-alive policies in virtual time (no
server, seconds): see bench/keepalive_replay.py for the traces and the trace file format; keepalive_live runs a
periodic caller through the real stack against an adaptive and a fixed copy of one model
(bench/keepalive_live.py). eviction replays the eviction policies (SNOOZE_EVICTION_POLICY) in virtual time over
Zipf, scan and shifting-hot-set traces on a fixed memory budget (bench/eviction_replay.py).
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

from bench.common import machine  # noqa: E402

DEFAULT_SECTIONS = (
    "gateway", "gateway_filters", "coldstart", "batching", "scale_to_zero", "scale", "recovery", "keepalive",
    "keepalive_live", "fleet", "streaming", "eviction", "churn",
)  # fmt: skip
ALL_SECTIONS = (
    *DEFAULT_SECTIONS, "gateway_targets", "gateway_routes", "envoy_cpu", "envoy_instructions", "native",
    "keepalive_replay",
)  # fmt: skip
BENCH_DIR = Path(__file__).resolve().parent


# The gateway with keys (as deployed with auth) and without (as `make serve` runs it), its twin for the noise.
GATEWAY_TARGETS = {"variants": ("no_auth",), "twin": True, "large_requests": False, "bare_auth": True}
# Every Envoy restarted after this many cycles (a process's own luck is one block's, not a target's): 4 blocks.
RESTART_EVERY = 10
# bench.gateway_variants.VARIANTS and ROUTE_EDITS, checked there
GATEWAY_ROUTES = {
    "variants": ("no_request_id", "no_retry", "no_gate", "no_access_log", "no_auth", "no_hints", "no_filters"),
    "large_requests": False,
    "direct_with_id": True,
}


def params(quick: bool) -> dict[str, dict[str, Any]]:
    if quick:
        return {
            "gateway": {"seconds": 0.2, "warmup": 0.05},
            "gateway_filters": {"seconds": 0.2, "warmup": 0.05, "rounds": 1},
            "gateway_targets": {"seconds": 0.2, "warmup": 0.05, "rounds": 2, "restart_every": 1, **GATEWAY_TARGETS},
            "gateway_routes": {"seconds": 0.2, "warmup": 0.05, "rounds": 1, **GATEWAY_ROUTES},
            "envoy_cpu": {"seconds": 0.2, "rounds": 1, "concurrency": 8},
            "envoy_instructions": {"requests": 100, "warmup_requests": 20, "repeats": 1, "concurrency": 8},
            "coldstart": {
                "cycles": 1,
                "models": ["numpy-linear", "torch-mlp-preforked", "torch-conv-preforked", "onnx-mlp"],
                "memory_copies": 2,
                "warmup_cycle": False,
            },
            "batching": {"seconds": 0.2, "warmup": 0.05, "pairs": 1, "pair_seconds": 0.2, "torch_rounds": 0},
            "scale_to_zero": {
                "model": "numpy-linear",
                "idle_timeout": 1.0,
                "baseline_secs": 0.5,
                "traffic_secs": 0.3,
                "cycles": 1,
                "settle_secs": 1.0,
            },
            "scale": {"n": 10, "validate_n": 3, "idle_secs": 0.5},
            "native": {"seconds": 0.5, "repeats": 1},
            "recovery": {"cycles": 1},
            "streaming": {"cycles": 1, "tokens": 200},
            "keepalive": {},  # virtual time: the full replay takes seconds, quick or not
            "keepalive_live": {
                "period_s": 4.0,
                "idle_timeout_s": 1.0,
                "requests": 7,
                "min_samples": 3,
                "min_unloaded_s": 1.0,
            },
            "keepalive_replay": {},
            "eviction": {"requests": 2000},  # virtual time: the full replay takes seconds too
            # 4 models of ~50 MiB (8 MiB ballast + the stub) under a budget that holds two: swaps from the start
            "churn": {
                "models": 4,
                "ballast_mb": 8,
                "budget_mb": 130,
                "seconds": 4.0,
                "clients": 4,
                "republish_secs": 2.0,
            },
            "fleet": {
                "nodes": 2,
                "models": 6,
                "idle_timeout": 5.0,
                "rate": 5.0,
                "seconds": 4.0,
                "cycles": 1,
                "sample_secs": 0.5,
                "hop_seconds": 0.3,
                "hop_warmup": 0.3,
                "hop_repeats": 1,
            },
        }
    return {
        "gateway": {"seconds": 3.0, "warmup": 0.5},
        # The gateway less each filter in turn, the bare hop and direct: 8 targets x 4 x 30 cycles x 0.45 s, and the
        # warm 32 MiB comparison: 8.5 minutes.
        "gateway_filters": {"seconds": 0.4, "warmup": 1.0, "rounds": 30, "restart_every": RESTART_EVERY},
        # Direct, the bare hop with and without a key check, the gateway with and without keys, and its twin, in
        # turn (bench._load.AlternatingJob): 6 targets x 4 (protocol, concurrency) x 40 cycles x 0.55 s, 9 minutes.
        "gateway_targets": {
            "seconds": 0.5,
            "warmup": 1.0,
            "rounds": 40,
            "restart_every": RESTART_EVERY,
            **GATEWAY_TARGETS,
        },  # fmt: skip
        # What the routes do besides filters, each left out in turn, and the filters, in turn: 11 targets x 4 x 30
        # cycles x 0.35 s, 8 minutes.
        "gateway_routes": {"seconds": 0.3, "warmup": 1.0, "rounds": 30, **GATEWAY_ROUTES},
        # 12 Envoy configurations x 2 protocols x 15 rounds x 1 s: 6 minutes
        "envoy_cpu": {"seconds": 1.0, "rounds": 15, "concurrency": 8},
        # 13 configurations under callgrind, each some 20 s to start and 2 x (300 + 2 x 2000) requests: 7 minutes
        "envoy_instructions": {"requests": 2000, "warmup_requests": 300, "repeats": 2, "concurrency": 8},
        "coldstart": {
            "cycles": 20,
            "models": [
                "numpy-linear",
                "torch-mlp",
                "torch-mlp-preforked",
                "torch-mlp-onnx",
                "onnx-mlp",
                "torch-conv",
                "torch-conv-preforked",
            ],
            "memory_copies": 5,
        },
        "batching": {"seconds": 4.0, "warmup": 0.5, "pairs": 7, "pair_seconds": 2.0, "torch_rounds": 3},
        "scale_to_zero": {
            "model": "torch-mlp",
            "idle_timeout": 3.0,
            "baseline_secs": 2.0,
            "traffic_secs": 5.0,
            "cycles": 2,
            "settle_secs": 2.0,
        },
        "scale": {"n": 200, "validate_n": 200, "idle_secs": 10.0},
        "native": {"seconds": 5.0, "repeats": 5},
        "recovery": {"cycles": 10},
        "streaming": {"cycles": 9, "tokens": 2000},
        "keepalive": {},
        # the run: period 8 s, fixed timeout 2 s; the policy learns from 3 idle times (10 by default)
        "keepalive_live": {
            "period_s": 8.0,
            "idle_timeout_s": 2.0,
            "requests": 16,
            "min_samples": 3,
            "min_unloaded_s": 2.0,
        },
        "keepalive_replay": {},
        "eviction": {"requests": 20000},
        # the scenario: 40 models x 40 MiB of real memory under 400 MiB, 8 clients, Zipf(1), 120 s per policy
        "churn": {
            "models": 40,
            "ballast_mb": 40,
            "budget_mb": 400,
            "seconds": 120.0,
            "clients": 8,
            "republish_secs": 15.0,
        },
        "fleet": {
            "nodes": 3,
            "models": 24,
            "idle_timeout": 20.0,
            "rate": 10.0,
            "seconds": 60.0,
            "cycles": 2,
            "sample_secs": 0.5,
            "hop_seconds": 2.0,
            "hop_warmup": 2.0,
            "hop_repeats": 3,
        },
    }


async def run_section(name: str, root: Path, kw: dict[str, Any]) -> dict[str, Any]:
    if name in ("gateway", "gateway_filters", "gateway_targets", "gateway_routes", "envoy_cpu", "envoy_instructions"):
        from bench import envoy_cpu, gateway, gateway_filters

        run = {"gateway": gateway.run, "envoy_cpu": envoy_cpu.run, "envoy_instructions": envoy_cpu.run_instructions}
        return await run.get(name, gateway_filters.run)(root, **kw)
    if name == "coldstart":
        from bench import coldstart

        return await coldstart.run(root, **kw)
    if name == "batching":
        from bench import batching

        return await batching.run(root, **kw)
    if name == "scale_to_zero":
        from bench import scale_to_zero

        return await scale_to_zero.run(root, **kw)
    if name == "scale":
        from bench import scale

        return await asyncio.to_thread(scale.run, root, **kw)
    if name == "native":
        from bench import native

        return await native.run(root, **kw)
    if name == "recovery":
        from bench import recovery

        return await recovery.run(root, **kw)
    if name == "keepalive_live":
        from bench import keepalive_live

        return await keepalive_live.run(root, **kw)
    if name == "churn":
        from bench import churn

        return await churn.run(root, **kw)
    if name == "fleet":
        from bench import fleet

        return await fleet.run(root, **kw)
    if name == "eviction":
        from bench import eviction_replay

        return eviction_replay.run(root, **kw)
    if name == "streaming":
        from bench import streaming

        return await streaming.run(root, **kw)
    if name in ("keepalive", "keepalive_replay"):
        from bench import keepalive_replay

        return keepalive_replay.run(root, **kw)
    raise ValueError(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short durations, few cycles (smoke test)")
    parser.add_argument(
        "--only",
        action="append",
        choices=ALL_SECTIONS,
        metavar="SECTION",
        help=f"run only this section (repeatable): {', '.join(ALL_SECTIONS)}",
    )
    parser.add_argument("--out-dir", type=Path, default=BENCH_DIR, help="where report.md, report.json, plots/ go")
    parser.add_argument(
        "--replay",
        type=Path,
        metavar="TRACE_FILE",
        help="replay the keep-alive policies over this trace (CSV lines 'model,timestamp'); implies --only "
        "keepalive_replay",
    )
    parser.add_argument(
        "--cold-start-secs",
        type=float,
        metavar="SECS",
        help="with --replay: the cold-start cost of every model in the trace (default: the example model of the "
        "same name, else 1.0)",
    )
    args = parser.parse_args(argv)
    if args.replay is not None:
        if not args.replay.is_file():
            parser.error(f"--replay {args.replay}: no such file (expected CSV lines 'model,timestamp')")
        args.only = [*(args.only or ()), "keepalive_replay"]
    elif "keepalive_replay" in (args.only or ()):
        parser.error("--only keepalive_replay needs --replay TRACE_FILE")
    sections = list(dict.fromkeys(args.only or DEFAULT_SECTIONS))
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "report.json"

    results: dict[str, Any] = {"sections": {}, "section_meta": {}}
    if args.only and json_path.exists():  # a partial run updates the sections it ran, keeps the others
        results = json.loads(json_path.read_text())
    started = time.perf_counter()
    results.update(
        {
            "command": "python -m bench"
            + (" --quick" if args.quick else "")
            + "".join(f" --only {s}" for s in args.only or () if s != "keepalive_replay" or not args.replay)
            + (f" --replay {args.replay}" if args.replay else ""),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": machine(),
            "quick": args.quick,
        }
    )
    failed = []
    p = params(args.quick)
    with tempfile.TemporaryDirectory(prefix="snooze-bench-") as tmp:
        for name in sections:
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            kw = p[name]
            if name in ("keepalive", "keepalive_replay"):  # charge the cold starts measured in this report
                kw = {**kw, "measured": results["sections"].get("coldstart")}
            if name == "keepalive_replay":
                kw = {**kw, "trace_file": args.replay, "cold_start_secs": args.cold_start_secs}
            try:
                results["sections"][name] = asyncio.run(run_section(name, Path(tmp) / name, kw))
            except Exception as exc:  # noqa: BLE001 - one broken section must not lose the others
                traceback.print_exc()
                results["sections"].pop(name, None)
                failed.append(f"{name}: {type(exc).__name__}: {exc}")
            wall = time.perf_counter() - t0
            results["section_meta"][name] = {
                "wall_s": round(wall, 1),
                "quick": args.quick,
                "finished": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            }
            print(f"[bench] {name} done in {wall:.0f} s", file=sys.stderr, flush=True)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    results["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    results["failed"] = failed

    from bench.report import markdown, write_plots

    plots = write_plots(results, out_dir / "plots")
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    text = markdown(results, plots, "plots")
    if failed:
        text += "\n## Failed sections\n\n" + "\n".join(f"- {f}" for f in failed) + "\n"
    (out_dir / "report.md").write_text(text)
    print(f"[bench] wrote {out_dir / 'report.md'} in {results['wall_s']:.0f} s", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
