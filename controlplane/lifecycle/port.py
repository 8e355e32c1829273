"""The lifecycle as the rest of the control plane sees it: the one port the gateway's activator and the control API
call (``LifecycleManager`` is what implements it; tests may hand in their own)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

from controlplane.lifecycle.overrides import KEEP_OVERRIDE
from controlplane.lifecycle.state import ModelState, ModelStatus, UnloadReason


class LifecyclePort(Protocol):
    def serving(self, model_id: str, *, timeout: float | None = None) -> contextlib.AbstractAsyncContextManager[None]:
        """Wake the model (single flight), then hold it loaded while the block runs."""
        ...

    async def admit(self, model_id: str, request_id: str) -> None:
        """Raises ``ModelProcessDiedError`` if the request already ran in a model process that died."""

    async def admit_doze_wake(self, model_id: str, stub: tuple[int, int] | None, *, timeout: float) -> dict[str, Any]:
        """A dozing stub about to fork asks room for its wake: ``{"admitted": bool, "why": str | None}``, within
        ``timeout`` seconds; never refused."""
        ...

    async def after_dead_answer(self, model_id: str, request_id: str) -> None:
        """Raises unless the request is safe to send again after a dead process answered it."""

    async def load(
        self, model_id: str, *, instances: int | None = None, override: dict[str, Any] | None | object = KEEP_OVERRIDE
    ) -> ModelStatus:
        """Load (API, repository load); ``override``: a client's config override, or None for a load without one."""
        ...

    async def unload(self, model_id: str, *, reason: UnloadReason | str = UnloadReason.API) -> ModelStatus: ...

    async def published(self, model_id: str) -> None:
        """After a (re)publish: a loaded model runs the new version."""

    async def forget(self, model_id: str) -> None:
        """Before a delete: unloaded, its record dropped."""

    def config_override(self, model_id: str) -> dict[str, Any] | None:
        """The client's config override the model loads with, or None."""
        ...

    def status(self, model_id: str) -> ModelStatus: ...

    def statuses(self, model_ids: list[str]) -> list[ModelStatus]:
        """``status`` of each of ``model_ids``, in their order (a listing: what is shared is read once)."""
        ...

    def states_of(self, model_ids: list[str]) -> list[ModelState]:
        """The state of each of ``model_ids``, in their order, as their statuses say it (a listing's filter: no
        status is built)."""
        ...

    def runtime(self) -> dict[str, Any]:
        """The preloaded parents, the server's own memory, the budgets, the wake queue."""
        ...

    def add_state_listener(self, listener: Callable[[str, ModelState | None], None]) -> None:
        """``listener(model, state)`` now for every model, then on every change (None: the record was dropped)."""

    def remove_state_listener(self, listener: Callable[[str, ModelState | None], None]) -> None: ...
