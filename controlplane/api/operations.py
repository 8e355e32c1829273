"""What the control API does, apart from HTTP: publish (validate, check, write, tell the lifecycle),
describe, delete, load and unload. Blocking work (extraction, validation, file writes) runs in
worker threads; writes to one model id are serialised."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import asdict
from pathlib import Path
from typing import Any, BinaryIO

import orjson
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from controlplane.api.listing import LIST_SCAN_SECS, SUMMARY_TOP, ListQuery, ModelPage, page_of, summarise
from controlplane.api.services import ControlPlaneServices
from controlplane.errors import ForbiddenError, InvalidPackageError, SnoozeError
from controlplane.lifecycle.state import ModelStatus, UnloadReason
from controlplane.package_check import check_import, check_triton_import, missing_modules
from controlplane.settings import Settings
from controlplane.spec import DeploymentSpec, ModelSpec, PackageKind, resolve
from controlplane.store import PublishedModel
from controlplane.upload import extract_package


def describe_validation_errors(errors: Sequence[Any], where: str) -> str:
    """pydantic / FastAPI validation errors as one line naming each field."""
    parts = []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]
        name = ".".join(loc) or "(body)"
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown field '{name}' (remove it or check its spelling)")
        elif err.get("type") == "missing":
            parts.append(f"missing required field '{name}'")
        else:
            parts.append(f"field '{name}': {err.get('msg')}")
    return f"{where}: " + "; ".join(parts)


class _KeyedLocks:
    """One asyncio lock per key, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


def _relabel(exc: SnoozeError, folder: Path, label: str) -> None:
    """Name files by the upload, not by the temporary folder they were extracted into."""
    for attr in ("message", "hint"):
        text = getattr(exc, attr)
        if text:
            setattr(exc, attr, text.replace(f"{folder}{os.sep}", f"{label}/").replace(str(folder), label))
    exc.args = (exc.message,)


def _check_custom_import(spec: ModelSpec, *, same_environment: bool) -> None:
    """Import a custom model's entrypoint in a child process; an error names the file and the fix."""
    package, deployment = spec.package, spec.deployment
    # A model with its own environment imports there, not in the control plane's interpreter.
    if package.kind is not PackageKind.CUSTOM or deployment.execution_env_path:
        return
    manifest = package.manifest
    problem = check_import(package.path, manifest.entrypoint, manifest.class_name, env=manifest.env)
    if problem:
        raise InvalidPackageError(
            f"model '{spec.id}': {problem}",
            hint="fix the error above; import ML frameworks inside load() so that importing the "
            "package stays light, and test locally with `snoozectl check <folder>`",
        )
    # Imports inside load() run only at the first request: look them up now, without running them, where
    # Triton's python backend shares this interpreter's packages (the embedded Triton). An external Triton
    # (the official image, a derived one) has packages of its own, which the control plane cannot see.
    missing = missing_modules(package.path, package.files) if same_environment else []
    if missing:
        where = "; ".join(f"{file}:{line} imports '{module}'" for file, line, module in missing)
        names = " ".join(sorted({module for _, _, module in missing}))
        raise InvalidPackageError(
            f"model '{spec.id}': {where}, which is not installed where Triton's python backend runs the "
            f"model ({sys.executable})",
            hint=f"install it there ({sys.executable} -m pip install <the distribution providing {names}>), "
            "or give the model its own environment with the deployment's execution_env_path; an import "
            "inside try/except ImportError is treated as optional (docs/packages.md#dependencies)",
        )


# What Triton's python backend stub provides to the models it runs (never installed in an environment).
STUB_MODULES = frozenset({"triton_python_backend_utils", "c_python_backend_utils"})
# listed models' JSON kept beyond the published ones before those of deleted models go (``ModelOperations.list``)
FRAGMENTS_SLACK = 1000


def _check_triton_import(spec: ModelSpec, *, same_environment: bool) -> None:
    """Import a Triton python model's file of each served version in a child process, as Triton's stub would."""
    package, folder = spec.package, spec.package.triton
    if folder is None or package.kind is not PackageKind.TRITON_PYTHON:
        return
    if spec.deployment.execution_env_path or "EXECUTION_ENV_PATH" in folder.config.parameters:
        return  # it imports in its own environment, which the control plane cannot run
    for version in folder.served:
        version_dir = package.path / str(version)
        problem = check_triton_import(version_dir / folder.model_file, package.path)
        if problem:
            raise InvalidPackageError(
                f"model '{spec.id}': {problem}",
                hint="fix the error above; try it with `snoozectl check <folder>` (it runs in tritonserver)",
            )
        if not same_environment:
            continue
        prefix = f"{version}/"
        files = [f.removeprefix(prefix) for f in package.files if f.startswith(prefix)]
        missing = [m for m in missing_modules(version_dir, files) if m[2] not in STUB_MODULES]
        if missing:
            where = "; ".join(f"{version}/{file}:{line} imports '{module}'" for file, line, module in missing)
            raise InvalidPackageError(
                f"model '{spec.id}': {where}, which is not installed where Triton's python backend runs the model "
                f"({sys.executable})",
                hint=f"install it there ({sys.executable} -m pip install ...), or give the model an EXECUTION_ENV_PATH "
                "(config parameter, or the deployment's execution_env_path); an import inside try/except ImportError "
                "is treated as optional",
            )


def _validate(deployment: DeploymentSpec, settings: Settings) -> ModelSpec:
    spec = resolve(deployment)
    _check_custom_import(spec, same_environment=settings.triton_url is None)
    _check_triton_import(spec, same_environment=settings.triton_url is None)
    return spec


def _upload_deployment(ids: Sequence[str | None], deployment_json: str | None, root: Path) -> DeploymentSpec:
    """The deployment of an upload: JSON fields (no 'path'), the id from the query, form or JSON."""
    fields: dict[str, Any] = {}
    if deployment_json:
        try:
            fields = json.loads(deployment_json)
        except json.JSONDecodeError as exc:
            raise InvalidPackageError(
                f"form field 'deployment' is not valid JSON ({exc})",
                hint='send a JSON object of deployment fields, e.g. {"max_batch_size": 8}',
            ) from exc
        if not isinstance(fields, dict):
            raise InvalidPackageError("form field 'deployment' must be a JSON object of deployment fields")
    if "path" in fields:
        raise InvalidPackageError(
            "form field 'deployment' must not set 'path': the package is the uploaded archive",
            hint="remove 'path' (to publish a folder on the server, use POST /v1/models:from-path)",
        )
    given = {i for i in (*ids, fields.get("id")) if i}
    if len(given) > 1:
        raise InvalidPackageError(
            f"the upload names several model ids {sorted(given)}", hint="give the id once (query 'id')"
        )
    if not given:
        raise InvalidPackageError(
            "the upload does not name the model id", hint="add ?id=<model-id> to the URL (snoozectl publish --id)"
        )
    model_id = given.pop()
    try:
        return DeploymentSpec.model_validate({**fields, "id": model_id, "path": root})
    except ValidationError as exc:
        raise InvalidPackageError(
            describe_validation_errors(exc.errors(), f"deployment of model '{model_id}'"),
            hint="see DeploymentSpec in the API docs (/docs) for the fields and their limits",
        ) from exc


class ModelOperations:
    def __init__(self, services: ControlPlaneServices) -> None:
        self.services = services
        self._locks = _KeyedLocks()
        # a listed model's summary as JSON, kept while its model and status are the same objects (a model at rest
        # keeps its status object: ``AdminOperations._at_rest``): model id -> (model, status, its JSON or None)
        self._fragments: dict[str, tuple[PublishedModel, ModelStatus, orjson.Fragment | None]] = {}

    # --- publish

    async def publish_archive(
        self, archive: BinaryIO, archive_name: str, *, ids: Sequence[str | None], deployment_json: str | None
    ) -> dict[str, Any]:
        """Extract, validate and publish an uploaded package archive."""
        settings = self.services.settings
        uploads = settings.work_dir / "uploads"
        uploads.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="upload-", dir=uploads) as tmp:
            extracted = Path(tmp) / "package"

            def prepare() -> ModelSpec:
                try:
                    root = extract_package(
                        archive, extracted, max_bytes=int(settings.max_upload_mb * 2**20), archive_name=archive_name
                    )
                    return _validate(_upload_deployment(ids, deployment_json, root), settings)
                except SnoozeError as exc:
                    _relabel(exc, extracted, archive_name)
                    raise

            spec = await run_in_threadpool(prepare)
            return await self._publish(spec)

    async def publish_path(self, deployment: DeploymentSpec) -> dict[str, Any]:
        """Validate and publish a package folder on the server's filesystem."""
        if not self.services.settings.allow_local_paths:
            raise ForbiddenError(
                "publishing from a path on the server is disabled on this server",
                hint="upload an archive instead (snoozectl publish packs the folder), "
                "or set SNOOZE_ALLOW_LOCAL_PATHS=true on the server",
            )
        if not deployment.path.is_absolute():
            raise InvalidPackageError(
                f"model '{deployment.id}': path '{deployment.path}' is relative",
                hint="give the absolute path of the package folder on the server",
            )
        spec = await run_in_threadpool(_validate, deployment, self.services.settings)
        return await self._publish(spec)

    async def _publish(self, spec: ModelSpec) -> dict[str, Any]:
        async with self._locks.hold(spec.id):
            await run_in_threadpool(self.services.store.publish, spec)
            await self.services.lifecycle.published(spec.id)
        return await self.describe(spec.id)

    # --- read

    def _summary(self, model: PublishedModel, status: ModelStatus | None = None) -> dict[str, Any]:
        status = status or self.services.lifecycle.status(model.id)
        return {**self._listed(model, status), "status": status.to_dict()}

    async def list(self, query: ListQuery | None = None) -> ModelPage:
        """Published models by id, from the store's catalog and the lifecycle's records (no file read but a stat
        per model at most every ``LIST_SCAN_SECS``), filtered, one page after the cursor."""
        query = query or ListQuery()
        models = await run_in_threadpool(
            self.services.store.list, max_age=self.services.store.trusted_age(LIST_SCAN_SECS)
        )
        lifecycle = self.services.lifecycle
        if len(self._fragments) > len(models) + FRAGMENTS_SLACK:  # models deleted since: their JSON goes
            ids = {m.id for m in models}
            self._fragments = {m: kept for m, kept in self._fragments.items() if m in ids}
        return page_of(models, query, lifecycle.statuses, self._listed_json, lifecycle.states_of)

    def _listed_json(self, model: PublishedModel, status: ModelStatus) -> dict[str, Any] | orjson.Fragment:
        """``_listed``, or its JSON kept from an earlier listing when the model and its status are the objects they
        were then (the status of a model at rest is kept on its record): 50,000 models at rest are listed without a
        dict or an encoding each. Kept from the second listing that meets the same status on: the status of a model
        that is not at rest is a new object at each read, and is not encoded twice."""
        kept = self._fragments.get(model.id)
        if kept is None or kept[0] is not model or kept[1] is not status:
            self._fragments[model.id] = (model, status, None)
            return self._listed(model, status)
        if kept[2] is not None:
            return kept[2]
        # kept as a str: the bytes orjson.dumps returns hold about 4 KiB of the heap each (measured: 50,000 of them
        # 196 MiB, their text 30 MiB)
        fragment = orjson.Fragment(orjson.dumps(self._listed(model, status), default=str).decode())
        self._fragments[model.id] = (model, status, fragment)
        return fragment

    @staticmethod
    def _listed(model: PublishedModel, status: ModelStatus) -> dict[str, Any]:
        """A model's summary, its status left a dataclass: the listing's encoder (orjson) writes it as ``to_dict``
        would, without a dict copied per model (10,000 models: tens of ms); ``_summary`` converts it."""
        return {
            "id": model.id,
            "kind": model.kind.value,
            "backend": model.backend,
            "device": model.deployment.device.value,
            "max_batch_size": model.deployment.max_batch_size,
            "status": status,
            "notes": list(model.notes),
        }

    async def _arrived(self, model_id: str) -> None:
        """A model `serve --models` has still to publish is published next, and waited for (bounded)."""
        if self.services.publishing is not None:
            await self.services.publishing.arrival(model_id)

    async def summary(self, top: int = SUMMARY_TOP) -> dict[str, Any]:
        """Counts by state and kind, the memory held, the models using the most memory and the most recently used,
        and the background publishing's progress."""
        models = await run_in_threadpool(
            self.services.store.list, max_age=self.services.store.trusted_age(LIST_SCAN_SECS)
        )
        publishing = self.services.publishing
        return {
            **summarise(models, self.services.lifecycle.statuses([m.id for m in models]), top),
            "publishing": publishing.describe() if publishing is not None else None,
        }

    async def describe(self, model_id: str) -> dict[str, Any]:
        await self._arrived(model_id)
        model = await run_in_threadpool(self.services.store.get, model_id)
        config = await run_in_threadpool(lambda: model.config_text)
        summary = self._summary(model)
        stats = None
        if summary["status"]["state"] == "ready":
            # Unloaded in between, or Triton busy: the rest of the answer still holds.
            with suppress(SnoozeError):
                stats = asdict(await self.services.triton.model_stats(model_id))
        return {
            **summary,
            # where the model's files live now: an upload's own path was a temporary folder, gone after the publish
            "deployment": {**model.deployment.model_dump(mode="json"), "path": str(model.path)},
            "inputs": [t.model_dump() for t in model.inputs],
            "outputs": [t.model_dump() for t in model.outputs],
            "params": model.params,
            "metadata": model.metadata,
            "versions": list(model.versions),
            "config": config,
            "stats": stats,
        }

    # --- change

    async def delete(self, model_id: str) -> None:
        await self._arrived(model_id)
        store = self.services.store
        async with self._locks.hold(model_id):
            await run_in_threadpool(store.get, model_id)  # 404 for an unknown id
            await self.services.lifecycle.forget(model_id)
            await run_in_threadpool(store.delete, model_id)
            self.services.metrics.forget(model_id)

    async def load(self, model_id: str, instances: int | None) -> dict[str, Any]:
        await self._arrived(model_id)
        await run_in_threadpool(self.services.store.get, model_id)
        return (await self.services.lifecycle.load(model_id, instances=instances)).to_dict()

    async def unload(self, model_id: str) -> dict[str, Any]:
        await self._arrived(model_id)
        await run_in_threadpool(self.services.store.get, model_id)
        return (await self.services.lifecycle.unload(model_id, reason=UnloadReason.API)).to_dict()
