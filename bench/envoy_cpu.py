"""What each Envoy configuration costs a warm unary request in Envoy's own CPU, with Triton taken out.

The bare hop, the gateway as served, and the gateway less each filter (``gateway_variants.VARIANTS``) or each
part of its routes (``gateway_variants.ROUTE_EDITS``), all in front of one more Envoy that answers every request
itself (``ceiling_bootstrap``: no Triton, no model, an HTTP 200 or a trailers-only gRPC OK). Only the Envoy under
test differs between targets. The number is its CPU time (user + system, /proc) over its own count of downstream
requests, per round, median over interleaved rounds at one concurrency. No throughput: the CPU a request takes moves
far less with the machine's other work than what a slice of wall time serves. The activator is not reached (the
answer is never a 404), so no serving stack is started.

``run_instructions`` (section envoy_instructions) counts the same configurations' instructions per request under
callgrind instead: the same in every run, where the CPU time moves with the machine.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

from bench._load import Job, LoadWorker
from bench.common import API_KEY
from bench.gateway_filters import KEYLESS, MODEL, PROTOCOLS, cpu_seconds
from bench.gateway_variants import ROUTE_EDITS, VARIANTS, Bootstrap, variant_bootstraps
from bench.reference_envoys import bare_envoy_bootstrap, ceiling_bootstrap
from controlplane.gateway.envoy import ApiKey, Upstream, render_bootstrap
from controlplane.gateway.envoy_process import EnvoyProcess, find_envoy
from controlplane.triton.launcher import free_port

WAKE_BUFFER = 8 * 1024 * 1024  # the served default (SNOOZE_WAKE_BUFFER_BYTES)


def configurations(root: Path, variants: tuple[str, ...], *, twin: bool) -> tuple[EnvoyProcess, dict[str, Bootstrap]]:
    """The Envoy that answers every request itself (not started), and each configuration in front of it: the bare hop,
    the bare hop with the same key check, the gateway as served (keys on), and ``variants`` (``gateway_filters``)."""
    ports = free_port(), free_port()
    upstream = EnvoyProcess(
        ceiling_bootstrap(http_port=ports[0], grpc_port=ports[1]),
        root / "upstream",
        listen=[("127.0.0.1", p) for p in ports],
        name="upstream",
    )
    http, grpc = Upstream("127.0.0.1", ports[0]), Upstream("127.0.0.1", ports[1])

    def bootstrap_of(ports: tuple[int, int], *, keys: bool = True) -> str:
        return render_bootstrap(
            host="127.0.0.1", http_port=ports[0], grpc_port=ports[1], admin_port=0,
            triton_http=http, triton_grpc=grpc, activator_http=http, activator_grpc=grpc,
            wake_buffer_bytes=WAKE_BUFFER, api_keys=[ApiKey(API_KEY, "bench")] if keys else [],
        )  # fmt: skip

    def bare(ports: tuple[int, int], key: str | None = None) -> str:
        return bare_envoy_bootstrap(
            http_port=ports[0],
            grpc_port=ports[1],
            triton_http=(http.host, http.port),
            triton_grpc=(grpc.host, grpc.port),
            key=key,
        )

    return upstream, {
        "bare_envoy": bare,
        "bare_envoy_auth": lambda ports: bare(ports, API_KEY),
        "gateway": bootstrap_of,
        **variant_bootstraps(bootstrap_of, variants, twin=twin),
    }


async def run(
    root: Path, *, seconds: float, rounds: int, concurrency: int, variants: tuple[str, ...] = (*VARIANTS, *ROUTE_EDITS)
) -> dict[str, Any]:
    """``variants``: the filters or route parts left out in turn (``gateway_variants.VARIANTS``, ``ROUTE_EDITS``)."""
    upstream, bootstraps = configurations(root, variants, twin=True)
    processes: dict[str, EnvoyProcess] = {}
    urls: dict[str, dict[str, str]] = {}
    for name, bootstrap in bootstraps.items():
        p = free_port(), free_port()
        processes[name] = EnvoyProcess(bootstrap(p), root / name, listen=[("127.0.0.1", x) for x in p], name=name)
        urls[name] = {"http": f"http://127.0.0.1:{p[0]}", "grpc": f"127.0.0.1:{p[1]}"}
    targets = list(bootstraps)
    load_start = [round(v, 2) for v in os.getloadavg()]
    runs: list[dict[str, Any]] = []
    try:
        upstream.start()
        for process in processes.values():
            process.start()
        async with LoadWorker() as worker:
            for protocol in PROTOCOLS:
                for r in range(rounds):
                    for name in targets[r % len(targets) :] + targets[: r % len(targets)]:
                        envoy = processes[name]
                        assert envoy.pid is not None
                        before = cpu_seconds(envoy.pid, tree=False), _downstream_requests(envoy)
                        job = Job(protocol, urls[name][protocol], MODEL, concurrency, seconds, headers=_headers(name))
                        result = await worker.run(job)
                        cpu, requests = cpu_seconds(envoy.pid, tree=False), _downstream_requests(envoy)
                        served = requests - before[1]
                        runs.append(
                            {
                                "round": r,
                                "protocol": protocol,
                                "target": name,
                                "requests": served,
                                "envoy_cpu_us": round((cpu - before[0]) / served * 1e6, 2) if served else None,
                                "client_errors": result.errors,
                            }
                        )
    finally:
        for process in (*processes.values(), upstream):
            process.stop()
    return {
        "settings": {"seconds": seconds, "rounds": rounds, "concurrency": concurrency, "envoy_concurrency": 2},
        "targets": targets,
        "load_average": {"start": load_start, "end": [round(v, 2) for v in os.getloadavg()]},
        "runs": runs,
        "table": _table(runs, targets),
    }


def _headers(target: str) -> dict[str, str]:
    """Keyless configurations' clients send no key (as ``gateway_filters``); the others send the bench's."""
    return {} if target in KEYLESS else {"x-api-key": API_KEY}


def _downstream_requests(envoy: EnvoyProcess) -> int:
    """Requests this Envoy's listeners took (every HTTP connection manager's ``downstream_rq_total``)."""
    return sum(v for k, v in envoy.stats().items() if k.startswith("http.") and k.endswith(".downstream_rq_total"))


def _table(runs: list[dict[str, Any]], targets: list[str]) -> list[dict[str, Any]]:
    """Per protocol and target: median Envoy CPU µs per request, and its median per-round excess over the bare hop
    of the same round."""
    by = {(x["round"], x["protocol"], x["target"]): x["envoy_cpu_us"] for x in runs}
    rows = []
    for protocol in PROTOCOLS:
        rounds = sorted({r for (r, p, _t) in by if p == protocol})
        for target in targets:
            own = [by[(r, protocol, target)] for r in rounds if by[(r, protocol, target)] is not None]
            over = [
                by[(r, protocol, target)] - by[(r, protocol, "bare_envoy")]
                for r in rounds
                if by[(r, protocol, target)] is not None and by[(r, protocol, "bare_envoy")] is not None
            ]
            rows.append(
                {
                    "protocol": protocol,
                    "target": target,
                    "envoy_cpu_us": round(statistics.median(own), 2) if own else None,
                    "over_bare_us": round(statistics.median(over), 2) if over else None,
                    "over_bare_iqr_us": [round(q, 2) for q in statistics.quantiles(over, n=4)[::2]]
                    if len(over) > 1
                    else None,
                }
            )
    return rows


# -------------------------------------------------------------------- instructions (section envoy_instructions)

VALGRIND_HINT = "apt-get install valgrind (callgrind counts the instructions; callgrind_control ships with it)"


def valgrind_missing() -> str | None:
    """Why instructions cannot be counted here, or None."""
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not found: {VALGRIND_HINT}" if missing else None


async def run_instructions(
    root: Path,
    *,
    requests: int,
    warmup_requests: int,
    repeats: int,
    concurrency: int,
    variants: tuple[str, ...] = (*VARIANTS, *ROUTE_EDITS),
) -> dict[str, Any]:
    """Each configuration's instructions per warm request, counted by callgrind: no noise from the machine's other
    work, so a part that costs 1 % of a request shows. The Envoy under test runs under valgrind with one worker, in
    front of the Envoy that answers itself; per protocol, ``warmup_requests`` first, then ``repeats`` times
    ``requests`` at ``concurrency`` between a zeroing and a dump of callgrind's counters (``callgrind_control``).
    Every thread of the process counts (its main thread's timers too). Instructions are not time (a cache miss
    costs more than an add), but the same build doing more of them per request does more work."""
    if why := valgrind_missing():
        raise RuntimeError(why)
    upstream, bootstraps = configurations(root, variants, twin=False)
    envoy_binary = find_envoy()
    runs: list[dict[str, Any]] = []
    load_start = [round(v, 2) for v in os.getloadavg()]
    try:
        upstream.start()
        async with LoadWorker() as worker:
            for name, bootstrap in bootstraps.items():
                runs += await _count_one(root / name, name, bootstrap, envoy_binary, worker,
                                         requests=requests, warmup_requests=warmup_requests, repeats=repeats,
                                         concurrency=concurrency)  # fmt: skip
    finally:
        upstream.stop()
    return {
        "settings": {
            "requests": requests,
            "warmup_requests": warmup_requests,
            "repeats": repeats,
            "concurrency": concurrency,
            "envoy_concurrency": 1,
        },  # fmt: skip
        "targets": list(bootstraps),
        "load_average": {"start": load_start, "end": [round(v, 2) for v in os.getloadavg()]},
        "runs": runs,
        "table": instructions_table(runs, list(bootstraps)),
    }


async def _count_one(
    work: Path,
    name: str,
    bootstrap: Bootstrap,
    envoy_binary: Path,
    worker: LoadWorker,
    *,
    requests: int,
    warmup_requests: int,
    repeats: int,
    concurrency: int,
) -> list[dict[str, Any]]:
    """One configuration under callgrind: its runs, per protocol and repeat."""
    work.mkdir(parents=True, exist_ok=True)
    out_prefix = work / "callgrind"
    wrapper = work / "envoy-under-callgrind"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"exec valgrind --tool=callgrind -q --callgrind-out-file={shlex.quote(str(out_prefix))}.%p "
        f'{shlex.quote(str(envoy_binary))} "$@"\n'
    )
    wrapper.chmod(0o755)
    ports = free_port(), free_port()
    envoy = EnvoyProcess(bootstrap(ports), work, listen=[("127.0.0.1", p) for p in ports], concurrency=1,
                         binary=wrapper, name=name)  # fmt: skip
    urls = {"http": f"http://127.0.0.1:{ports[0]}", "grpc": f"127.0.0.1:{ports[1]}"}
    runs = []
    envoy.start(timeout=300)  # valgrind takes Envoy's start from under a second to some 20 s
    try:
        pid = envoy.pid
        assert pid is not None
        for protocol in PROTOCOLS:

            def job(n: int, protocol: str = protocol) -> Job:
                return Job(protocol, urls[protocol], MODEL, concurrency, 600, max_requests=n, headers=_headers(name))

            await worker.run(job(warmup_requests))
            for repeat in range(repeats):
                await asyncio.to_thread(_callgrind_control, "-z", pid)
                result = await worker.run(job(requests))
                await asyncio.to_thread(_callgrind_control, "-d", pid)
                dumps = list(work.glob(f"callgrind.{pid}.*"))  # this dump's parts, read once and removed
                total = sum(_callgrind_total(f) for f in dumps)
                for dump in dumps:
                    dump.unlink()
                runs.append(
                    {
                        "protocol": protocol,
                        "target": name,
                        "repeat": repeat,
                        "requests": result.requests,
                        "errors": result.errors,
                        "first_error": result.first_error,
                        "instructions_per_request": round(total / result.requests) if result.requests else None,
                    }
                )
    finally:
        envoy.stop()
    return runs


def _callgrind_control(flag: str, pid: int) -> None:
    out = subprocess.run(["callgrind_control", flag, str(pid)], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"callgrind_control {flag} {pid} failed: {(out.stdout + out.stderr)[-500:]}")


def _callgrind_total(dump: Path) -> int:
    """The instructions a callgrind dump counted (its ``summary:`` / ``totals:`` line)."""
    for line in dump.read_text(errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise ValueError(f"{dump}: no summary line (not a callgrind dump?)")


def instructions_table(runs: list[dict[str, Any]], targets: list[str]) -> list[dict[str, Any]]:
    """Per protocol and target: median instructions per request over repeats, their spread, and the difference
    to the bare hop and to the gateway as served."""
    by: dict[tuple[str, str], list[int]] = {}
    for r in runs:
        if r["instructions_per_request"] is not None and not r["errors"]:
            by.setdefault((r["protocol"], r["target"]), []).append(r["instructions_per_request"])
    rows = []
    for protocol in PROTOCOLS:
        median = {t: statistics.median(by[(protocol, t)]) for t in targets if (protocol, t) in by}
        bare, gateway = median.get("bare_envoy"), median.get("gateway")
        for target in targets:
            own = by.get((protocol, target), [])
            value = median.get(target)
            rows.append(
                {
                    "protocol": protocol,
                    "target": target,
                    "instructions_per_request": value,
                    "spread": max(own) - min(own) if own else None,
                    "over_bare": value - bare if value is not None and bare is not None else None,
                    "over_bare_pct": round(100 * (value - bare) / bare, 2) if value is not None and bare else None,
                    "gateway_minus_this": gateway - value if value is not None and gateway is not None else None,
                }
            )
    return rows
