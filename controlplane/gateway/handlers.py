"""What the activator answers, whatever the protocol: the gateway's handlers.

``ModelAnswers`` wakes a model and forwards a request under its hold (run once: ``forward``), and answers
readiness, metadata, config, the repository index and the admin calls for a published model as if it were
loaded. ``ReadyFlags`` tells the wake filter which models are loaded; ``HoldRegistry`` keeps a model in use
for the requests the wake filter let through. The HTTP (``http_adapter``) and gRPC (``grpc_adapter``)
adapters translate their protocol to these calls and the answers back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2

from controlplane.auth import Scope, check_scope
from controlplane.clock import SYSTEM_CLOCK, Clock
from controlplane.errors import NotFoundError, SnoozeError, TritonModelLoadError, UnavailableError
from controlplane.gateway import triton_words as words
from controlplane.gateway.triton_words import UnknownModelError
from controlplane.lifecycle.configs import config_for
from controlplane.lifecycle.overrides import ForbiddenOverrideError, MalformedOverrideError, parse_override
from controlplane.lifecycle.port import LifecyclePort
from controlplane.lifecycle.state import ModelState, UnloadReason
from controlplane.publishing import RETRY_AFTER_SECS, Publishing
from controlplane.render import VERSION, parse_config
from controlplane.settings import Settings
from controlplane.spec.schema import TensorSpec
from controlplane.store import ModelStore, PublishedModel
from controlplane.triton.client import IndexState

log = logging.getLogger("snoozeml.activator")
T = TypeVar("T")
# Lifecycle state -> Triton repository-index state, the vocabulary tritonclient users know.
INDEX_STATES = {
    ModelState.READY: IndexState.READY,
    ModelState.LOADING: IndexState.LOADING,
    ModelState.UNLOADING: IndexState.UNLOADING,
    ModelState.UNLOADED: IndexState.UNAVAILABLE,
    ModelState.FAILED: IndexState.UNAVAILABLE,
}


class ModelAnswers:
    """What the activator answers, shared by HTTP and gRPC: wake, readiness, metadata, config, index, admin."""

    def __init__(
        self, lifecycle: LifecyclePort, store: ModelStore, settings: Settings, *, publishing: Publishing | None = None
    ) -> None:
        self.lifecycle = lifecycle
        self.store = store
        self.settings = settings
        self.publishing = publishing  # `serve --models` publishing in the background: a model may be on its way
        # Unloaded by a client through Triton's repository API: not ready (Triton's answer after an unload)
        # until the model is READY again (a repository load, or a request that woke it).
        self.unloaded_by_client: set[str] = set()

    def published_for_load(self, name: str) -> PublishedModel:
        """``published`` for a repository load: an unpublished model in Triton's words for a load (500)."""
        try:
            return self.store.get(name)
        except NotFoundError as e:
            raise words.LoadUnknownModelError(name, e) from None

    async def unload(self, name: str) -> None:
        """Repository unload (admin): the model sleeps now and reports not ready until it is loaded again."""
        await self.lifecycle.unload(name, reason=UnloadReason.API)
        if self.state(name) is not ModelState.READY:
            self.unloaded_by_client.add(name)

    def on_state(self, name: str, state: Any) -> None:
        """Lifecycle state listener: a model READY again (or gone) is no longer one a client unloaded."""
        if state is None or state == ModelState.READY:
            self.unloaded_by_client.discard(name)

    def published(self, name: str, version: str = "") -> PublishedModel:
        """The published model; else Triton's own "unknown model" words (404), snoozeml's reason after."""
        try:
            model = self.store.get(name)
        except NotFoundError as e:
            if self.publishing is not None and self.publishing.waiting(name):
                raise words.NotYetPublishedError(name, self.publishing.retry_hint(name), RETRY_AFTER_SECS) from None
            if self.publishing is not None and (why := self.publishing.failed.get(name)):
                raise UnknownModelError(
                    words.not_found(name), f"the server refused its package at start: {why}"
                ) from None
            raise UnknownModelError(words.not_found(name), e) from None
        if version and version not in model.versions:
            served = ", ".join(model.versions)
            raise UnknownModelError(
                words.version_not_found(name, version), f"model '{name}' is published to serve version(s) {served}"
            )
        return model

    @contextlib.asynccontextmanager
    async def serving(self, name: str, timeout: float | None = None) -> AsyncIterator[None]:
        """Wake the model and keep it loaded (no idle unload, no eviction) until the block ends.

        A load that failed or outlived the deadline answers with Triton's words for a model without a
        loaded version first and snoozeml's reason after, as 503 / UNAVAILABLE with Retry-After (not
        Triton's 404): the next request tries the load again, so a client that retries 503 is right.
        The caller has checked that the model is published (``published``: Triton's words otherwise).
        """
        entered = False
        try:
            async with self.lifecycle.serving(name, timeout=timeout):
                entered = True
                yield
        except UnavailableError as e:
            if entered or isinstance(e, words.NotYetAvailableError):
                raise
            raise words.NotYetAvailableError(name, e) from e

    async def forward(
        self,
        name: str,
        request_id: str,
        send: Callable[[], Awaitable[T]],
        dead: Callable[[T], bool],
        *,
        version: str = "",
        timeout: float | None = None,
    ) -> T:
        """Wake the model and ``send()`` the request to Triton, at most once to a live model process.

        A request that already ran in a model process that died (Envoy retried its "stub not
        healthy" answer here) is refused with the crash. One that meets a dead stub here is sent again
        after recovery only when the journal shows it never reached a live process (``recovery``).
        """
        if self.publishing is not None:  # one still waiting to be published is published next, waited for a while
            await self.publishing.arrival(name)
        self.published(name, version)
        await self.lifecycle.admit(name, request_id)
        async with self.serving(name, timeout):
            answer = await send()
            if not dead(answer):
                return answer
            await self.lifecycle.after_dead_answer(name, request_id)
            answer = await send()
            if dead(answer):
                await self.lifecycle.after_dead_answer(name, request_id)
            return answer

    async def load(self, name: str, parameters: Mapping[str, Any]) -> None:
        """Repository load (admin) with the request's load parameters (``config``: the client's override, held
        through sleep and wake; ``file:`` ones are refused). A failed load answers in Triton's words and status:
        400 (load failed), or 500 for an override Triton could not read (``overrides``)."""
        files = [key for key in parameters if key != "config"]
        if files:  # never forwarded: Triton 2.51 aborts on a file: name longer than NAME_MAX
            raise words.RefusedLoadFilesError(
                name,
                BadRequestError(
                    f"load parameters {', '.join(sorted(files))} for model '{name}' are not accepted through the "
                    "gateway (only 'config')",
                    hint="publish a new package (snoozectl publish) to change a model's files",
                ),
            )
        text = parameters.get("config")
        try:
            await self.lifecycle.load(name, override=None if text is None else parse_override(text, name))
        except MalformedOverrideError as e:
            raise words.BadConfigOverrideError(name, e) from e
        except (TritonModelLoadError, ForbiddenOverrideError) as e:
            raise words.LoadFailedError(name, e) from e
        if self.state(name) is ModelState.FAILED:
            raise words.LoadFailedError(name, SnoozeError(self.lifecycle.status(name).reason or "unknown reason"))

    def state(self, name: str) -> ModelState:
        """The model's lifecycle state (``ModelStatus.state``)."""
        return ModelState(self.lifecycle.status(name).state)

    def ready(self, name: str) -> bool:
        """Published and not failed: a request would be served (after a wake if it sleeps). Not ready after a
        client's repository unload, as Triton answers (Triton's client examples check it), until loaded again."""
        published = self.store.exists(name)
        return published and self.state(name) is not ModelState.FAILED and name not in self.unloaded_by_client

    def served_versions(self, name: str) -> tuple[str, ...]:
        """The versions a published model serves (its config's version_policy); version 1 for an unknown one."""
        try:
            return self.store.get(name).versions
        except NotFoundError:
            return (VERSION,)

    def loaded(self, name: str) -> bool:
        return self.state(name) is ModelState.READY

    def config(self, model: PublishedModel) -> model_config_pb2.ModelConfig:
        """The config the model loads with: its published config.pbtxt, and a client's override if one holds."""
        override = self.lifecycle.config_override(model.id)
        overridden = config_for(model, override) if override else None
        if overridden is None:
            return parse_config(model.config_text, where=str(model.path / "config.pbtxt"))
        return json_format.ParseDict(overridden, model_config_pb2.ModelConfig())

    def metadata(self, model: PublishedModel) -> dict[str, Any]:
        """KServe v2 model metadata, as Triton answers it for the loaded model: each tensor's shape is its config's
        ``dims`` (not its ``reshape``: an item of rank 0 is ``[1]`` there, reshaped to ``[]``, and Triton says
        ``[-1, 1]``), the batch axis first."""
        config = self.config(model)
        batch = [-1] if config.max_batch_size > 0 else []
        inputs = {t.name: list(t.dims) for t in config.input}
        outputs = {t.name: list(t.dims) for t in config.output}

        def tensor(t: TensorSpec, dims: dict[str, list[int]]) -> dict[str, Any]:
            return {"name": t.name, "datatype": t.datatype, "shape": batch + dims.get(t.name, t.dims)}

        return {
            "name": model.id,
            "versions": list(model.versions),
            "platform": config.platform or config.backend,
            "inputs": [tensor(t, inputs) for t in model.inputs],
            "outputs": [tensor(t, outputs) for t in model.outputs],
        }

    def index(self, ready_only: bool) -> list[dict[str, str]]:
        entries = []
        for model in self.store.list():
            lifecycle_state = self.state(model.id)
            state = INDEX_STATES.get(lifecycle_state, IndexState.UNKNOWN)
            if ready_only and state is not IndexState.READY:
                continue
            reason = self.lifecycle.status(model.id).reason or lifecycle_state.value
            entries += [
                {"name": model.id, "version": version, "state": state.value, "reason": reason}
                for version in model.versions
            ]
        return entries

    def check_admin(self, headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> None:
        """Repository load/unload through the gateway need the admin scope (cold path: checked here)."""
        check_scope(self.settings, headers, Scope.ADMIN, surface="activator")


class BadRequestError(SnoozeError):
    status_code = 400
    code = "bad_request"


class ReadyFlags:
    """One file per READY model in ``folder``: what the wake filter reads to let a warm stream on without
    waiting for Python (``wake_lua``; only that it exists). Its one line, from ``describe``, is the hint the
    gateway adds to Triton's answer for an input the model does not have (``input_names_hint``).

    ``update`` is a lifecycle state listener: it runs synchronously inside the transition, so a flag goes
    away the moment the model leaves READY (an idle unload, an eviction, a recovery, Triton gone), before
    the transition awaits anything. Flags left by an earlier run are removed at ``open``.
    """

    def __init__(self, folder: Path, describe: Callable[[str], str] | None = None) -> None:
        self.folder = folder
        self.describe = describe
        self._open = False

    def open(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._open = True

    def close(self) -> None:
        self._open = False
        shutil.rmtree(self.folder, ignore_errors=True)

    def ready(self, model: str) -> bool:
        return (self.folder / model).is_file()

    def update(self, model: str, state: Any) -> None:
        if not self._open or not model or model.startswith(".") or "/" in model:
            return
        path = self.folder / model
        try:
            if state == ModelState.READY:
                text = self._describe(model)
                # Renamed into place: the gateway never reads half a line (a dot name is never a flag).
                partial = self.folder / f".{model}.partial"
                partial.write_text(text + "\n" if text else "", encoding="utf-8")
                os.replace(partial, path)
            else:
                path.unlink(missing_ok=True)
        except OSError as e:  # without its flag the model is only slower to stream (the cold path's call)
            log.warning("model '%s': ready flag %s not updated: %s", model, path, e)

    def _describe(self, model: str) -> str:
        if self.describe is None:
            return ""
        try:
            return self.describe(model)
        except Exception as e:  # a flag without its hint costs a line in one error, never the flag
            log.warning("model '%s': no input hint for the gateway: %s", model, e)
            return ""


def input_names_hint(record: Any) -> str:
    """The line the gateway adds to Triton's "unexpected inference input" for ``record`` (a PublishedModel)."""
    declared = ", ".join(f"'{t.name}' ({t.datatype}, dims {list(t.dims)})" for t in record.inputs)
    return (
        f"snoozeml: model '{record.id}' declares input(s) {declared}: send each input under its declared "
        "name (names are case-sensitive)"
    )


class HoldRegistry:
    """Models held in use for the requests the wake filter let through (streams, large bodies).

    ``hold`` wakes the model (single flight) and keeps it in use (``serving``: no idle unload, no
    eviction, no scale-down) until Envoy's access log of held requests (``held_log``, one hold token per
    line, written when the request ends, normally or by a reset) names its token: ``tail`` reads it.
    The wake filter sets the token before it calls, so an end logged before its hold was taken (the
    client went away during the wake) releases the hold at once; ends that never had a hold (an unknown
    model) are forgotten after ``ENDED_MEMORY_SECS``.
    """

    ENDED_MEMORY_SECS = 600.0

    def __init__(
        self, answers: ModelAnswers, held_log: Path, *, poll_secs: float = 0.05, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.answers = answers
        self.held_log = held_log
        self.poll_secs = poll_secs
        self.clock = clock
        self._holds: dict[str, tuple[str, contextlib.AsyncExitStack]] = {}
        self._ended: dict[str, float] = {}
        self._offset: int | None = None
        self.warm_holds = 0  # holds the wake filter sent without waiting (the model's ready flag was there)

    def held(self, model: str | None = None) -> int:
        """How many requests are held now (for ``model``, or all)."""
        return sum(1 for m, _ in self._holds.values() if model is None or m == model)

    async def hold(self, model: str, token: str, *, warm: bool = False) -> None:
        self.answers.published(model)
        self.warm_holds += warm
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(self.answers.serving(model))
        if not token or self._ended.pop(token, None) is not None or token in self._holds:
            await stack.aclose()
            return
        self._holds[token] = (model, stack)

    async def release(self, request_id: str) -> None:
        held = self._holds.pop(request_id, None)
        if held is None:
            self._ended[request_id] = self.clock.monotonic()
            return
        await held[1].aclose()

    def _new_lines(self) -> list[str]:
        try:
            size = self.held_log.stat().st_size
        except FileNotFoundError:
            self._offset = self._offset or 0
            return []
        if self._offset is None or size < self._offset:  # first look (older runs' lines), or a new file
            self._offset = size if self._offset is None else 0
            return []
        if size == self._offset:
            return []
        with open(self.held_log, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        complete = data.rfind(b"\n") + 1
        self._offset += complete
        return [line.strip().strip('"') for line in data[:complete].decode("utf-8", "replace").splitlines()]

    async def tail(self) -> None:
        """Release holds as Envoy logs their requests' ends (runs until cancelled)."""
        while True:
            for line in self._new_lines():
                for token in line.split(","):  # a stream that held several models: each one's token
                    if token and token != "-":
                        await self.release(token)
            now = self.clock.monotonic()
            for request_id, at in list(self._ended.items()):
                if now - at > self.ENDED_MEMORY_SECS:
                    del self._ended[request_id]
            await asyncio.sleep(self.poll_secs)

    async def aclose(self) -> None:
        for _, stack in list(self._holds.values()):
            await stack.aclose()
        self._holds.clear()
