"""The instruction count bench (bench/envoy_cpu.py, section envoy_instructions): reading callgrind's dumps and the
table built from its runs. The fast tests read what callgrind writes; the slow one runs Envoy under callgrind."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench import envoy_cpu
from bench.envoy_cpu import _callgrind_total, instructions_table

# The head of a dump as callgrind 3.19 writes it (`callgrind_control -d`): the total is on `summary:` (older
# versions write `totals:`), one number per event; only Ir is collected here.
DUMP = """# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 3905
cmd:  envoy --config-path bare.yaml
part: 1

desc: I1 cache:
desc: Timerange: Basic block 0 - 122260774
desc: Trigger: Client Request: dump

positions: line
events: Ir
summary: 324289488

ob=(1) /usr/lib/x86_64-linux-gnu/libc.so.6
"""


@pytest.mark.parametrize("word", ["summary:", "totals:"])
def test_the_total_of_a_dump_is_read(tmp_path: Path, word: str) -> None:
    dump = tmp_path / "callgrind.3905.1"
    dump.write_text(DUMP.replace("summary:", word))
    assert _callgrind_total(dump) == 324289488


def test_a_file_without_a_total_is_an_error(tmp_path: Path) -> None:
    dump = tmp_path / "callgrind.1.1"
    dump.write_text("events: Ir\n")
    with pytest.raises(ValueError, match="no summary line"):
        _callgrind_total(dump)


def _run(protocol: str, target: str, value: int, *, repeat: int = 0, errors: int = 0) -> dict:
    return {"protocol": protocol, "target": target, "repeat": repeat, "requests": 100, "errors": errors,
            "first_error": None, "instructions_per_request": value}  # fmt: skip


def test_the_table_takes_medians_against_the_bare_hop_and_the_gateway() -> None:
    runs = [
        _run("grpc", "bare_envoy", 1000), _run("grpc", "bare_envoy", 1010, repeat=1),
        _run("grpc", "gateway", 1100), _run("grpc", "gateway", 1120, repeat=1),
        _run("grpc", "gateway_no_hints", 1050), _run("grpc", "gateway_no_hints", 9999, repeat=1, errors=3),
        _run("http", "bare_envoy", 2000), _run("http", "gateway", 2200),
    ]  # fmt: skip
    table = {(r["protocol"], r["target"]): r for r in instructions_table(runs, ["bare_envoy", "gateway",
                                                                                 "gateway_no_hints"])}  # fmt: skip
    gateway = table[("grpc", "gateway")]
    assert gateway["instructions_per_request"] == 1110 and gateway["spread"] == 20
    assert gateway["over_bare"] == 105 and gateway["over_bare_pct"] == pytest.approx(10.45, abs=0.01)
    # a run with failed requests does not count
    hints = table[("grpc", "gateway_no_hints")]
    assert hints["instructions_per_request"] == 1050 and hints["gateway_minus_this"] == 60 and hints["spread"] == 0
    assert table[("http", "gateway")]["over_bare"] == 200
    missing = table[("http", "gateway_no_hints")]
    assert missing["instructions_per_request"] is None and missing["over_bare"] is None


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(envoy_cpu.valgrind_missing() is not None, reason=str(envoy_cpu.valgrind_missing()))
def test_callgrind_counts_the_same_instructions_twice_and_the_key_check_costs_some(tmp_path: Path) -> None:
    result = asyncio.run(envoy_cpu.run_instructions(tmp_path, requests=200, warmup_requests=50, repeats=2,
                                                    concurrency=4, variants=()))  # fmt: skip
    assert not [r for r in result["runs"] if r["errors"]], result["runs"]
    rows = {(r["protocol"], r["target"]): r for r in result["table"]}
    for protocol in ("grpc", "http"):
        bare = rows[(protocol, "bare_envoy")]
        assert bare["instructions_per_request"] > 10_000
        assert bare["spread"] < 0.02 * bare["instructions_per_request"]  # counted, not timed
        assert rows[(protocol, "bare_envoy_auth")]["over_bare"] > 0
