"""Section doze: a preforked model's first response from doze vs from unloaded vs warm, interleaved, and the memory
each level holds (measured by bench/doze.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.markdown import ms, table
from bench.registry import Data, Rendering, RunContext, Section, register
from bench.sections import churn as churn_section

DESCRIPTIONS = {
    "numpy-linear": "the numpy example",
    "torch-mlp": "the torch example (torch imported in load())",
    "torch-conv": "a small torch conv net, torch preloaded",
    "weights-100mib": "load() reads 100 MiB of weights (np.load)",
    "onnx-mlp": "the ONNX example, onnxruntime runner in a worker (load(): onnxruntime's import and session)",
}


async def run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import doze

    return await doze.run(root, **params)


def summary(d: Data) -> list[str]:
    parts = [
        f"{m} {ms(v['doze_s']['median'])} (unloaded {ms(v['unloaded_s']['median'])}, warm {ms(v['warm_s']['median'])})"
        for m, v in d["models"].items()
    ]
    return ["- **Doze**: first response from doze, preforked, median: " + ", ".join(parts) + "."]


def markdown(d: Data, rendering: Rendering) -> list[str]:
    la = d["load_average"]
    rows = []
    for m, v in d["models"].items():
        mem = v["memory"]
        rows.append([
            f"{m} ({DESCRIPTIONS.get(m, '')})",
            " / ".join(ms(v["doze_s"][k]) for k in ("median", "p90")),
            " / ".join(ms(v[k]["median"]) if k in v else "-" for k in ("stub_wake_s", "stub_ask_s")),
            " / ".join(ms(v["unloaded_s"][k]) for k in ("median", "p90")),
            " / ".join(ms(v["warm_s"][k]) for k in ("median", "p90")),
            ms(v["load_in_process_s"]),
            f"{mem['awake']['stubs_mib'] + mem['awake']['workers_mib']:.1f}",
            f"{mem['dozing']['stubs_mib'] + mem['dozing']['workers_mib']:.1f}",
            f"{mem['dozing']['accounted_mib']:.1f}",
            f"{mem['dozing']['parents_mib']:.1f}",
        ])  # fmt: skip
    return [
        "## Doze: first response from doze, from unloaded and warm",
        "",
        f"Preforked models, {d['cycles']} cycles, the three levels in a rotating order per cycle and model (plus one "
        f"uncounted cycle), one HTTP request through the gateway on an open connection after {d['gap_secs']} s idle. "
        "`doze`: the lifecycle told the stub to doze (its worker ended), then the request forks a worker from the "
        "preloaded parent, runs load() and the request; the stub's own times: the whole wake, and its ask for the "
        "control plane's room before the fork. `unloaded`: the activator loads it through Triton. "
        "`load() in-process`: the floor. PSS of the model's stubs and workers (the preloaded parents, shared by "
        f"every preforked model, apart). Load average at the start {la['start']}, end {la['end']}.",
        "",
        table(
            [
                "model",
                "from doze median / p90",
                "in the stub: wake / its ask for room, median",
                "from unloaded median / p90",
                "warm median / p90",
                "load() in-process",
                "awake PSS (MiB)",
                "dozing PSS (MiB)",
                "dozing accounted (MiB)",
                "parents PSS (MiB)",
            ],
            rows,
        ),
        "",
        *_churn_markdown(d.get("churn")),
    ]


def _churn_markdown(churn: dict[str, Any] | None) -> list[str]:
    """The churn trace with its models in their stubs, then preforked (dozing when idle)."""
    if not churn:
        return []
    st = next(iter(churn.values()))["settings"]
    rows = [
        [
            worker,
            str(c["answers"]),
            str(c["errors"]),
            str(c["wrong_answers"]),
            f"{c['hot_p50_ms']}",
            f"{c['rest_p50_ms']}",
            str(c["cold_starts"]),
            str(c["evictions"]),
            str(c["dozes"]),
            str(c["doze_wakes"]),
            f"{c['peak_tree_pss_mib']}",
            f"{c['load_average_start']} -> {c['load_average_end']}",
        ]
        for worker, c in churn.items()
    ]
    return [
        "### The churn trace, its models in their stubs and preforked",
        "",
        f"`bench/churn.py`'s trace ({st['models']} models x {st['ballast_mb']} MiB under {st['budget_mb']:g} MiB, "
        f"{st['clients']} clients, Zipf, a republish every {st['republish_secs']:g} s, {st['seconds']:g} s, policy "
        "gdsf), once with the models in their stubs and once preforked, where an idle model dozes after "
        "`SNOOZE_DOZE_AFTER_SECS` (30 s) and a planned eviction dozes an awake model before it unloads one.",
        "",
        table(
            [
                "worker",
                "answers",
                "errors",
                "wrong",
                "hot p50 (ms)",
                "rest p50 (ms)",
                "cold starts",
                "evictions",
                "dozes",
                "wakes from doze",
                "peak tree PSS (MiB)",
                "load average",
            ],
            rows,
        ),
        "",
    ]


register(
    Section(
        name="doze",
        order=160,
        about="A preforked model's first response from doze vs from unloaded vs warm, and the memory of each level",
        params={
            "models": ["numpy-linear", "torch-conv", "torch-mlp", "weights-100mib", "onnx-mlp"],
            "cycles": 7,
            "churn": churn_section.SCENARIO,  # the churn section's scenario, the default policy only
        },
        quick={
            "models": ["numpy-linear"],
            "cycles": 2,
            "churn": churn_section.QUICK,
        },
        run=run,
        markdown=markdown,
        summary=summary,
        keys=frozenset({"cycles", "models", "load_average"}),
        default=False,
    )
)
