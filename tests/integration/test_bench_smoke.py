"""`python -m bench --quick`: every section runs against the real embedded stack and the report, its
plots and its JSON come out. Numbers are not asserted (this machine is shared and quick mode is short).

The default tier runs the sections whose behaviour no other test drives; recovery, keepalive_live, streaming,
churn and fleet repeat scenarios that tests/reliability, test_keepalive_live, tests/integration/gateway,
tests/model/test_fast_unload.py and the fleet tests assert, so their bench code runs in the `slow` tier
(`pytest -m slow tests/integration/test_bench_smoke.py`) and in `make bench`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration

SECTION_KEYS = {
    "gateway": {"rows", "ratios", "gateway_retries_during_run", "settings"},
    "gateway_filters": {"table", "runs", "load_average", "gateway_lua_executions", "large"},
    "gateway_targets": {"table", "runs", "load_average", "gateway_lua_executions"},
    "gateway_routes": {"table", "runs", "load_average", "gateway_lua_executions"},
    "envoy_cpu": {"table", "runs", "load_average", "settings"},
    "coldstart": {"cycles", "models"},
    "batching": {"settings", "models", "runtime_vs_handwritten"},
    "scale_to_zero": {"rss_mib", "after_vs_before", "after_within_5pct_of_before", "samples", "events_s"},
    "scale": {"models", "render", "validate_static", "control_plane"},
    "recovery": {"cycles", "load_average", "topologies"},
    "keepalive_live": {"period_s", "idle_timeout_s", "requests", "policies"},
    "fleet": {"settings", "phases", "policies", "ratios", "hop", "load_average"},
    "churn": {"settings", "policies"},
    "streaming": {"cold_ms", "tokens_per_s", "grpc_gateway_over_direct", "warm_first_token_ms", "open_stream"},
    "eviction": {"traces", "default_policy", "budget_mib", "ok"},
}
# Scenarios other tests assert: tests/reliability (recovery), test_keepalive_live, tests/integration/gateway (streams),
# tests/model/test_fast_unload.py and test_memory_budget (churn), tests/reliability/test_fleet.py and
# tests/integration/test_fleet_gateway.py (fleet: 23 s of the default tier's 125 s run).
SLOW_SECTIONS = (
    "recovery", "keepalive_live", "streaming", "churn", "gateway_filters", "gateway_targets", "gateway_routes",
    "envoy_cpu", "fleet",
)  # fmt: skip
FAST_SECTIONS = tuple(s for s in SECTION_KEYS if s not in SLOW_SECTIONS) + ("keepalive",)


def run_quick(tmp_path: Path, sections: tuple[str, ...], *, timeout: float = 400) -> tuple[dict, str]:
    """`python -m bench --quick --only ...`: the report's JSON and markdown, after checking the run."""
    if not (ROOT / "examples" / "models" / "onnx-mlp" / "model.onnx").is_file():
        pytest.skip("examples/models/onnx-mlp/model.onnx missing: run `make examples`")
    out = tmp_path / "bench"
    only = [arg for section in sections for arg in ("--only", section)]
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out-dir", str(out), *only],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = out / "report.md"
    assert report.is_file()
    data = json.loads((out / "report.json").read_text())
    assert data["failed"] == []
    assert {"machine", "sections", "wall_s", "quick"} <= set(data)
    assert {"cpu_model", "cores", "python"} <= set(data["machine"])
    assert set(sections) <= set(data["sections"]), set(data["sections"])
    for section in sections:
        assert SECTION_KEYS.get(section, set()) <= set(data["sections"][section]), section
    return data, report.read_text()


@pytest.mark.timeout(420)
def test_bench_quick_writes_report_plots_and_json(tmp_path: Path) -> None:
    data, text = run_quick(tmp_path, FAST_SECTIONS)
    out = tmp_path / "bench"
    for plot in ("gateway", "coldstart", "batching", "scale_to_zero"):
        png = out / "plots" / f"{plot}.png"
        assert png.is_file() and png.stat().st_size > 1000, plot
        assert f"plots/{plot}.png" in text
    rows = data["sections"]["gateway"]["rows"]
    assert {r["target"] for r in rows} == {"direct", "bare_envoy", "gateway", "client_ceiling"}
    assert {(r["protocol"], r["concurrency"]) for r in rows} == {(p, c) for p in ("grpc", "http") for c in (1, 8, 32)}
    coldstart = data["sections"]["coldstart"]["models"]
    assert set(coldstart) == {"numpy-linear", "torch-mlp-preforked", "torch-conv-preforked", "onnx-mlp"}
    assert all(m["prewarmed_first_s"]["n"] == 1 and m["warm_s"]["n"] == 1 for m in coldstart.values())
    validated = data["sections"]["scale"]["validate_static"]
    assert validated["ok"] and validated["cli_exit_code"] == 0
    memory = data["sections"]["coldstart"]["memory"]["torch-mlp-preforked"]
    assert memory["2_loaded"]["processes"] == 5  # two stubs, two workers, one preloaded parent
    runtime_cost = data["sections"]["batching"]["runtime_vs_handwritten"]
    assert runtime_cost["c1"]["errors"] == runtime_cost["c32"]["errors"] == 0
    assert runtime_cost["c1"]["runtime_rps"] > 0 and runtime_cost["c32"]["handwritten_rps"] > 0
    assert {"added_ms_c1_met", "ratio_c32_met"} <= set(runtime_cost["targets"])
    micro = runtime_cost["execute_inprocess"]
    assert micro["batch_1"]["runtime_us"] > 0 and micro["batch_1"]["handwritten_us"] > 0 and "watchdog_us" in micro
    assert "snoozeml's runtime vs a hand-written python-backend model" in text
    assert set(data["sections"]["eviction"]["traces"]) == {"zipf-1.0", "zipf-0.8", "zipf-1.2", "scan", "shifting"}
    assert "## Eviction policies replayed in virtual time" in text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_quick_recovery_and_live_keepalive(tmp_path: Path) -> None:
    data, text = run_quick(tmp_path, SLOW_SECTIONS, timeout=580)
    assert set(data["sections"]["recovery"]["topologies"]) == {"embedded", "two_process"}
    assert "## Recovery after a model process dies, per topology" in text
    assert set(data["sections"]["keepalive_live"]["policies"]) == {"adaptive", "fixed"}
    assert "## Keep-alive in the real stack: a periodic caller, adaptive vs fixed" in text
    churn = data["sections"]["churn"]
    assert set(churn["policies"]) == {"lru", "gdsf"}
    for p in churn["policies"].values():
        assert p["requests"] > 0 and p["wrong_answers"] == 0, p  # every answer's value is checked
        assert p["unloads"] == 0 or p["unloads_ended"] > 0, p  # evictions end the model's processes
    assert "## Churn: many models in little memory, the eviction policies side by side" in text
    assert data["sections"]["streaming"]["open_stream"]["tokens"] == 6
    assert "## Streaming: generate_stream (SSE) and gRPC streams of a decoupled model" in text
    filters = data["sections"]["gateway_filters"]
    assert {row["target"] for row in filters["table"]} >= {"direct", "bare_envoy", "gateway", "gateway_no_wake"}
    assert all(row["errors"] == 0 for row in filters["table"]), filters["table"]
    assert set(filters["large"]["errors"].values()) == {0}, filters["large"]
    assert "MiB gRPC ModelInfer" in text
    assert "## What each gateway filter costs a warm unary request" in text
    targets = data["sections"]["gateway_targets"]
    # the bare hop with the gateway's key check beside the keyed gateway; the keyless gateway as `make serve` runs it
    assert [row["target"] for row in targets["table"]][:6] == [
        "direct", "bare_envoy", "bare_envoy_auth", "gateway", "gateway_twin", "gateway_no_auth",
    ]  # fmt: skip
    assert targets["large"] is None  # not measured in this section
    routes = data["sections"]["gateway_routes"]["table"]
    assert {"direct_with_id", "gateway_no_retry", "gateway_no_gate"} <= {row["target"] for row in routes}
    for row in (*targets["table"], *routes):
        assert row["errors"] == 0, row
        # every Envoy target's own CPU per request is measured; direct has none
        assert ("envoy" in row["c32_cpu_us"]) == (row["target"] not in ("direct", "direct_with_id")), row
        assert row["c32_cpu_us"]["triton"] > 0, row
    assert "## The gateway against a bare Envoy hop, many rounds" in text
    envoy_cpu = data["sections"]["envoy_cpu"]["table"]
    assert {"bare_envoy", "gateway", "gateway_twin", "gateway_no_retry", "gateway_no_hints"} <= {
        row["target"] for row in envoy_cpu
    }
    assert all(row["envoy_cpu_us"] and row["envoy_cpu_us"] > 0 for row in envoy_cpu), envoy_cpu
    assert "## Each gateway configuration's own CPU per request, Triton taken out" in text
    fleet = data["sections"]["fleet"]
    assert [p["policy"] for p in fleet["phases"]] == ["affine", "round_robin"]
    assert all(p["requests"] == fleet["settings"]["trace_requests"] and p["samples"] for p in fleet["phases"])
    assert set(fleet["policies"]) == {"affine", "round_robin"} and "mean_memory_affine_vs_rr" in fleet["ratios"]
    assert set(fleet["hop"]["ratios"]) == {f"{p}_c{c}" for p in ("grpc", "http") for c in (1, 8)}
    assert "## Fleet: model-affine routing vs round robin over the same nodes" in text
    assert (tmp_path / "bench" / "plots" / "fleet.png").is_file()
