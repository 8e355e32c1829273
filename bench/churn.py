"""Churn: many models in little memory on one node, the eviction policies side by side.

One embedded stack (`snoozectl serve` in this process: Triton, lifecycle, activator, Envoy, API; auth on,
autoscaling off) with ``SNOOZE_MEMORY_BUDGET_MB`` set, and N custom models, each a numpy array of M MiB
touched at load (about 40 MiB more per model process on top of the stub's own). Closed-loop clients pick
models by Zipf(s) (seeded) and send one request at a time through the gateway, HTTP or gRPC at random
(tritonclient's aio clients); every answer's value is checked (model i answers x * its current scale).
Every ``republish_secs`` one model is published again with a new scale (through the control API, in Zipf
rank order: the hot models first): a request must answer in the version published when it was sent, or in a
newer one whose republish was under way while it ran (a republish's reload can finish before its call returns).

Per policy (a fresh stack each, one after the other in the same run, the same seeded traffic): answers per
second, latency p50/p99 for the three most requested models and for the rest, cold starts, evictions and
swaps per second, each unload's time from its start until the model's memory is free (timed around the
lifecycle's ``Unloader.unload``; `how`: ended or waited), and the peak resident memory of the Triton tree
(tritonserver and its model processes, sampled every 0.1 s) against the budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import ADMIN_KEY, API_KEY, fp32, gateway_urls, serving_stack, write_package
from bench.zipf import Zipf

MIB = 1024 * 1024
HOT = 3  # the most requested models, reported apart
SAMPLE_S = 0.1

MODEL_PY = """
import numpy as np

SCALE = {scale}


class Model:
    def load(self, model_dir, device):
        self.ballast = np.ones({ballast_mb} * 1024 * 1024 // 8)  # touched: resident in the model's process

    def predict(self, inputs):
        return {{"y": (inputs["x"] * SCALE).astype(np.float32)}}
"""


def _scale(index: int, version: int) -> float:
    return float(1 + index + 100 * version)


def _package(root: Path, index: int, version: int, ballast_mb: int) -> Path:
    folder = root / "packages" / f"m{index:02d}-v{version}"
    source = MODEL_PY.format(scale=_scale(index, version), ballast_mb=ballast_mb)
    return write_package(folder, source, [fp32("x", 2)], [fp32("y", 2)], warmup=False)


def _available_policies(policies: list[str]) -> tuple[list[str], list[str]]:
    """The policies this build knows (``Settings.eviction_policy``); before it existed, only LRU."""
    from controlplane.settings import Settings

    if "eviction_policy" not in Settings.model_fields:
        return [p for p in policies if p == "lru"] or ["lru"], [p for p in policies if p != "lru"]
    known, skipped = [], []
    for p in policies:
        try:
            Settings(eviction_policy=p)
            known.append(p)
        except ValueError:
            skipped.append(p)
    return known, skipped


class _Clients:
    """One HTTP and one gRPC aio client per closed-loop client."""

    def __init__(self, urls: dict[str, str]) -> None:
        import tritonclient.grpc.aio as grpcaio
        import tritonclient.http.aio as httpaio

        self.http = httpaio.InferenceServerClient(urls["http"].removeprefix("http://"), conn_timeout=120)
        self.grpc = grpcaio.InferenceServerClient(urls["grpc"])
        self._mods = {"http": httpaio, "grpc": grpcaio}

    async def infer(self, protocol: str, model: str, x: np.ndarray) -> np.ndarray:
        mod = self._mods[protocol]
        inp = mod.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        headers = {"x-api-key": API_KEY}
        if protocol == "grpc":
            result = await self.grpc.infer(model, [inp], headers=headers, client_timeout=120)
        else:
            result = await self.http.infer(model, [inp], headers=headers)
        return result.as_numpy("y")

    async def close(self) -> None:
        await self.http.close()
        await self.grpc.close()


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


class _Traffic:
    """The closed-loop clients and the republisher of one phase, and what they saw."""

    def __init__(
        self,
        root: Path,
        *,
        models: int,
        ballast_mb: int,
        zipf_s: float,
        seed: int,
        seconds: float,
        worker: str | None = None,
    ) -> None:
        self.root, self.models, self.ballast_mb, self.seed = root, models, ballast_mb, seed
        self.worker = {"worker": worker} if worker else {}  # preforked: the models doze when idle
        self.names = [f"churn-{i:02d}" for i in range(models)]
        self.popularity = Zipf(models, zipf_s)
        self.version = dict.fromkeys(self.names, 0)
        self.publishing: dict[str, int] = {}  # model -> the version its republish under way (or last) publishes
        self.rows: list[dict[str, Any]] = []
        self.republishes: list[dict[str, Any]] = []
        self.end = time.perf_counter() + seconds

    def entries(self) -> list[dict[str, Any]]:
        return [
            {"id": m, "path": _package(self.root, i, 0, self.ballast_mb), "idle_timeout_secs": 3600, **self.worker}
            for i, m in enumerate(self.names)
        ]

    async def client(self, k: int, urls: dict[str, str]) -> None:
        rng = np.random.default_rng(self.seed + k)
        conn = _Clients(urls)
        try:
            while time.perf_counter() < self.end:
                i = self.popularity.draw(rng)
                model = self.names[i]
                protocol = "grpc" if rng.random() < 0.5 else "http"
                x = np.array([[float(k + 1), float(len(self.rows) % 997)]], np.float32)
                sent = time.perf_counter()
                oldest = self.version[model]  # published when it was sent: nothing older may answer it
                row: dict[str, Any] = {"model": model, "hot": i < HOT, "protocol": protocol, "sent": sent}
                try:
                    y = await conn.infer(protocol, model, x)
                except Exception as e:  # noqa: BLE001 - an error is a result here: counted and kept
                    row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
                else:
                    # a republish under way while it ran may answer it already (its reload can finish first)
                    newest = max(self.version[model], self.publishing.get(model, 0))
                    allowed = [_scale(i, v) for v in range(oldest, newest + 1)]
                    row.update(ok=True, right=any(np.allclose(y, x * s) for s in allowed))
                    if not row["right"]:
                        row["answer"] = f"{y.tolist()} for x {x.tolist()}, allowed scales {allowed}"
                row["latency_s"] = time.perf_counter() - sent
                self.rows.append(row)
        finally:
            await conn.close()

    async def republisher(self, api_port: int, every: float) -> None:
        import httpx

        n = 0
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api_port}", timeout=120) as api:
            while True:
                await asyncio.sleep(every)
                if time.perf_counter() >= self.end:
                    return
                i, n = n % self.models, n + 1  # in Zipf rank order: the hot models first
                model = self.names[i]
                new = self.version[model] + 1
                path = _package(self.root, i, new, self.ballast_mb)
                body = {"id": model, "path": str(path), "idle_timeout_secs": 3600, **self.worker}
                started = time.perf_counter()
                self.publishing[model] = new
                r = await api.post("/v1/models:from-path", json=body, headers={"X-API-Key": ADMIN_KEY})
                ok = r.status_code < 300
                if ok:
                    self.version[model] = new  # requests sent from now on must answer in it
                self.republishes.append(
                    {
                        "model": model,
                        "ok": ok,
                        "secs": round(time.perf_counter() - started, 3),
                        "status": r.status_code,
                        **({} if ok else {"error": r.text[:300]}),
                    }
                )


def _timed_unloads(lifecycle: Any) -> list[dict[str, Any]]:
    """Time every unload from its start until the model's memory is free (``Unloader.unload`` returns then)."""
    unloads: list[dict[str, Any]] = []
    unload = lifecycle.unloader.unload

    async def timed(rec: Any) -> str:
        started = time.perf_counter()
        how = await unload(rec)
        unloads.append({"model": rec.id, "secs": time.perf_counter() - started, "how": how})
        return how

    lifecycle.unloader.unload = timed
    return unloads


async def _sample_memory(processes: Any, peak: dict[str, int]) -> None:
    """Peak RSS of the Triton tree, and of its processes without tritonserver itself, every SAMPLE_S; and the
    tree's peak proportional memory (Pss: what the budget counts, each shared page once)."""

    def sample() -> None:
        server = processes.server()
        tree = processes.tree_rss()
        peak["tree_pss"] = max(peak["tree_pss"], processes.tree_memory())
        own = 0
        if server is not None:
            with contextlib.suppress(Exception):
                own = server.memory_info().rss
        peak["tree"] = max(peak["tree"], tree)
        peak["stubs"] = max(peak["stubs"], tree - own)

    while True:
        await asyncio.to_thread(sample)
        await asyncio.sleep(SAMPLE_S)


def _total(metrics: Any, name: str, **labels: str) -> float:
    return sum(
        s.value
        for fam in metrics.collect()
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def _phase(
    root: Path,
    policy: str | None,
    *,
    models: int,
    ballast_mb: int,
    budget_mb: float,
    seconds: float,
    clients: int,
    zipf_s: float,
    republish_secs: float,
    seed: int,
    settings: dict[str, Any],
    worker: str | None = None,
) -> dict[str, Any]:
    overrides: dict[str, Any] = {**settings, "memory_budget_mb": budget_mb, "allow_local_paths": True}
    if policy is not None:
        overrides["eviction_policy"] = policy
    traffic = _Traffic(
        root, models=models, ballast_mb=ballast_mb, zipf_s=zipf_s, seed=seed, seconds=seconds, worker=worker
    )
    peak = {"tree": 0, "stubs": 0, "tree_pss": 0}
    load_avg_start = os.getloadavg()
    async with serving_stack(root / f"stack-{policy or 'lru'}", traffic.entries(), **overrides) as stack:
        urls = gateway_urls(stack)
        lifecycle = stack.lifecycle
        unloads = _timed_unloads(lifecycle)
        sampling = asyncio.create_task(_sample_memory(stack.triton_process.processes(), peak))
        traffic.end = time.perf_counter() + seconds
        started = time.perf_counter()
        try:
            await asyncio.gather(
                traffic.republisher(stack.settings.api_port, republish_secs),
                *(traffic.client(k, urls) for k in range(clients)),
            )
        finally:
            sampling.cancel()
        wall = time.perf_counter() - started
        metrics = lifecycle.metrics.registry
        cold = _total(metrics, "snooze_cold_starts_total", trigger="request")
        evictions = _total(metrics, "snooze_evictions_total", reason="memory")
        dozes = _total(metrics, "snooze_dozes_total")
        doze_wakes = _total(metrics, "snooze_wakes_total", origin="doze")
        loaded_end = sum(1 for s in lifecycle.statuses() if s.state.value == "ready")
        waited = dict(lifecycle.unloader.waited)
    return _summary(
        policy,
        traffic.rows,
        unloads,
        peak,
        traffic.republishes,
        wall=wall,
        cold=cold,
        evictions=evictions,
        loaded_end=loaded_end,
        load_avg_start=load_avg_start,
        waited=waited,
    ) | {"worker": worker or "in-stub", "dozes": int(dozes), "doze_wakes": int(doze_wakes)}


def _summary(
    policy: str | None,
    rows: list[dict[str, Any]],
    unloads: list[dict[str, Any]],
    peak: dict[str, int],
    republishes: list[dict[str, Any]],
    *,
    wall: float,
    cold: float,
    evictions: float,
    loaded_end: int,
    load_avg_start: tuple[float, ...],
    waited: dict[str, int],
) -> dict[str, Any]:
    ok = [r for r in rows if r.get("ok")]
    right = [r for r in ok if r["right"]]
    hot = [r["latency_s"] for r in right if r["hot"]]
    rest = [r["latency_s"] for r in right if not r["hot"]]
    errors = [r for r in rows if not r.get("ok")]
    ended = [u["secs"] for u in unloads if u["how"] == "ended"]
    return {
        "policy": policy or "lru",
        "seconds": round(wall, 1),
        "requests": len(rows),
        "answers": len(right),
        "answers_per_s": round(len(right) / wall, 1),
        "errors": len(errors),
        "error_examples": sorted({r["error"] for r in errors})[:5],
        "wrong_examples": [r["answer"] for r in ok if not r["right"]][:5],
        "wrong_answers": len(ok) - len(right),
        "hot_p50_ms": _pct(hot, 50),
        "hot_p99_ms": _pct(hot, 99),
        "rest_p50_ms": _pct(rest, 50),
        "rest_p99_ms": _pct(rest, 99),
        "hot_share": round(len(hot) / max(1, len(right)), 3),
        "http_share": round(sum(r["protocol"] == "http" for r in rows) / max(1, len(rows)), 3),
        "cold_starts": int(cold),
        "evictions": int(evictions),
        "swaps_per_s": round(evictions / wall, 2),
        "unloads": len(unloads),
        "unloads_ended": len(ended),
        "unloads_waited_why": waited,  # running: a thread never at rest; busy: a batch; unknown; declares_unload
        "unload_median_s": round(statistics.median(u["secs"] for u in unloads), 4) if unloads else None,
        "unload_p90_s": round(float(np.percentile([u["secs"] for u in unloads], 90)), 4) if unloads else None,
        "unload_max_s": round(max(u["secs"] for u in unloads), 4) if unloads else None,
        "peak_tree_mib": round(peak["tree"] / MIB, 1),
        "peak_model_processes_mib": round(peak["stubs"] / MIB, 1),
        "peak_tree_pss_mib": round(peak["tree_pss"] / MIB, 1),
        "loaded_at_end": loaded_end,
        "republishes": republishes,
        "republishes_ok": sum(r["ok"] for r in republishes),
        "load_average_start": [round(v, 2) for v in load_avg_start],
        "load_average_end": [round(v, 2) for v in os.getloadavg()],
    }


async def run(
    root: Path,
    *,
    models: int,
    ballast_mb: int,
    budget_mb: float,
    seconds: float,
    clients: int = 8,
    zipf_s: float = 1.0,
    republish_secs: float = 15.0,
    policies: list[str] | tuple[str, ...] = ("lru", "gdsf"),
    seed: int = 16,
    settings: dict[str, Any] | None = None,
    worker: str | None = None,
) -> dict[str, Any]:
    """``policies``: run one phase per policy (``SNOOZE_EVICTION_POLICY``) this build knows, in this order;
    ``settings``: other ``Settings`` for every phase (e.g. ``max_concurrent_loads``); ``worker``: the models'
    (``preforked``: they doze when idle)."""
    known, skipped = _available_policies(list(policies))
    phases = []
    for policy in known:
        phases.append(
            await _phase(
                root / policy,
                policy if "eviction_policy" in _settings_fields() else None,
                models=models,
                ballast_mb=ballast_mb,
                budget_mb=budget_mb,
                seconds=seconds,
                clients=clients,
                zipf_s=zipf_s,
                republish_secs=republish_secs,
                seed=seed,
                settings=settings or {},
                worker=worker,
            )
        )
    return {
        "settings": {
            "models": models,
            "ballast_mb": ballast_mb,
            "budget_mb": budget_mb,
            "seconds": seconds,
            "clients": clients,
            "zipf_s": zipf_s,
            "hot_models": HOT,
            "hot_traffic_share": round(Zipf(models, zipf_s).share(HOT), 3),
            "republish_secs": republish_secs,
            "seed": seed,
            "policies_skipped": skipped,
            "other_settings": settings or {},
            "worker": worker or "in-stub",
        },
        "policies": {p["policy"]: p for p in phases},
    }


def _settings_fields() -> set[str]:
    from controlplane.settings import Settings

    return set(Settings.model_fields)


if __name__ == "__main__":  # python -m bench.churn: the full scenario alone, JSON to stdout
    import tempfile

    with tempfile.TemporaryDirectory(prefix="snooze-churn-") as tmp:
        print(json.dumps(asyncio.run(run(Path(tmp), models=40, ballast_mb=40, budget_mb=400, seconds=120)), indent=1))
