"""Async admin client for Triton's HTTP (KServe v2 + extensions) and metrics endpoints."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import httpx

from controlplane.errors import NotFoundError, TritonError, TritonModelLoadError, UnavailableError


class IndexState(StrEnum):
    """A model's state in Triton's repository index (core ``ModelReadyState``), as its clients read it."""

    UNKNOWN = "UNKNOWN"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"  # not loaded: never, unloaded, or its load failed
    LOADING = "LOADING"
    UNLOADING = "UNLOADING"


BUSY_STATES = {IndexState.READY, IndexState.LOADING, IndexState.UNLOADING}  # any other state (or none): unloaded

_PENDING_RE = re.compile(r"^nv_inference_pending_request_count\{([^}]*)\}\s+(\S+)", re.MULTILINE)
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class RepositoryEntry:
    name: str
    version: str | None
    state: str | None
    reason: str | None


@dataclass(frozen=True)
class ModelStats:
    """One model version's statistics; durations are cumulative nanoseconds."""

    name: str
    version: str
    last_inference_ms: int  # ms since the epoch; 0 = never
    inference_count: int
    execution_count: int
    success_count: int
    success_ns: int
    fail_count: int
    queue_count: int
    queue_ns: int
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelStats:
        stats = data.get("inference_stats", {})

        def part(key: str, field: str) -> int:
            return int(stats.get(key, {}).get(field, 0))

        return cls(
            name=data["name"],
            version=str(data.get("version", "")),
            last_inference_ms=int(data.get("last_inference", 0)),
            inference_count=int(data.get("inference_count", 0)),
            execution_count=int(data.get("execution_count", 0)),
            success_count=part("success", "count"),
            success_ns=part("success", "ns"),
            fail_count=part("fail", "count"),
            queue_count=part("queue", "count"),
            queue_ns=part("queue", "ns"),
            compute_input_ns=part("compute_input", "ns"),
            compute_infer_ns=part("compute_infer", "ns"),
            compute_output_ns=part("compute_output", "ns"),
        )


def parse_pending_request_counts(metrics_text: str) -> dict[str, float]:
    """``nv_inference_pending_request_count`` per model (summed over versions) from Prometheus text."""
    counts: dict[str, float] = {}
    for labels, value in _PENDING_RE.findall(metrics_text):
        model = dict(_LABEL_RE.findall(labels)).get("model")
        if model is not None:
            counts[model] = counts.get(model, 0.0) + float(value)
    return counts


def _error_text(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error", response.text))
    except (ValueError, AttributeError):
        return response.text or f"HTTP {response.status_code}"


class TritonAdminClient:
    """Health, repository (load/unload), statistics, config and metrics calls against one Triton."""

    def __init__(
        self,
        http_url: str,
        metrics_url: str | None = None,
        *,
        timeout: float = 10.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        """``headers`` go with every call, e.g. the key of Triton's restricted repository API."""
        self.http_url = http_url.rstrip("/")
        self.metrics_url = metrics_url.rstrip("/") if metrics_url else None
        self.timeout = timeout
        self._http = httpx.AsyncClient(base_url=self.http_url, timeout=timeout, headers=headers)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> TritonAdminClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, *, timeout: float | None = None, **kw: Any) -> httpx.Response:
        try:
            return await self._http.request(method, path, timeout=timeout or self.timeout, **kw)
        except httpx.TimeoutException as e:
            raise UnavailableError(
                f"Triton at {self.http_url} did not answer {method} {path} within {timeout or self.timeout}s"
            ) from e
        except httpx.TransportError as e:
            raise UnavailableError(
                f"Triton at {self.http_url} is not reachable ({type(e).__name__}: {e})",
                hint="is tritonserver running? check its log",
                retry_after=1,
            ) from e

    async def _ok(self, path: str) -> bool:
        try:
            return (await self._request("GET", path)).status_code == 200
        except UnavailableError:
            return False

    async def live(self) -> bool:
        return await self._ok("/v2/health/live")

    async def ready(self) -> bool:
        return await self._ok("/v2/health/ready")

    async def model_ready(self, name: str) -> bool:
        return await self._ok(f"/v2/models/{name}/ready")

    async def repository_index(self, ready_only: bool = False) -> list[RepositoryEntry]:
        r = await self._request("POST", "/v2/repository/index", json={"ready": ready_only})
        if r.status_code != 200:
            raise TritonError(f"Triton repository index failed: {_error_text(r)}")
        return [RepositoryEntry(e["name"], e.get("version"), e.get("state"), e.get("reason")) for e in r.json()]

    async def load(self, name: str, config: dict[str, Any] | None = None, timeout: float = 300) -> None:
        """Load (or reload) a model; Triton answers once it is loaded or failed.

        ``config`` (Triton's JSON form of a complete ModelConfig) replaces config.pbtxt for this load.
        """
        body = {"parameters": {"config": json.dumps(config)}} if config is not None else {}
        try:
            r = await self._request("POST", f"/v2/repository/models/{name}/load", json=body, timeout=timeout)
        except UnavailableError as e:
            if isinstance(e.__cause__, httpx.TimeoutException):
                raise TritonModelLoadError(
                    name, f"not loaded within {timeout}s", hint="raise the model's load_timeout_secs"
                ) from e
            raise
        if r.status_code != 200:
            raise TritonModelLoadError(name, _error_text(r))

    async def unload(self, name: str, wait: bool = True, timeout: float = 60) -> None:
        """Unload a model; with ``wait``, poll the index until it is UNAVAILABLE or absent."""
        deadline = time.monotonic() + timeout
        r = await self._request("POST", f"/v2/repository/models/{name}/unload", json={}, timeout=timeout)
        if r.status_code != 200:
            raise TritonError(f"Triton failed to unload model '{name}': {_error_text(r)}")
        if not wait:
            return
        await wait_unloaded(self, name, deadline - time.monotonic(), after=timeout)

    async def model_stats(self, name: str, version: str = "") -> ModelStats:
        """One version's statistics (``version``; else the last version Triton lists)."""
        return (await self.version_stats(name, version))[-1]

    async def version_stats(self, name: str, version: str = "") -> list[ModelStats]:
        """The statistics of each version of the model that Triton serves (``version``: that one only)."""
        path = f"/v2/models/{name}/versions/{version}/stats" if version else f"/v2/models/{name}/stats"
        r = await self._request("GET", path)
        if r.status_code != 200:
            raise NotFoundError(f"no statistics for model '{name}': {_error_text(r)}")
        stats = [ModelStats.from_json(s) for s in r.json().get("model_stats", [])]
        if not stats:
            raise NotFoundError(f"no statistics for model '{name}'")
        return stats

    async def all_stats(self) -> dict[str, list[ModelStats]]:
        """Every loaded model's statistics in one call, by model (one entry per version it serves); a model that is
        not loaded has none."""
        r = await self._request("GET", "/v2/models/stats")
        if r.status_code != 200:
            raise TritonError(f"Triton did not give its models' statistics: {_error_text(r)}")
        by_model: dict[str, list[ModelStats]] = {}
        for data in r.json().get("model_stats", []):
            stats = ModelStats.from_json(data)
            by_model.setdefault(stats.name, []).append(stats)
        return by_model

    async def model_config(self, name: str) -> dict[str, Any]:
        r = await self._request("GET", f"/v2/models/{name}/config")
        if r.status_code != 200:
            raise NotFoundError(f"no config for model '{name}': {_error_text(r)}")
        return r.json()

    async def metrics_text(self) -> str:
        """The Prometheus text from Triton's metrics port."""
        if self.metrics_url is None:
            raise TritonError("this client was created without a metrics_url")
        try:
            r = await self._http.get(f"{self.metrics_url}/metrics")
        except httpx.TransportError as e:
            raise UnavailableError(f"Triton metrics at {self.metrics_url} not reachable: {e}") from e
        if r.status_code != 200:
            raise TritonError(f"Triton metrics answered HTTP {r.status_code}")
        return r.text

    async def pending_request_counts(self) -> dict[str, float]:
        return parse_pending_request_counts(await self.metrics_text())


async def wait_unloaded(triton: Any, name: str, timeout: float, *, after: float | None = None) -> None:
    """Poll ``triton``'s repository index (any object with ``repository_index``) until the model is UNAVAILABLE
    or absent; TritonError when it is still busy after ``timeout`` seconds (``after``: the seconds the message
    names, since the unload call). Timed on the event loop's clock, the one its polls sleep on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.01
    while True:
        busy = [e for e in await triton.repository_index() if e.name == name and e.state in BUSY_STATES]
        if not busy:
            return
        if loop.time() >= deadline:
            raise TritonError(
                f"model '{name}' is still {busy[0].state} {timeout if after is None else after:g}s after its unload",
                hint="a python model's finalize() may hang; restarting Triton always frees it",
            )
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.2)


async def wait_for_triton(http_url: str, headers: dict[str, str] | None, timeout: float) -> None:
    """Return once the Triton at ``http_url`` is live; UnavailableError naming it after ``timeout`` seconds.

    An external Triton may start after the control plane (two containers of one pod start together).
    """
    deadline = time.monotonic() + timeout
    async with TritonAdminClient(http_url, headers=headers, timeout=2.0) as triton:
        while not await triton.live():
            if time.monotonic() > deadline:
                raise UnavailableError(
                    f"Triton at {http_url} did not become live within {timeout:g}s",
                    hint="start tritonserver (snoozectl triton, or its container) or fix --triton-url; "
                    "SNOOZE_TRITON_WAIT_SECS sets how long to wait",
                )
            await asyncio.sleep(0.5)
