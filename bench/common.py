"""Shared pieces of the benchmark: machine label, generated packages, the serving stack under test,
the in-process ceiling of a model's `predict`."""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "models"
API_KEY = "bench-infer-key"
ADMIN_KEY = "bench-admin-key"
# BLAS pinned to one thread in every process of the run (set by bench/__main__.py before numpy loads;
# Triton, its stubs and the in-process ceiling inherit it): a predict costs the same everywhere.
BLAS_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average": [round(v, 2) for v in os.getloadavg()],
    }


def machine_label(m: dict[str, Any]) -> str:
    return f"{m['cpu_model']}, {m['cores']} cores, {m['memory_gib']} GiB, Python {m['python']}"


# ------------------------------------------------------------------------------ packages


ECHO_PY = """
class Model:
    def load(self, model_dir, device):
        pass

    def predict(self, inputs):
        return {"y": inputs["x"] * 2}
"""

MATMUL_PY = """
import numpy as np


class Model:
    \"\"\"{layers} dense layers of width {width} (tanh): a realistic per-batch compute cost in numpy.\"\"\"

    def load(self, model_dir, device):
        rng = np.random.default_rng(0)
        self.weights = [rng.standard_normal(({width}, {width})).astype(np.float32) / {width} ** 0.5
                        for _ in range({layers})]

    def predict(self, inputs):
        h = inputs["x"]
        for w in self.weights:
            h = np.tanh(h @ w)
        return {{"y": h[:, :4].copy()}}
"""


def write_package(folder: Path, source: str, inputs: list[dict], outputs: list[dict], **manifest: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "snooze_model.py").write_text(textwrap.dedent(source).lstrip())
    (folder / "snooze_model.json").write_text(json.dumps({"inputs": inputs, "outputs": outputs, **manifest}))
    return folder


def fp32(name: str, *dims: int) -> dict[str, Any]:
    return {"name": name, "datatype": "FP32", "dims": list(dims)}


def echo_package(folder: Path) -> Path:
    """The cheapest possible custom model: y = 2x on 4 floats."""
    return write_package(folder, ECHO_PY, [fp32("x", 4)], [fp32("y", 4)])


MATMUL_WIDTH = 256


def calibrate_matmul_layers(target_ms: float = 1.0, batch: int = 8) -> tuple[int, float]:
    """How many layers make predict on a batch of `batch` cost about `target_ms` here (one BLAS thread)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((MATMUL_WIDTH, MATMUL_WIDTH)).astype(np.float32)
    x = rng.standard_normal((batch, MATMUL_WIDTH)).astype(np.float32)
    best = float("inf")
    for _ in range(30):  # the best of many short rounds: robust to other load on a shared machine
        start = time.perf_counter()
        for _ in range(20):
            np.tanh(x @ w)
        best = min(best, (time.perf_counter() - start) / 20)
    per_layer_ms = best * 1000
    layers = max(1, round(target_ms / per_layer_ms))
    return layers, per_layer_ms * layers


def matmul_package(folder: Path, layers: int) -> Path:
    source = MATMUL_PY.format(layers=layers, width=MATMUL_WIDTH)
    return write_package(folder, source, [fp32("x", MATMUL_WIDTH)], [fp32("y", 4)])


# ------------------------------------------------------------------------------ in-process ceiling

_CEILING = r"""
import importlib.util, json, sys, time
import numpy as np
package, params, batches = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
seconds, width = float(sys.argv[4]), int(sys.argv[5])
sys.path.insert(0, package)
spec = importlib.util.spec_from_file_location("snooze_model", package + "/snooze_model.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
model = module.Model(**params)
model.load(package, "cpu")
out = {}
for batch in batches:
    x = np.ones((batch, width), dtype=np.float32)
    for _ in range(20):
        model.predict({"x": x})
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:  # best of short rounds: the ceiling, not the machine's other load
        start = time.perf_counter()
        for _ in range(10):
            model.predict({"x": x})
        best = min(best, (time.perf_counter() - start) / 10)
    out[str(batch)] = {"rows_per_s": batch / best, "ms_per_call": 1000 * best}
print(json.dumps(out))
"""


def inprocess_ceiling(
    package: Path, batches: list[int], seconds: float, width: int, params: dict[str, Any] | None = None
) -> dict[int, dict[str, float]]:
    """The same `predict`, same batch sizes, no server: in a fresh interpreter with the run's environment
    (the one Triton's stubs inherit), so that the bench process's own state does not count."""
    cmd = [
        sys.executable,
        "-c",
        _CEILING,
        str(package),
        json.dumps(params or {}),
        json.dumps(sorted(set(batches))),
        str(seconds),
        str(width),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60 + 2 * seconds * len(batches), check=True)
    return {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


# ------------------------------------------------------------------------------ the stack under test


def models_toml(entries: list[dict[str, Any]]) -> str:
    lines = []
    for e in entries:
        lines.append("[[models]]")
        for k, v in e.items():
            lines.append(f"{k} = {json.dumps(str(v) if isinstance(v, Path) else v)}")
        lines.append("")
    return "\n".join(lines)


@contextlib.asynccontextmanager
async def serving_stack(root: Path, entries: list[dict[str, Any]], **overrides: Any) -> AsyncIterator[Any]:
    """`snoozectl serve` in this process (Triton, lifecycle, activator, Envoy, API) on free loopback
    ports, auth on, autoscaling off (instance counts must not change under a measurement)."""
    from controlplane.settings import Settings
    from controlplane.stack import ServingStack
    from controlplane.triton.launcher import free_port

    models_dir = root / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    (models_dir / "models.toml").write_text(models_toml(entries))
    settings = Settings(
        **{
            "work_dir": root / "work",
            "http_port": free_port(),
            "grpc_port": free_port(),
            "api_port": free_port(),
            "api_keys": [API_KEY],
            "admin_keys": [ADMIN_KEY],
            "autoscale": False,
            "shutdown_grace_secs": 1,
            "log_level": "warning",
            **overrides,
        }
    )
    stack = ServingStack(settings, models_dir, console=Console(file=io.StringIO()))
    try:
        await stack.start()
        await stack.published()  # the measurements start with every model of models.toml published
        yield stack
    finally:
        await stack.stop()


def gateway_urls(stack: Any) -> dict[str, str]:
    s = stack.settings
    return {"http": f"http://127.0.0.1:{s.http_port}", "grpc": f"127.0.0.1:{s.grpc_port}"}


def direct_urls(stack: Any) -> dict[str, str]:
    return {"http": stack.triton_process.http_url, "grpc": stack.triton_process.grpc_url}


async def wait_state(stack: Any, model: str, state: str, timeout: float) -> float:
    """Wait until the lifecycle reports `state` for `model`; the seconds it took."""
    import asyncio

    start = time.perf_counter()
    while stack.lifecycle.status(model).state != state:  # ModelState is a str enum
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"model {model} not {state} after {timeout}s ({stack.lifecycle.status(model)})")
        await asyncio.sleep(0.05)
    return time.perf_counter() - start


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)
    return {
        "n": len(v),
        "median": round(float(np.median(v)), 4),
        "p90": round(float(np.percentile(v, 90)), 4),
        "max": round(v[-1], 4),
        "min": round(v[0], 4),
    }


# ------------------------------------------------------------------------------ the torch example, three ways

TORCH_VARIANTS = {
    "torch-mlp": "in the stub (worker = in-stub, the default)",
    "torch-mlp-preforked": "in a worker forked from a parent that preloaded torch (worker = preforked)",
    "torch-mlp-onnx": "its ONNX export (snoozectl convert / publish --prefer-native), onnxruntime runner",
}


# A small torch conv net (bench/packages/torch-conv): its first forward initialises conv kernels and thread
# pools the MLP never touches, so it shows what a preloaded parent's warmed kernels save.
CONV_PACKAGE = Path(__file__).resolve().parent / "packages" / "torch-conv"
CONV_VARIANTS = {
    "torch-conv": "a small torch conv net in its stub (bench/packages/torch-conv)",
    "torch-conv-preforked": "the same conv net in a worker forked from a parent that preloaded and warmed torch",
}


def conv_variant_entries(**deployment: Any) -> dict[str, dict[str, Any]]:
    return {
        "torch-conv": {"path": CONV_PACKAGE, **deployment},
        "torch-conv-preforked": {"path": CONV_PACKAGE, "worker": "preforked", **deployment},
    }


def torch_variant_entries(
    root: Path, max_batch_size: int, variants: Any = tuple(TORCH_VARIANTS), **deployment: Any
) -> dict[str, dict[str, Any]]:
    """models.toml entries for the torch example as in-stub, preforked and exported ONNX (exported here)."""
    common = {"max_batch_size": max_batch_size, **deployment}
    entries = {
        "torch-mlp": {"path": EXAMPLES / "torch-mlp", **common},
        "torch-mlp-preforked": {"path": EXAMPLES / "torch-mlp", "worker": "preforked", **common},
    }
    if "torch-mlp-onnx" in variants:
        from controlplane.native import prefer_native

        out = root / "torch-mlp-onnx"
        decision = prefer_native(EXAMPLES / "torch-mlp", max_batch_size=max_batch_size, out_dir=out)
        if not decision.native:
            raise RuntimeError(f"the torch example did not export to ONNX: {decision.reason}")
        entries["torch-mlp-onnx"] = {"path": decision.publish_path, **common}
    return {m: e for m, e in entries.items() if m in variants}


def _pss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_full_info().pss
    return total


def model_memory(stack: Any, models: list[str]) -> dict[str, Any]:
    """What ``models`` (loaded) hold: as the lifecycle accounts it (their memory_bytes, plus the preloaded
    parents it counts once) and as the kernel does (PSS of their stubs, workers and those parents: shared
    pages split between the processes that map them, so the sum is the memory they take together)."""
    from controlplane.lifecycle.workers import parents, workers_of

    processes = stack.triton_process.processes()
    journal = stack.lifecycle.journal_dir
    stubs = [s for m in models for s in processes.stubs(m)]
    workers = workers_of(journal, stubs)
    parent_pids = [p.pid for p in parents(journal)] if workers else []
    runtime = stack.lifecycle.runtime()
    accounted = sum(stack.lifecycle.status(m).memory_bytes or 0 for m in models)
    return {
        "models": len(models),
        "accounted_mib": round((accounted + (runtime["overhead_bytes"] if workers else 0)) / 2**20, 1),
        "models_accounted_mib": round(accounted / 2**20, 1),
        "pss_mib": round(_pss([s.pid for s in stubs] + [w.pid for w in workers] + parent_pids) / 2**20, 1),
        "parents_pss_mib": round(_pss(parent_pids) / 2**20, 1),
        "processes": len(stubs) + len(workers) + len(parent_pids),
    }
