"""The set of published models. The generated repository is the source of truth: each model
folder carries its ``snooze_deployment.json``, so a restarted control plane recovers every model.
Its writes go through ``controlplane.store.transactions`` (one rename per model folder)."""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import pickle
import shutil
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controlplane.errors import NotFoundError
from controlplane.render import DEPLOYMENT_FILE, VERSION, TritonTarget, render_model
from controlplane.spec import DeploymentSpec, ModelSpec, PackageKind, TensorSpec
from controlplane.store.transactions import (
    commit_model,
    recover_staging,
    remove_model,
    repository_lock,
    stage_model,
    staging_root,
    write_model,
)
from controlplane.warmup_samples import plan_source

# The catalog kept for the next start (ModelStore.save_catalog); its format changes with PublishedModel's fields.
CATALOG_FILE, CATALOG_FORMAT = "catalog.pickle", 1
SCAN_SPACING = 10.0  # the store's follower waits at least this many times its last scan's duration between scans
# A read that meets a republish between its two renames tries again (the window is two syscalls wide).
GET_TRIES, GET_RETRY_SECS = 3, 0.002


@dataclass(frozen=True)
class PublishedModel:
    id: str
    path: Path  # the model folder in the repository
    deployment: DeploymentSpec
    kind: PackageKind
    backend: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    params: dict[str, Any]
    metadata: dict[str, Any]
    load_timeout_secs: float
    request_timeout_secs: float
    notes: tuple[str, ...] = ()  # what publishing decided (ModelSpec.notes; a Triton folder's owned fields)
    publish: str = ""  # this publish's token (render.PUBLISH_PARAMETER), also in its config
    source_hash: str = ""  # the content hash it was rendered from (publishing.source_hash); "" when not known
    warmup_source: str | None = None  # its config's warm-up source ("": none); None: not recorded (read the config)
    # An ensemble's steps as (model name, version or "" for the latest), from its config's ensemble_scheduling.
    ensemble_steps: tuple[tuple[str, str], ...] = ()
    versions: tuple[str, ...] = (VERSION,)  # the versions Triton serves (a Triton folder's version_policy)

    @property
    def config_text(self) -> str:
        try:
            return (self.path / "config.pbtxt").read_text(encoding="utf-8")
        except OSError as e:  # deleted, or a republish swapped the folder, since this was read
            raise NotFoundError(
                f"model '{self.id}': its config is gone from the repository ({e.strerror})",
                hint="it was deleted or republished meanwhile; retry",
            ) from None

    @classmethod
    def read(cls, folder: Path) -> PublishedModel:
        record = json.loads((folder / DEPLOYMENT_FILE).read_text(encoding="utf-8"))
        return cls(
            id=folder.name,
            path=folder,
            deployment=DeploymentSpec.model_validate(record["deployment"]),
            kind=PackageKind(record["kind"]),
            backend=record["backend"],
            inputs=[TensorSpec.model_validate(t) for t in record["inputs"]],
            outputs=[TensorSpec.model_validate(t) for t in record["outputs"]],
            params=record.get("params", {}),
            metadata=record.get("metadata", {}),
            load_timeout_secs=record["load_timeout_secs"],
            request_timeout_secs=record["request_timeout_secs"],
            notes=tuple(record.get("notes", ())),
            publish=str(record.get("publish", "")),
            source_hash=str(record.get("source_hash", "")),
            warmup_source=record.get("warmup_source"),
            ensemble_steps=tuple((str(name), str(version)) for name, version in record.get("ensemble_steps", ())),
            versions=tuple(str(v) for v in record.get("versions", (VERSION,))),
        )


def render_repository(specs: Iterable[ModelSpec], repo: Path, target: TritonTarget) -> list[Path]:
    """Render every model first (all-or-nothing validation), then write each one atomically."""
    rendered = [render_model(spec, target) for spec in specs]
    return [write_model(r, repo) for r in rendered]


def stage_published(spec: ModelSpec, repository: Path, target: TritonTarget, *, source_hash: str = "") -> Path:
    """Render the model (validating everything) and write its folder whole in the staging root; the staged folder,
    for ``ModelStore.commit``. Needs no store: a publishing helper process stages too (``store.stager``)."""
    rendered = render_model(spec, target)
    # what the config's warm-up is, kept in the record: a listing of thousands of models reads no config
    config = rendered.writes.get("config.pbtxt")
    record = {"warmup_source": plan_source(config.decode("utf-8")) or ""} if config is not None else {}
    if source_hash:
        record["source_hash"] = source_hash
    return stage_model(rendered, repository, record)


class ModelStore:
    """Publish, list and delete models in one repository; writes are serialised per store."""

    def __init__(self, repository: Path, target: TritonTarget) -> None:
        self.repository = Path(repository)
        self.target = target
        self._lock = threading.Lock()
        self._scanning = threading.Lock()  # one scan at a time; a listing meanwhile answers from the catalog
        self.repository.mkdir(parents=True, exist_ok=True)
        recover_staging(self.repository)  # what a killed control plane left half-written
        # The catalog: every published model's record as read, by the identity it was read at; a scan reads again
        # only the folders whose identity changed since (another writer's publish), so it costs a stat each.
        self._catalog: dict[str, tuple[tuple[int, int], PublishedModel]] = self._saved_catalog()
        self._sorted: builtins.list[PublishedModel] | None = None  # the catalog by id, until it changes
        self._ids: frozenset[str] | None = None  # its ids, until it changes
        self._kinds: dict[PackageKind, builtins.list[str]] | None = None  # its ids by kind, until it changes
        self._written: set[str] = set()  # this store's own writes since the last scan began
        self._scanned = float("-inf")
        self.scan_secs = 0.0  # how long the last scan took (the store's follower spaces its scans by it)
        self._seen = self._scan()  # what changes() compares with

    def changes(self) -> tuple[builtins.list[str], builtins.list[str]]:
        """(republished, deleted): models another writer of this repository (another node of a fleet
        sharing it) published again or deleted since the last call. New models need nothing: a
        request wakes them. This store's own writes are not reported. The catalog is scanned too."""
        with self._scanning:
            now = self._scan()
        with self._lock:
            seen = {**now, **{m: self._seen[m] for m in self._written if m in self._seen}}  # own writes meanwhile
            for model_id in self._written - self._seen.keys():  # deleted here during the scan
                seen.pop(model_id, None)
            changed = sorted(m for m, identity in seen.items() if m in self._seen and self._seen[m] != identity)
            deleted = sorted(m for m in self._seen if m not in seen and m not in self._written)
            self._seen = seen
        return changed, deleted

    def list(self, *, max_age: float = 0.0) -> builtins.list[PublishedModel]:
        """Every published model, by id. ``max_age``: how old (seconds) the catalog's scan of the repository may
        be; this store's own writes are in it at once, another writer's after the next scan (``changes`` scans
        every ``store_poll_secs`` or so while a control plane follows the store)."""
        self._fresh(max_age)
        with self._lock:
            if self._sorted is None:
                self._sorted = [model for _, (_, model) in sorted(self._catalog.items())]
            return builtins.list(self._sorted)

    def trusted_age(self, floor: float) -> float:
        """How old a catalog read (``list``, ``catalog_ids``) may let the catalog be: ``floor``, or longer where the
        follower spaces its scans further apart (``SCAN_SPACING`` times a scan, which takes seconds at tens of
        thousands of models), so that a listing or a sweep does not scan every folder inline between its scans."""
        return max(floor, 2 * SCAN_SPACING * self.scan_secs)

    def catalog_ids(self, *, max_age: float = 0.0) -> frozenset[str]:
        """The published ids as a set (``list``'s catalog): a membership test per model costs no stat."""
        self._fresh(max_age)
        with self._lock:
            if self._ids is None:
                self._ids = frozenset(self._catalog)
            return self._ids

    def ids_of_kind(self, kind: PackageKind) -> builtins.list[str]:
        """The catalog's ids of one kind, as it is (no scan): a status names the ensembles over a model from these
        (an ensemble is rare among thousands of models; one pass over the catalog per change of it)."""
        with self._lock:
            if self._kinds is None:
                kinds: dict[PackageKind, builtins.list[str]] = {}
                for model_id, (_, model) in self._catalog.items():
                    kinds.setdefault(model.kind, []).append(model_id)
                self._kinds = kinds
            return builtins.list(self._kinds.get(kind, ()))

    def _fresh(self, max_age: float) -> None:
        """Scan unless the last scan is at most ``max_age`` seconds old (one that ran while this waited counts)."""
        if time.monotonic() - self._scanned <= max_age:
            return
        with self._scanning:
            if time.monotonic() - self._scanned > max_age:
                self._scan()

    def _scan(self) -> dict[str, tuple[int, int]]:
        """Bring the catalog in line with the repository: a stat per model, a read per changed one, neither under
        the lock (a listing meanwhile answers from the catalog as it was). Returns every published model's
        deployment record as (inode, mtime): a new publish writes a new file."""
        started = time.monotonic()
        with self._lock:
            before, self._written = dict(self._catalog), set()
        found = {}
        # os.scandir and a stat of a string path, not Path objects: half the time (10,000 models: 21 against 46 ms)
        with os.scandir(self.repository) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    st = os.stat(f"{entry.path}/{DEPLOYMENT_FILE}")
                    found[entry.name] = (st.st_ino, st.st_mtime_ns)
        catalog = {}
        for model_id, identity in found.items():
            known = before.get(model_id)
            if known is not None and known[0] == identity:
                catalog[model_id] = known
                continue
            with contextlib.suppress(OSError, ValueError):  # a folder between a republish's renames: next scan
                catalog[model_id] = (identity, PublishedModel.read(self.repository / model_id))
        with self._lock:
            for model_id in self._written:  # this store's own writes during the scan stand as they are
                if model_id in self._catalog:
                    catalog[model_id] = self._catalog[model_id]
                else:
                    catalog.pop(model_id, None)
            if catalog.keys() != self._catalog.keys() or any(catalog[m] is not self._catalog[m] for m in catalog):
                self._sorted, self._ids, self._kinds = None, None, None
            self._catalog, self._scanned = catalog, time.monotonic()
            self.scan_secs = self._scanned - started
        return found

    def _catalog_file(self) -> Path:
        return staging_root(self.repository) / CATALOG_FILE

    def _saved_catalog(self) -> dict[str, tuple[tuple[int, int], PublishedModel]]:
        """The catalog ``save_catalog`` left (a restart reads no record whose identity is unchanged); empty when
        there is none or it cannot be read. Each entry is checked against the repository at the first scan."""
        try:
            with self._catalog_file().open("rb") as f:
                saved = pickle.load(f)  # noqa: S301 - this control plane's own file, in its own repository
            if saved.get("format") != CATALOG_FORMAT or saved.get("repository") != str(self.repository):
                return {}
            return dict(saved["models"])
        except Exception:  # absent, from another version, damaged: the records are read instead
            return {}

    def save_catalog(self) -> None:
        """Keep the catalog beside the repository for the next start (``_saved_catalog``)."""
        with self._lock:
            saved = {"format": CATALOG_FORMAT, "repository": str(self.repository), "models": dict(self._catalog)}
        path = self._catalog_file()
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            with partial.open("wb") as f:
                pickle.dump(saved, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(partial, path)
        except OSError:  # a read-only or full volume: the next start reads the records
            partial.unlink(missing_ok=True)

    def _note(self, folder: Path) -> PublishedModel:
        """This store's own write, into the catalog (called with the lock held)."""
        st = (folder / DEPLOYMENT_FILE).stat()
        identity = (st.st_ino, st.st_mtime_ns)
        self._seen[folder.name] = identity  # only its own write: others' stay news for changes()
        model = PublishedModel.read(folder)
        self._catalog[folder.name] = (identity, model)
        self._sorted, self._ids, self._kinds = None, None, None
        self._written.add(folder.name)
        return model

    # `list` is a method of this class from here on: the type is spelt builtins.list.
    def ids(self, *, max_age: float = 0.0) -> builtins.list[str]:
        return [m.id for m in self.list(max_age=max_age)]

    def get(self, model_id: str) -> PublishedModel:
        folder = self.repository / model_id
        for _ in range(GET_TRIES):
            if not (folder / DEPLOYMENT_FILE).is_file():
                break
            try:
                return PublishedModel.read(folder)
            except (FileNotFoundError, NotADirectoryError):  # a republish's swap (two renames), or a delete
                time.sleep(GET_RETRY_SECS)
        raise NotFoundError(f"model '{model_id}' is not published", hint="list models with `snoozectl status`")

    def known(self, model_id: str) -> PublishedModel:
        """``get``, from the catalog where it holds the model (no file read; another writer's republish since the
        last scan is seen at the next one, and followed by ``changes``)."""
        with self._lock:
            entry = self._catalog.get(model_id)
        return entry[1] if entry is not None else self.get(model_id)

    def exists(self, model_id: str) -> bool:
        return (self.repository / model_id / DEPLOYMENT_FILE).is_file()

    def gone(self, model_ids: builtins.list[str]) -> builtins.list[str]:
        """Those of ``model_ids`` whose folder is not in the repository at all (deleted; a folder that is not
        snoozeml's stays someone's), looked at while no writer is between a republish's two renames."""
        with self._lock, repository_lock(self.repository):
            return [m for m in model_ids if not (self.repository / m).exists()]

    def publish(self, spec: ModelSpec, *, source_hash: str = "") -> PublishedModel:
        """Render (validating everything) and move the model folder into place in one rename. ``source_hash``: the
        content hash of the package it came from, kept in its record (a restart adopts an unchanged one)."""
        # written whole outside the locks (publishes in parallel overlap their file writes), moved in under them
        return self.commit(stage_published(spec, self.repository, self.target, source_hash=source_hash), spec.id)

    def commit(self, staged: Path, model_id: str) -> PublishedModel:
        """Move a model folder staged by ``stage_published`` (here, or in a publishing helper process) into place,
        under the locks; the staged folder goes whatever happens."""
        committing = False
        try:
            with self._lock, repository_lock(self.repository):
                committing = True  # the commit removes the staging folder, whatever happens
                folder = commit_model(staged, self.repository, model_id)
                return self._note(folder)
        finally:
            if not committing:  # taking the locks failed (or was interrupted): the staged folder goes
                shutil.rmtree(staged, ignore_errors=True)

    def delete(self, model_id: str) -> None:
        with self._lock, repository_lock(self.repository):
            removed = remove_model(self.repository, model_id)
            self._seen.pop(model_id, None)
            self._catalog.pop(model_id, None)
            self._sorted, self._ids, self._kinds = None, None, None
            self._written.add(model_id)
        if not removed:
            raise NotFoundError(f"model '{model_id}' is not published")
