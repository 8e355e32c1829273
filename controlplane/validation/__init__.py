"""`snoozectl validate`: the CI gate for a generated Triton model repository.

Static checks read every model folder without running model code in this process: the config
parses as Triton's ``ModelConfig`` and names its folder, version folders hold the file the backend
needs, ONNX graphs agree with their configs, and python-backend models import in a *child* process
(user code never runs in the control plane) without pulling their ML framework in at import time.
With ``load=True`` every model the target can run is loaded into a real tritonserver (the embedded
one, or ``triton_url``), answers one warm-up inference built from its config, and is unloaded.

Every failure names the model, the file and the fix. The parts: ``report`` (results and their formats),
``static`` (checks of the files, imports in child processes), ``live`` (load, infer, unload).
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterable
from pathlib import Path

from controlplane.package_check import ProbePool
from controlplane.render import TritonTarget, embedded_target, parse_config, target_by_name
from controlplane.validation.live import DEFAULT_LOAD_TIMEOUT_SECS, dynamic_checks, warmup_infer, warmup_inputs
from controlplane.validation.report import (
    FAIL,
    OK,
    REPOSITORY,
    SKIP,
    WARN,
    CheckResult,
    Recorder,
    ValidationReport,
)
from controlplane.validation.static import check_model_static

__all__ = [
    "DEFAULT_LOAD_TIMEOUT_SECS",
    "FAIL",
    "OK",
    "REPOSITORY",
    "SKIP",
    "WARN",
    "CheckResult",
    "ValidationReport",
    "check_model_static",
    "validate_repository",
    "warmup_infer",
    "warmup_inputs",
]


def _model_folders(repo: Path) -> list[Path]:
    return sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))


def _resolve_target(target: TritonTarget | str | None) -> TritonTarget:
    if target is None:
        return embedded_target()
    return target if isinstance(target, TritonTarget) else target_by_name(target)


def validate_repository(
    repo: str | os.PathLike[str],
    *,
    load: bool = False,
    triton_url: str | None = None,
    target: TritonTarget | str | None = None,
    triton_headers: dict[str, str] | None = None,
    load_timeout: float = DEFAULT_LOAD_TIMEOUT_SECS,
    models: Iterable[str] | None = None,
    strict: bool = False,
) -> ValidationReport:
    """Check a generated Triton model repository; with ``load``, load and warm up every model.

    ``target`` ("embedded", "full" or a TritonTarget) says which backends the serving Triton has;
    ``triton_url`` uses a running Triton instead of starting the embedded one (``triton_headers``
    carry its model-repository API key); ``models`` restricts the check to some model folders. ``strict``: an
    inference on generated inputs that fails is a failure, not a warning (the model may refuse random values).
    """
    # Absolute inside (the import probe's children run in other working directories); the report keeps
    # the path as given.
    given, repo_path = Path(repo), Path(repo).resolve()
    tgt = _resolve_target(target)
    report = ValidationReport(str(given), tgt.name, load)
    rec = Recorder(REPOSITORY)
    if not repo_path.is_dir():
        rec.fail(
            "repository",
            "the model repository folder does not exist",
            file=str(given),
            fix="pass the folder snoozectl render / serve wrote (e.g. .snooze/model_repository)",
        )
        report.results = rec.results
        return report
    folders = _model_folders(repo_path)
    if models is not None:
        wanted = set(models)
        unknown = sorted(wanted - {f.name for f in folders})
        for name in unknown:
            rec.fail("repository", f"no model folder '{name}'", file=name, fix="check the model name")
        folders = [f for f in folders if f.name in wanted]
    if not folders and not rec.failed:
        rec.fail(
            "repository", "no model folders", file=str(given), fix="render models into it first (snoozectl render)"
        )
    report.results += rec.results
    # One import probe per core (each checks many packages, forking per package); the reading and parsing
    # of the static checks runs on as many threads, most of it waiting on the probes.
    workers = max(1, min(os.cpu_count() or 1, len(folders)))
    with ProbePool(workers) as probes, concurrent.futures.ThreadPoolExecutor(workers * 2) as pool:
        per_model = list(pool.map(lambda f: check_model_static(repo_path, f, tgt, probes), folders))
    for results in per_model:
        report.results += results
    if load:
        candidates = []
        for folder, results in zip(folders, per_model, strict=True):
            if any(not r.ok for r in results):
                report.results.append(CheckResult(folder.name, "load", SKIP, "not loaded: static checks failed"))
            else:
                candidates.append((folder, parse_config((folder / "config.pbtxt").read_text(), where=folder.name)))
        if candidates:
            report.results += dynamic_checks(
                repo_path, candidates, tgt, triton_url, dict(triton_headers or {}), load_timeout, strict
            )
    report.results.sort(key=lambda r: (r.model != REPOSITORY, r.model))  # stable: checks keep their order
    return report
