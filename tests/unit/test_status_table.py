"""`snoozectl status` rendering: the GPU memory column appears only where the server measures GPU memory; the
keep-alive column shows the policy's current windows."""

from __future__ import annotations

import io

from rich.console import Console

from controlplane.cli.status_command import status_table

MIB = 1024 * 1024


def model(model_id: str, **status: object) -> dict:
    base = {
        "id": model_id,
        "state": "ready",
        "reason": None,
        "instances": 1,
        "last_access": None,
        "idle_timeout_secs": 300,
        "memory_bytes": 64 * MIB,
        "last_cold_start_secs": 0.5,
        "load_count": 1,
    }
    return {"id": model_id, "status": {**base, **status}}


def render(models: list[dict]) -> tuple[list[str], str]:
    table = status_table(models)
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(table)
    return [str(c.header) for c in table.columns], out.getvalue()


def row(text: str, model_id: str) -> list[str]:
    line = next(line for line in text.splitlines() if f" {model_id} " in line)
    return [cell.strip() for cell in line.strip("│┃| \n").split("│")]


BEFORE = ["model", "state", "instances", "last access", "keep-alive", "memory", "last cold start"]


def test_status_without_gpu_memory_renders_as_before():
    for models in ([model("cpu")], [model("cpu", gpu_memory_bytes=None)]):  # key absent, or null from the API
        headers, text = render(models)
        assert headers == BEFORE
        assert row(text, "cpu") == ["cpu", "ready", "1", "never", "5m", "64.0 MiB", "0.50s"]


def test_status_with_gpu_memory_shows_each_gpu_holding_some():
    models = [
        model("vision", gpu_memory_bytes={"1": 2048 * MIB, "0": 512 * MIB, "2": 0}),
        model("cpu", gpu_memory_bytes={}),
        model("asleep", state="unloaded", instances=0, memory_bytes=None, gpu_memory_bytes=None),
    ]
    headers, text = render(models)
    assert headers == [*BEFORE[:6], "GPU memory", BEFORE[6]]
    assert row(text, "vision")[6] == "gpu0 512.0 MiB, gpu1 2048.0 MiB"
    assert row(text, "cpu")[6] == "-"
    assert row(text, "asleep")[5:7] == ["-", "-"]


def test_memory_says_whether_it_is_measured_declared_or_unknown():
    models = [
        model("measured", memory_source="measured"),
        model("declared", memory_source="declared", memory_bytes=140 * MIB),
        model("unknown", memory_source=None, memory_bytes=None),
        model("asleep", state="unloaded", memory_source=None, memory_bytes=None),
    ]
    _, text = render(models)
    assert [row(text, m)[5] for m in ("measured", "declared", "unknown", "asleep")] == [
        "64.0 MiB",
        "~140.0 MiB (declared)",
        "unknown",
        "-",
    ]


def test_a_fleet_status_names_the_nodes_holding_each_model():
    models = [
        model(
            "hot",
            instances=2,
            nodes={
                "node-2": {"state": "ready", "instances": 1, "memory_bytes": 40 * MIB},
                "node-1": {"state": "loading", "instances": 1, "memory_bytes": None},
            },
        ),
        model("asleep", state="unloaded", instances=0, memory_bytes=None, nodes={}),
    ]
    headers, text = render(models)
    assert headers == [*BEFORE[:6], "nodes", BEFORE[6]]
    assert row(text, "hot")[6] == "node-1 loading, node-2 40.0 MiB"
    assert row(text, "asleep")[6] == "-"


def _windows(policy: str, *, pattern: bool = False, samples: int = 0, keep: float = 300,
             prewarm: float | None = None) -> dict:  # fmt: skip
    """What the server's keep-alive policy reports (``FixedKeepAlive.windows()``)."""
    w = {
        "policy": policy,
        "pattern": pattern,
        "reason": "",
        "samples": samples,
        "keep_alive_secs": keep,
        "prewarm_after_secs": prewarm,
        "prewarm_loads": 0,
        "prewarm_used": 0,
        "prewarm_wasted": 0,
        "prewarmed_unused": False,
    }
    return w | ({"min_samples": 10} if policy == "adaptive" else {})


def test_keep_alive_column_shows_the_policy_and_its_current_windows():
    models = [
        model("fixed", keep_alive=_windows("fixed")),
        model("learning", keep_alive=_windows("adaptive", samples=3)),
        model("periodic", keep_alive=_windows("adaptive", pattern=True, samples=40, keep=690.04, prewarm=540.3)),
        model("seconds", keep_alive=_windows("adaptive", pattern=True, samples=5, keep=30, prewarm=6.2049)),
        model("daily", keep_alive=_windows("adaptive", pattern=True, samples=20, keep=95040, prewarm=77760)),
        model("bursty", keep_alive=_windows("adaptive", pattern=True, samples=128, keep=45)),
        model("sparse", keep_alive=_windows("adaptive", pattern=True, samples=12, keep=30), idle_timeout_secs=60),
    ]
    _, text = render(models)
    assert [row(text, m)[4] for m in ("fixed", "learning", "periodic", "seconds", "daily", "bursty", "sparse")] == [
        "fixed 5m",
        "learning 3/10 (5m)",
        "adaptive: pre-warm +9m, keep +11.5m",
        "adaptive: pre-warm +6.2s, keep +30s",
        "adaptive: pre-warm +21.6h, keep +26.4h",
        "adaptive: keep +45s",
        "adaptive: keep +30s",
    ]


def test_a_preloaded_parent_gets_a_line_of_its_own():
    from controlplane.cli.status_command import _parent_line

    parent = {"pid": 42, "preload": ["numpy", "torch"], "memory_bytes": 230 * MIB, "workers": 3, "failed": {}}
    assert _parent_line(parent) == "preloaded parent pid 42 (numpy, torch): 230.0 MiB, 3 worker(s)"
    parent["failed"] = {"torchvision": "ModuleNotFoundError: No module named 'torchvision'"}
    assert _parent_line(parent).endswith(", could not import torchvision")


def test_an_80_column_terminal_cuts_no_header_and_a_long_failure_goes_below_the_table():
    from controlplane.cli.status_command import _failure_lines

    reason = (
        "[snooze:model_error] model 'text-features': load raised ModuleNotFoundError: No module named 'sklearnx' "
        "at snooze_model.py:9 in load; install the missing package\nTraceback (most recent call last):\n  ..."
    )
    models = [model("numpy-linear", last_access=1.0), model("text-features", state="failed", reason=reason)]
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(status_table(models))
    text = out.getvalue()
    assert "…" not in text, text  # no header word (instances, keep-alive, ...) is cut
    assert "sklearnx" not in text  # the state cell says 'failed'; the reason is below
    assert row(text, "text-features")[1] == "failed"
    (line,) = _failure_lines(models)
    assert line.startswith("text-features: [snooze:model_error] model 'text-features': load raised ModuleNotFoundError")
    assert line.endswith("… (more: --json)") and "Traceback" not in line and len(line) < 140


def test_the_wake_queue_line_shows_each_waiting_load_and_is_absent_when_none_waits():
    from controlplane.cli.status_command import _wake_queue_line

    queue = {
        "length": 2,
        "oldest_wait_secs": 3.2,
        "wait_bound_secs": 10.0,
        "waiting": [
            {"model": "m1", "waiting_for": "a load slot", "wait_secs": 3.2},
            {"model": "m2", "waiting_for": "memory", "wait_secs": 0.4},
        ],
    }
    assert _wake_queue_line(queue) == (
        "wake queue: 2 load(s) waiting to start (a request waits at most 10s for its load to start): "
        "m1 (a load slot, 3.2s), m2 (memory, 0.4s)"
    )
    assert _wake_queue_line({"length": 0, "waiting": [], "wait_bound_secs": 10.0}) is None
    assert _wake_queue_line(None) is None  # an older server without the wake queue


def test_the_warm_up_column_says_its_source_and_a_skipped_one_says_why_below_the_table():
    from controlplane.cli.status_command import _failure_lines

    skipped = 'skipped (signature input [1,3,1,1] failed: ...; ship samples or set "warmup": false)'
    models = [model("det", warmup=skipped), model("vit", warmup="learned"), model("off")]
    headers, text = render(models)
    assert headers == [*BEFORE[:-1], "warm-up", "last cold start"]
    assert row(text, "det")[-2] == "skipped" and row(text, "vit")[-2] == "learned" and row(text, "off")[-2] == "-"
    assert _failure_lines(models) == [f"det: warmup: {skipped}"]
    assert render([model("old")])[0] == BEFORE  # a server without warm-up sources: no column


def test_a_dozing_model_says_so_in_its_state():
    _, text = render([model("dozer", level="dozing", memory_bytes=20 * MIB), model("awake", level="awake")])
    assert row(text, "dozer")[1:2] == ["ready (dozing)"] and row(text, "dozer")[5] == "20.0 MiB"
    assert row(text, "awake")[1] == "ready"
