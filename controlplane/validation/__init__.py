"""`snoozectl validate`: the CI gate for a generated Triton model repository.

Static checks read every model folder without running model code in this process: the config
parses as Triton's ``ModelConfig`` and names its folder, version folders hold the file the backend
needs, ONNX graphs agree with their configs, and python-backend models import in a *child* process
(user code never runs in the control plane) without pulling their ML framework in at import time.
With ``load=True`` every model the target can run is loaded into a real tritonserver (the embedded
one, or ``triton_url``), answers one warm-up inference built from its config, and is unloaded.

A folder that snoozeml did not write (no ``snooze_deployment.json``: a Triton model folder, a package, or the
folder given is one) is judged as ``publish`` judges it: resolved (a folder that is no package is refused with
publish's reason), rendered for the target into a scratch repository, and that is checked (and loaded). So
validate, publish, render and serve agree on every folder.

Every failure names the model, the file and the fix. The parts: ``report`` (results and their formats),
``static`` (checks of the files, imports in child processes), ``live`` (load, infer, unload).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from controlplane.errors import InvalidPackageError
from controlplane.package_check import ProbePool
from controlplane.render import (
    DEPLOYMENT_FILE,
    TritonTarget,
    embedded_target,
    parse_config,
    render_model,
    target_by_name,
)
from controlplane.spec import is_package_dir
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


def _generated(folder: Path) -> bool:
    return (folder / DEPLOYMENT_FILE).is_file()


def _source_deployments(repo: Path, sources: list[Path], single: bool) -> list[Any]:
    """The deployments publish would make of the source folders: models.toml's entry for a folder it names (its
    settings are checked too), else the folder's own (id = its name); models.toml entries elsewhere as well."""
    from controlplane.spec import DeploymentSpec, load_models_toml

    toml = repo / "models.toml"
    named = load_models_toml(toml) if toml.is_file() and not single else []
    by_path = {d.path.resolve(): d for d in named}
    folders = {f.resolve() for f in sources}
    found = [by_path.get(f.resolve()) or DeploymentSpec(id=f.name, path=f) for f in sources]
    return found + [d for d in named if d.path.resolve() not in folders and not _generated(d.path)]


def _render_sources(deployments: list[Any], scratch: Path, target: TritonTarget, rec: Recorder) -> list[Path]:
    """Each source folder as publish takes it, rendered into ``scratch``; a refusal is its ``package`` failure."""
    from controlplane.spec import resolve
    from controlplane.store.transactions import write_model

    rendered = []
    for deployment in deployments:
        try:
            spec = resolve(deployment)
            written = write_model(render_model(spec, target), scratch)
        except (InvalidPackageError, ValidationError) as exc:
            model = Recorder(deployment.id)
            message = exc.message if isinstance(exc, InvalidPackageError) else str(exc)
            hint = exc.hint if isinstance(exc, InvalidPackageError) else None
            model.fail(
                "package",
                f"publish refuses it: {message}",
                file=str(deployment.path),
                fix=hint or "see docs/packages.md for the package kinds (a Triton model folder among them)",
            )
            rec.results += model.results
            continue
        rec.results.append(CheckResult(spec.id, "package", OK, f"publish takes it as {spec.package.kind.value}", None))
        rendered.append(written)
    return rendered


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
    # A package folder given itself (a Triton model folder, say), or a folder of files alone, is judged as a package
    # (a repository of one model, or publish's refusal of it).
    single = not _generated(repo_path) and (is_package_dir(repo_path) or (not folders and any(repo_path.iterdir())))
    folders = [repo_path] if single else folders
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
    with contextlib.ExitStack() as stack:
        sources = [f for f in folders if not _generated(f)]
        scratch = None
        if sources:  # judged as publish judges them: rendered for the target, then checked
            # repo/ inside the temporary folder: the store stages its writes beside the repository.
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="snooze-validate-"))) / "repo"
            refusals = Recorder(REPOSITORY)
            try:
                deployments = _source_deployments(repo_path, sources, single)
            except InvalidPackageError as exc:  # models.toml itself is broken: nothing of it is published
                refusals.fail(
                    "models.toml",
                    exc.message,
                    file=str(repo_path / "models.toml"),
                    fix=exc.hint or "correct models.toml",
                )
                deployments = []
            rendered = _render_sources(deployments, scratch, tgt, refusals)
            report.results += refusals.results
            folders = [f for f in folders if _generated(f)] + rendered
        _check_folders(report, folders, scratch, tgt, load, triton_url, triton_headers, load_timeout, strict)
    report.results.sort(key=lambda r: (r.model != REPOSITORY, r.model))  # stable: checks keep their order
    return report


def _check_folders(
    report: ValidationReport,
    folders: list[Path],
    scratch: Path | None,
    tgt: TritonTarget,
    load: bool,
    triton_url: str | None,
    triton_headers: dict[str, str] | None,
    load_timeout: float,
    strict: bool,
) -> None:
    """The static checks of every folder, then (``load``) the live ones, a repository at a time."""
    if not folders:
        return
    # One import probe per core (each checks many packages, forking per package); the reading and parsing
    # of the static checks runs on as many threads, most of it waiting on the probes.
    workers = max(1, min(os.cpu_count() or 1, len(folders)))
    with ProbePool(workers) as probes, concurrent.futures.ThreadPoolExecutor(workers * 2) as pool:
        per_model = list(pool.map(lambda f: check_model_static(f.parent, f, tgt, probes), folders))
    for results in per_model:
        report.results += results
    if not load:
        return
    by_repo: dict[Path, list[tuple[Path, Any]]] = {}
    for folder, results in zip(folders, per_model, strict=True):
        if any(not r.ok for r in results):
            report.results.append(CheckResult(folder.name, "load", SKIP, "not loaded: static checks failed"))
        else:
            config = parse_config((folder / "config.pbtxt").read_text(), where=folder.name)
            by_repo.setdefault(folder.parent, []).append((folder, config))
    for where, candidates in by_repo.items():
        # The scratch repository (folders rendered here) is loaded by a Triton of its own.
        url = None if where == scratch else triton_url
        report.results += dynamic_checks(where, candidates, tgt, url, dict(triton_headers or {}), load_timeout, strict)
