"""A synchronous client of the control API (what `snoozectl publish/status/load/...` use).

Server errors come back as ``ControlPlaneError`` carrying the server's message, code and hint."""

from __future__ import annotations

import json
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import httpx

from controlplane.errors import SnoozeError

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
_SKIPPED = {"__pycache__", ".git", ".ipynb_checkpoints", ".DS_Store"}

Progress = Callable[[int, int], None]  # (bytes sent, total bytes)


class ControlPlaneError(SnoozeError):
    """An error answered by the control API (or the API could not be reached)."""

    def __init__(
        self, message: str, *, hint: str | None = None, status_code: int = 500, code: str = "internal"
    ) -> None:
        super().__init__(message, hint=hint)
        self.status_code = status_code
        self.code = code


def default_model_id(path: Path) -> str:
    """A package's id when none is given: its folder or archive name without the suffix."""
    name = path.resolve().name
    for suffix in ARCHIVE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def pack_package(folder: Path, out: IO[bytes]) -> None:
    """Write the package folder as a .tar.gz with its files at the root (caches left out)."""

    def skip_caches(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if _SKIPPED.intersection(Path(info.name).parts) else info

    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for child in sorted(folder.iterdir()):
            if child.name not in _SKIPPED:
                tar.add(child, arcname=child.name, filter=skip_caches)


class _ProgressReader:
    """A file wrapper that reports how much of it httpx has read."""

    def __init__(self, file: IO[bytes], total: int, progress: Progress) -> None:
        self._file, self._total, self._progress, self._sent = file, total, progress, 0

    def read(self, size: int = -1) -> bytes:
        chunk = self._file.read(size)
        self._sent += len(chunk)
        self._progress(self._sent, self._total)
        return chunk

    def fileno(self) -> int:  # lets httpx learn the length (Content-Length instead of chunked)
        return self._file.fileno()


class ControlPlaneClient:
    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float = 600.0) -> None:
        headers = {"X-API-Key": api_key} if api_key else {}
        self.base_url = base_url.rstrip("/")
        # Loads and publishes can take minutes (cold start, big packages): long reads, short connects.
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=httpx.Timeout(timeout, connect=10.0))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ControlPlaneClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TimeoutException as exc:
            raise ControlPlaneError(
                f"the control API at {self.base_url} did not answer {method} {path} in time",
                hint="the server may still be working (a slow cold start); check `snoozectl status`",
                status_code=504,
                code="timeout",
            ) from exc
        except httpx.TransportError as exc:
            raise ControlPlaneError(
                f"cannot reach the control API at {self.base_url} ({type(exc).__name__}: {exc})",
                hint="is `snoozectl serve` running? point --url (or SNOOZE_API_URL) at its API port",
                status_code=503,
                code="unreachable",
            ) from exc
        if r.is_success:
            return r.json() if r.content else None
        try:
            body = r.json()
            message, hint, code = str(body["error"]), body.get("hint"), str(body.get("code", "internal"))
        except (ValueError, KeyError, TypeError):
            raise ControlPlaneError(
                f"{method} {path}: HTTP {r.status_code}: {r.text[:500]}",
                status_code=r.status_code,
                hint="is --url the snoozeml control API (not the inference gateway)?",
            ) from None
        raise ControlPlaneError(message, hint=hint, status_code=r.status_code, code=code)

    # --- publish

    def publish_path(self, path: str | Path, model_id: str, **deployment: Any) -> dict[str, Any]:
        """Publish a folder on the server's filesystem (the server must allow local paths)."""
        body = {**deployment, "id": model_id, "path": str(Path(path).resolve())}
        return self._call("POST", "/v1/models:from-path", json=body)

    def publish_archive(
        self, path: str | Path, model_id: str, *, progress: Progress | None = None, **deployment: Any
    ) -> dict[str, Any]:
        """Upload a package: an archive as it is, or a folder packed into a temporary .tar.gz."""
        source = Path(path)
        if not source.exists():
            raise ControlPlaneError(
                f"{source}: no such file or folder",
                hint="pass the package folder (it is packed for you) or an archive of it",
                code="invalid_package",
                status_code=422,
            )
        if source.is_dir():
            with tempfile.TemporaryFile() as tmp:
                pack_package(source, tmp)
                return self._upload(tmp, f"{source.resolve().name}.tar.gz", model_id, deployment, progress)
        if not source.name.endswith(ARCHIVE_SUFFIXES):
            raise ControlPlaneError(
                f"{source}: not a package folder or a {', '.join(ARCHIVE_SUFFIXES)} archive",
                hint="pass the package folder (it is packed for you) or an archive of it",
                code="invalid_package",
                status_code=422,
            )
        try:
            with open(source, "rb") as file:
                return self._upload(file, source.name, model_id, deployment, progress)
        except FileNotFoundError as exc:
            raise ControlPlaneError(
                f"{source}: no such file or folder", status_code=422, code="invalid_package"
            ) from exc

    def _upload(
        self, file: IO[bytes], name: str, model_id: str, deployment: dict[str, Any], progress: Progress | None
    ) -> dict[str, Any]:
        total = file.seek(0, 2)
        file.seek(0)
        body: IO[bytes] | _ProgressReader = _ProgressReader(file, total, progress) if progress else file
        return self._call(
            "POST",
            "/v1/models",
            params={"id": model_id},
            data={"deployment": json.dumps(deployment)},
            files={"package": (name, body, "application/octet-stream")},
        )

    # --- read and change

    def live(self) -> None:
        """Raise ControlPlaneError unless the control API answers (no key needed)."""
        self._call("GET", "/health/live")

    def list(self, **filters: str | int) -> list[dict[str, Any]]:
        """Published models; ``filters``: state, kind, prefix, limit, after (``GET /v1/models``)."""
        return self._call("GET", "/v1/models", params=filters or None)

    def summary(self, top: int = 10) -> dict[str, Any]:
        """Counts by state and kind, memory, the largest and most recently used models, publishing's progress."""
        return self._call("GET", "/v1/models:summary", params={"top": top})

    def runtime(self) -> dict[str, Any]:
        return self._call("GET", "/v1/runtime")

    def get(self, model_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/models/{model_id}")

    def delete(self, model_id: str) -> None:
        self._call("DELETE", f"/v1/models/{model_id}")

    def load(self, model_id: str, instances: int | None = None) -> dict[str, Any]:
        return self._call("POST", f"/v1/models/{model_id}/load", json={"instances": instances})

    def unload(self, model_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/models/{model_id}/unload")
