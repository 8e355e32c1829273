"""`snoozectl validate --load`'s live checks: each model loaded into a real tritonserver (the embedded one, or
``--triton-url``), one inference built from its config, unloaded."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.dtypes import from_triton
from controlplane.errors import SnoozeError
from controlplane.render import DEPLOYMENT_FILE, TritonTarget
from controlplane.validation.report import REPOSITORY, SKIP, CheckResult, Recorder
from controlplane.validation.static import CORE_BACKENDS, PLATFORM_BACKENDS
from controlplane.validation.static_onnx import config_tensors

DEFAULT_LOAD_TIMEOUT_SECS = 300.0


def warmup_inputs(config: Any, seed: int = 0) -> dict[str, Any]:
    """Inputs generated from a config by ``converters.samples`` (the generator check and parity use), dims -1
    -> 1, batch 1 when the model batches. BF16 goes as float32 arrays of bfloat16 values (tritonclient's way)."""
    import numpy as np

    from converters.samples import sample_array

    rng = np.random.default_rng(seed)
    arrays: dict[str, Any] = {}
    for name, triton_type, dims in config_tensors(config, "input"):
        shape = ([1] if config.max_batch_size > 0 else []) + [1 if d == -1 else d for d in dims]
        numpy_name = from_triton(triton_type).numpy
        array = sample_array(numpy_name, shape, rng)
        arrays[name] = array.astype(np.float32) if numpy_name == "bfloat16" else array
    return arrays


@dataclass
class ChosenInputs:
    """The inputs of validate's inference and where each came from (``GENERATED`` or a source's name)."""

    arrays: dict[str, Any]
    sources: dict[str, str]

    @property
    def generated(self) -> list[str]:
        return [name for name, source in self.sources.items() if source == GENERATED]

    def describe(self) -> str:
        by: dict[str, list[str]] = {}
        for name, source in self.sources.items():
            by.setdefault(source, []).append(name)
        return "; ".join(f"{source}: {', '.join(names)}" for source, names in by.items())


GENERATED = "generated"


def sample_inputs(folder: Path, config: Any) -> dict[str, Any]:
    """The package's own warm-up samples, as the render wrote them for Triton (``model_warmup`` data files in
    ``<model>/warmup/``), one item each (with the batch axis when the model batches). Inputs the load warms up
    with generated data (zeros, or the short BYTES string) are not samples and are left out."""
    import numpy as np
    from tritonclient.grpc import model_config_pb2
    from tritonclient.utils import deserialize_bytes_tensor

    from controlplane.warmup_samples import SHORT_STRING, WARMUP_DIR

    arrays: dict[str, Any] = {}
    for warmup in config.model_warmup[:1]:
        for name, item in warmup.inputs.items():
            if not item.input_data_file:
                continue
            try:
                raw = (folder / WARMUP_DIR / item.input_data_file).read_bytes()
            except OSError:
                continue  # the static checks report a missing file
            wire = from_triton(model_config_pb2.DataType.Name(item.data_type))
            if wire.wire == "BYTES":
                array = deserialize_bytes_tensor(raw)
                if all(v == SHORT_STRING for v in array):
                    continue
            else:
                array = np.frombuffer(raw, dtype=wire.numpy).copy()
            try:
                array = array.reshape(list(item.dims))
            except ValueError:
                continue
            arrays[name] = array[np.newaxis] if config.max_batch_size > 0 else array
    return arrays


def learned_inputs(folder: Path, config: Any) -> dict[str, Any]:
    """Zeros shaped as the model's traffic showed (``learned_warmup.json`` in its folder; BYTES: empty strings),
    one item each: what its next load warms up with."""
    import numpy as np

    from controlplane.warmup_samples import learned_shapes

    declared = {name: from_triton(t) for name, t, _ in config_tensors(config, "input")}
    arrays: dict[str, Any] = {}
    for name, learned in (learned_shapes(folder) or {}).items():
        dtype = declared.get(name)
        if dtype is None or dtype.wire != learned["datatype"]:
            continue  # learned before a change of signature: not this config's input
        shape = ([1] if config.max_batch_size > 0 else []) + learned["shape"]
        if dtype.wire == "BYTES":
            arrays[name] = np.full(shape, b"", dtype=object)
        else:
            arrays[name] = np.zeros(shape, dtype=np.float32 if dtype.numpy == "bfloat16" else dtype.numpy)
    return arrays


# Tried in order; an input none of them has is generated (``warmup_inputs``).
INPUT_SOURCES: tuple[tuple[str, Callable[[Path, Any], dict[str, Any]]], ...] = (
    ("warm-up sample", sample_inputs),
    ("learned shape", learned_inputs),
)


def choose_inputs(folder: Path, config: Any) -> ChosenInputs:
    """Each input from the first source that has it, else generated from the config."""
    chosen, sources = {}, {}
    for source, provide in INPUT_SOURCES:
        for name, array in provide(folder, config).items():
            if name not in chosen:
                chosen[name], sources[name] = array, source
    generated = warmup_inputs(config)
    names = [name for name, _, _ in config_tensors(config, "input")]
    for name in names:
        if name not in chosen:
            chosen[name], sources[name] = generated[name], GENERATED
    return ChosenInputs({n: chosen[n] for n in names}, {n: sources[n] for n in names})


def warmup_infer(
    http_url: str, config: Any, headers: dict[str, str], timeout: float, chosen: ChosenInputs | None = None
) -> str:
    """One inference through tritonclient.http; returns a short description, raises on failure."""
    import tritonclient.http as httpclient

    ssl = http_url.startswith("https://")
    url = re.sub(r"^https?://", "", http_url).rstrip("/")
    types = {name: from_triton(t).wire for name, t, _ in config_tensors(config, "input")}
    arrays = chosen.arrays if chosen is not None else warmup_inputs(config)
    inputs = []
    for name, array in arrays.items():
        tensor = httpclient.InferInput(name, list(array.shape), types[name])
        tensor.set_data_from_numpy(array, binary_data=True)
        inputs.append(tensor)
    client = httpclient.InferenceServerClient(url, ssl=ssl, connection_timeout=timeout, network_timeout=timeout)
    try:
        result = client.infer(config.name or "", inputs, headers=headers or None)
    finally:
        client.close()
    outputs = [name for name, _, _ in config_tensors(config, "output")]
    missing = [name for name in outputs if result.as_numpy(name) is None]
    if missing:
        raise RuntimeError(f"the response lacks output(s) {missing}")
    shapes = ", ".join(f"{n}{list(result.as_numpy(n).shape)}" for n in outputs)
    return shapes


def _triton_folder(folder: Path) -> bool:
    """Published from a Triton model folder (its deployment record's kind)."""
    try:
        return str(json.loads((folder / DEPLOYMENT_FILE).read_text(encoding="utf-8"))["kind"]).startswith("triton-")
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _load_timeout(folder: Path, default: float) -> float:
    try:
        return float(json.loads((folder / DEPLOYMENT_FILE).read_text(encoding="utf-8"))["load_timeout_secs"])
    except (OSError, ValueError, KeyError, TypeError):
        return default


async def _load_one(
    admin: Any,
    http_url: str,
    folder: Path,
    config: Any,
    headers: dict[str, str],
    default_timeout: float,
    was_ready: bool,
    strict: bool = False,
) -> list[CheckResult]:
    name = folder.name
    rec = Recorder(name)
    rel = f"{name}/config.pbtxt"
    timeout = _load_timeout(folder, default_timeout)
    start = time.perf_counter()
    try:
        await admin.load(name, timeout=timeout)
    except SnoozeError as exc:
        fix = exc.hint or "read Triton's reason above (and its log); fix the model and re-render"
        if "warmup sample" in exc.message or "warm-up inference" in exc.message:
            fix = (
                "predict() failed on the load's warm-up inputs (zeros shaped like the signature, BYTES b'snooze'): "
                "fix it, ship 'warmup' samples in snooze_model.json, or set \"warmup\": false there"
            )
        rec.fail("load", f"Triton did not load it: {exc.message}", file=rel, fix=fix)
        return rec.results
    load_secs = time.perf_counter() - start
    rec.ok("load", f"loaded in {load_secs:.2f}s", rel, load_secs=load_secs)
    start = time.perf_counter()
    if config.model_transaction_policy.decoupled:  # Triton refuses HTTP infer for a stream (501)
        rec.skip(
            "warmup_infer",
            "a decoupled (streaming) model: Triton answers it on gRPC streams only, so no "
            "HTTP inference is sent; it loaded",
            rel,
        )
    else:
        chosen = choose_inputs(folder, config)
        try:
            shapes = await asyncio.to_thread(warmup_infer, http_url, config, headers, timeout, chosen)
            rec.ok(
                "warmup_infer",
                f"one inference in {time.perf_counter() - start:.3f}s ({chosen.describe()}): {shapes}",
                rel,
            )
        except Exception as exc:  # tritonclient raises InferenceServerException and transport errors
            if chosen.generated:
                # Random values the model may rightly refuse: the package can say what it takes.
                problem = (
                    f"the inference on generated input(s) {chosen.generated} (random values shaped like "
                    f"the config) failed: {exc}"
                )
                fix = (
                    "if the model refuses such values, ship a sample of what it takes: 'warmup': {\"<input>\": "
                    '"<file>.npy"} in snooze_model.json (validate sends it instead); else fix predict()'
                    if not _triton_folder(folder)
                    else "if the model refuses such values, give its config.pbtxt a model_warmup whose inputs name an "
                    "input_data_file in its warmup/ folder (validate sends it instead); else fix execute()"
                )
                (rec.fail if strict else rec.warn)("warmup_infer", problem, file=rel, fix=fix)
            else:
                rec.fail(
                    "warmup_infer",
                    f"the inference on the package's own inputs ({chosen.describe()}) failed: {exc}",
                    file=rel,
                    fix="fix the model's predict() for the inputs it ships",
                )
    if was_ready:
        rec.ok("unload", "left loaded: it was loaded before validation started", rel)
        return rec.results
    try:
        await admin.unload(name, wait=True, timeout=timeout)
        rec.ok("unload", "unloaded", rel)
    except SnoozeError as exc:
        rec.fail("unload", exc.message, file=rel, fix=exc.hint or "check the model's unload()/finalize()")
    return rec.results


async def _load_all(
    http_url: str, models: list[tuple[Path, Any]], headers: dict[str, str], default_timeout: float, strict: bool = False
) -> list[CheckResult]:
    from controlplane.triton.client import IndexState, TritonAdminClient

    # The restricted model-repository API of a compose/Kubernetes Triton wants its key in a header.
    async with TritonAdminClient(http_url, headers=headers or None) as admin:
        try:
            ready = {e.name for e in await admin.repository_index() if e.state == IndexState.READY}
        except SnoozeError as exc:
            rec = Recorder(REPOSITORY)
            rec.fail(
                "triton",
                f"Triton at {http_url} does not answer its repository index: {exc}",
                file=None,
                fix="check --triton-url and the model-repository API key (--triton-header)",
            )
            return rec.results
        results: list[CheckResult] = []
        for folder, config in models:
            results += await _load_one(
                admin, http_url, folder, config, headers, default_timeout, folder.name in ready, strict
            )
        return results


def _run_coroutine(make: Callable[[], Any]) -> Any:
    """asyncio.run, also when called from inside a running event loop (then on a worker thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


def dynamic_checks(
    repo: Path,
    candidates: list[tuple[Path, Any]],
    target: TritonTarget,
    triton_url: str | None,
    headers: dict[str, str],
    load_timeout: float,
    strict: bool = False,
) -> list[CheckResult]:
    from controlplane.triton.embedded_dist import detect_backends
    from controlplane.triton.launcher import EmbeddedTriton

    results: list[CheckResult] = []
    triton = None
    work_dir = None
    backends = set(target.backends)
    if triton_url is None:
        work_dir = Path(tempfile.mkdtemp(prefix="snooze-validate-"))
        triton = EmbeddedTriton(repo, work_dir)
        try:
            triton.start()
        except SnoozeError as exc:
            rec = Recorder(REPOSITORY)
            rec.fail(
                "triton",
                f"the embedded tritonserver did not start: {exc.message}",
                file=None,
                fix=exc.hint or "install snoozeml[embedded], or pass --triton-url of a running Triton",
            )
            shutil.rmtree(work_dir, ignore_errors=True)
            return rec.results
        backends = detect_backends(work_dir / "backends") or {"python"}  # detected, not assumed
        triton_url = triton.http_url
    try:
        runnable = []
        for folder, config in candidates:
            backend = config.backend or PLATFORM_BACKENDS.get(config.platform, "")
            if backend in backends or backend in CORE_BACKENDS:
                runnable.append((folder, config))
            else:
                results.append(
                    CheckResult(
                        folder.name,
                        "load",
                        SKIP,
                        f"not loaded: this Triton has no '{backend}' backend ({sorted(backends)})",
                    )
                )
        results += _run_coroutine(lambda: _load_all(triton_url, runnable, headers, load_timeout, strict))
    finally:
        if triton is not None:
            triton.stop()
        if work_dir is not None:
            shutil.rmtree(work_dir, ignore_errors=True)
    return results
