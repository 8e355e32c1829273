"""Section fleet: model-affine routing against round robin over the same nodes and the same Zipf trace, and the
price of the fleet hop (measured by bench/fleet.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.markdown import table
from bench.plotting import pyplot, save
from bench.registry import Data, Rendering, RunContext, Section, register

POLICY_COLORS = {"affine": "#4c72b0", "round_robin": "#dd8452"}


async def run(root: Path, params: dict[str, Any], ctx: RunContext) -> Data:
    from bench import fleet

    return await fleet.run(root, **params)


def plot(res: Data, path: Path) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(8, 5.4), sharex=True)
    seen: dict[str, int] = {}
    for phase in res["phases"]:
        policy = phase["policy"]
        seen[policy] = seen.get(policy, 0) + 1
        t = [s[0] for s in phase["samples"]]
        style = "-" if seen[policy] == 1 else "--"
        label = f"{policy} #{seen[policy]}"
        axes[0].plot(t, [s[1] for s in phase["samples"]], style, color=POLICY_COLORS[policy], lw=1.2, label=label)
        axes[1].plot(t, [s[2] for s in phase["samples"]], style, color=POLICY_COLORS[policy], lw=1.2, label=label)
    st = res["settings"]
    axes[0].set_ylabel("loaded instances\n(all nodes)")
    axes[1].set_ylabel("memory of loaded\nmodels (MiB)")
    axes[1].set_xlabel("seconds into the phase (same trace every phase)")
    axes[0].set_title(
        f"{st['nodes']} nodes, {st['models']} models, Zipf s={st['zipf_s']}, {st['rate_rps']:g} req/s, "
        f"idle_timeout {st['idle_timeout_secs']:g} s",
        fontsize=10,
    )
    for ax in axes:
        ax.axvline(st["seconds"], color="black", lw=0.6, ls=":")
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=7, loc="lower right")
    return save(fig, path)


def summary(f: Data) -> list[str]:
    return [_fleet_summary(f)]


def _fleet_summary(f: dict[str, Any]) -> str:
    st, a, r, hop = f["settings"], f["policies"]["affine"], f["policies"]["round_robin"], f["hop"]["ratios"]
    return (
        f"- **Fleet** ({st['nodes']} nodes, {st['models']} models, Zipf s={st['zipf_s']} at {st['rate_rps']:g} req/s, "
        f"idle_timeout {st['idle_timeout_secs']:g} s, same trace): model-affine routing held "
        f"{a['mean_memory_mib']:.0f} MiB of loaded models on average vs {r['mean_memory_mib']:.0f} MiB for round robin "
        f"(**{f['ratios']['mean_memory_affine_vs_rr']:.2f}x**, second half of the trace "
        f"{f['ratios']['second_half_memory_affine_vs_rr']:.2f}x; peak {a['peak_memory_mib']:.0f} vs "
        f"{r['peak_memory_mib']:.0f} MiB, instances {a['mean_instances']:.1f} vs {r['mean_instances']:.1f}), "
        f"client-visible cold starts {a['client_cold_starts']} vs {r['client_cold_starts']}, p50 / p99 "
        f"{a['p50_ms']:.1f} / {a['p99_ms']:.0f} ms vs {r['p50_ms']:.1f} / {r['p99_ms']:.0f} ms. The fleet hop adds "
        f"{hop['grpc_c1']['added_p50_ms']:.2f} ms p50 at c=1 (gRPC; HTTP {hop['http_c1']['added_p50_ms']:.2f} ms), "
        f"throughput vs the node's own gateway {hop['grpc_c1']['throughput_fleet_vs_node']:.2f} (c=1) / "
        f"{hop['grpc_c8']['throughput_fleet_vs_node']:.2f} (c=8)."
    )


_FLEET_COLUMNS = {
    "requests": "requests",
    "errors": "errors",
    "client_cold_starts": "client cold starts",
    "slow_requests": "slow",
    "request_loads": "loads by traffic",
    "idle_unloads": "idle unloads",
}


def _fleet_reading(f: dict[str, Any]) -> list[str]:
    """Why the policies differ, in this run's numbers."""
    st, a, r = f["settings"], f["policies"]["affine"], f["policies"]["round_robin"]
    last_affine = next(ph for ph in reversed(f["phases"]) if ph["policy"] == "affine")
    spills = a["placements"] - st["models"]
    lines = [
        f"Reading: round robin sends every node 1/{st['nodes']} of each model's requests, so every node ends up "
        f"holding most models ({r['placements']} (node, model) pairs loaded at some point vs {a['placements']} for "
        f"{st['models']} models), and a model whose requests on one node come further apart than idle_timeout is "
        f"unloaded and woken again there (idle unloads {r['idle_unloads']} vs {a['idle_unloads']}, loads by traffic "
        f"{r['request_loads']} vs {a['request_loads']})."
        + (
            f" Affine's {spills} pair(s) beyond one per model are bounded-load spills (a node with requests waiting "
            "on a cold start hands the next request to the next node of the ring)."
            if spills > 0
            else ""
        )
        + " The ring balances model names, not traffic: models held per node at the end of the last affine phase "
        f"{', '.join(map(str, last_affine['models_per_node_end']))}; loads by traffic per node "
        f"{', '.join(map(str, a['loads_per_node']))} (affine) vs {', '.join(map(str, r['loads_per_node']))} "
        "(round robin).",
        "",
    ]
    if a["p99_ms"] > r["p99_ms"]:
        lines[-2] += " " + _fleet_p99_reading(a, r)
    return lines


def _fleet_p99_reading(a: dict[str, Any], r: dict[str, Any]) -> str:
    """Why affine's p99 can be above round robin's with fewer cold starts, from what this run measured."""
    text = (
        "Affine's p99 is higher although it has fewer cold starts: under both policies p99 falls among the slow "
        f"requests ({100 * a['slow_requests'] / a['requests']:.1f}% and "
        f"{100 * r['slow_requests'] / r['requests']:.1f}% of all requests)"
    )
    if (a["slow_median_ms"] or 0) > (r["slow_median_ms"] or 0):
        text += f", and affine's slow requests wait longer (median {a['slow_median_ms']} vs {r['slow_median_ms']} ms)"
    else:
        text += (
            f"; their medians are close ({a['slow_median_ms']} vs {r['slow_median_ms']} ms) and the tail decides "
            f"(slowest {a['slow_max_ms']} vs {r['slow_max_ms']} ms)"
        )
    share = {k: max(v["loads_per_node"]) / max(1, sum(v["loads_per_node"])) for k, v in (("a", a), ("r", r))}
    if share["a"] > share["r"]:
        text += (
            f". Affine's loads pile up on fewer nodes (the busiest node ran {100 * share['a']:.0f}% of them vs "
            f"{100 * share['r']:.0f}%) and a node's loads share its load slots (max_concurrent_loads) and its "
            "cores, so a cold request there can wait for other models' loads before its own"
        )
    return text + "."


def markdown(f: Data, rendering: Rendering) -> list[str]:
    st, pol, ratios = f["settings"], f["policies"], f["ratios"]
    lines = [
        "## Fleet: model-affine routing vs round robin over the same nodes",
        "",
        f"{st['nodes']} nodes (`snoozectl serve` each: embedded Triton, control plane, node gateway; auth on, "
        f"autoscaling off) over one store of {st['models']} tiny models ({st['model']}), idle_timeout "
        f"{st['idle_timeout_secs']:g} s; two fleet gateways over the same nodes: `affine` (ring hash on the model "
        f"name, hash_balance_factor {st['hash_balance_factor']}) and `round_robin`. One seeded trace "
        f"({st['trace_requests']} requests in {st['seconds']:g} s: {st['traffic']}; Zipf s={st['zipf_s']}, "
        f"requests per model from the most to the least requested: {', '.join(map(str, st['requests_per_model']))}) "
        f"replayed through each gateway in turn ({' -> '.join(st['order'])}), every node unloading every model "
        f"before each phase. Loaded instances and their measured memory (RSS of the models' processes, summed over "
        f"the nodes) sampled every {st['sample_interval_secs']:g} s; client-visible cold starts are the nodes' "
        "`snooze_wake_waits_total` (requests that waited for a wake), loads by traffic their "
        '`snooze_cold_starts_total{trigger="request"}`; slow = latency above '
        f"{st['cold_threshold_ms']:g} ms (10x the run's median, at least 100 ms), a cross-check. Nodes started in "
        f"{st['startup_s']:g} s; load average at the start {f['load_average_start']}, at the end {f['load_average']}.",
        "",
        table(
            [
                "policy",
                "phases",
                *_FLEET_COLUMNS.values(),
                "(node, model) pairs loaded",
                "mean / peak instances",
                "mean / peak MiB",
                "second-half mean MiB",
                "p50 ms",
                "p99 ms",
                "slow: median / max ms",
            ],
            [
                [
                    name,
                    p["phases"],
                    *(p[k] for k in _FLEET_COLUMNS),
                    p["placements"],
                    f"{p['mean_instances']} / {p['peak_instances']}",
                    f"{p['mean_memory_mib']:.0f} / {p['peak_memory_mib']:.0f}",
                    f"{p['second_half_mean_memory_mib']:.0f}",
                    p["p50_ms"],
                    p["p99_ms"],
                    f"{p['slow_median_ms']} / {p['slow_max_ms']}",
                ]
                for name, p in pol.items()
            ],
        ),
        "",
        f"**affine / round robin**: mean memory **{ratios['mean_memory_affine_vs_rr']}** (second half of the trace, "
        f"the ramp from empty left out: {ratios['second_half_memory_affine_vs_rr']}), peak memory "
        f"{ratios['peak_memory_affine_vs_rr']}, mean instances {ratios['mean_instances_affine_vs_rr']}, client-visible "
        f"cold starts {ratios['client_cold_starts_affine_vs_rr']}, p99 {ratios['p99_affine_vs_rr']}.",
        "",
        *_fleet_reading(f),
    ]
    lines += _phase_lines(f)
    lines += rendering.image("fleet", "fleet")
    return lines + _hop_lines(f["hop"])


def _phase_lines(f: Data) -> list[str]:
    return [
        "Per phase (the time means and peaks cover the trace's duration; `client late` is how far behind its "
        "schedule the open-loop client sent a request at worst, and with the load average it shows other work on "
        "this shared machine):",
        "",
        table(
            [
                "#",
                "policy",
                *_FLEET_COLUMNS.values(),
                "mean / peak instances",
                "mean / peak MiB",
                "p50 ms",
                "p99 ms",
                "mean load s",
                "loads per node",
                "models held per node at the end",
                "client late max ms",
                "load average (1 min) at the end",
            ],
            [
                [
                    i + 1,
                    ph["policy"],
                    *(ph[k] for k in _FLEET_COLUMNS),
                    f"{ph['mean_instances']} / {ph['peak_instances']}",
                    f"{ph['mean_memory_mib']:.0f} / {ph['peak_memory_mib']:.0f}",
                    ph["p50_ms"],
                    ph["p99_ms"],
                    ph["mean_load_s"],
                    ", ".join(map(str, ph["loads_per_node"])),
                    ", ".join(map(str, ph["models_per_node_end"])),
                    ph["max_client_late_ms"],
                    ph["load_average_1m"],
                ]
                for i, ph in enumerate(f["phases"])
            ],
        ),
        "",
    ]


def _hop_lines(hop: Data) -> list[str]:
    lines: list[str] = []
    hs = hop["settings"]
    by = {(r["protocol"], r["concurrency"], r["target"]): r for r in hop["rows"]}
    lines += [
        "### The price of the fleet hop",
        "",
        f"Model {hop['model']} warm on its owner {hop['owner']}; closed loop, {hs['seconds']:g} s per cell after "
        f"{hs['warmup_secs']:g} s of warm-up per target, repeats: {hs['repeats']}, the two targets interleaved "
        "(order alternating), medians of the repeats. `fleet` = through the affine fleet gateway (which then "
        "goes to a node's gateway), `node` = straight to the owner node's gateway. Nodes holding the model after "
        f"the cells: {', '.join(hop['holders_after'])}"
        + (
            " (at c=8 the fleet gateway's bounded load spilled the one hot model onto another node, so the fleet "
            "column at c=8 is served by more than one node)."
            if len(hop["holders_after"]) > 1
            else "."
        ),
        "",
        table(
            [
                "protocol",
                "c",
                "fleet req/s",
                "node req/s",
                "throughput fleet / node",
                "fleet p50 ms",
                "node p50 ms",
                "added p50 ms",
                "added p99 ms",
                "errors",
            ],
            [
                [
                    protocol,
                    c,
                    by[(protocol, c, "fleet")]["rps"],
                    by[(protocol, c, "node")]["rps"],
                    v["throughput_fleet_vs_node"],
                    by[(protocol, c, "fleet")]["p50_ms"],
                    by[(protocol, c, "node")]["p50_ms"],
                    v["added_p50_ms"],
                    v["added_p99_ms"],
                    by[(protocol, c, "fleet")]["errors"] + by[(protocol, c, "node")]["errors"],
                ]
                for key, v in hop["ratios"].items()
                for protocol, c in [(key.split("_c")[0], int(key.split("_c")[1]))]
            ],
        ),
        "",
    ]
    return lines


register(
    Section(
        name="fleet",
        order=120,
        about="model-affine routing vs round robin over the same nodes and Zipf trace; the fleet hop's price",
        params={
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
        quick={
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
        run=run,
        markdown=markdown,
        summary=summary,
        plot=plot,
        keys=frozenset({"settings", "phases", "policies", "ratios", "hop", "load_average", "load_average_start"}),
    )
)
