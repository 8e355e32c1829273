"""The lifecycle as the gateway sees it: the one interface the activator talks to (its ``Waker``).

The gateway never reaches into the lifecycle's modules: what it needs (wake and hold a model, run a request
at most once, a repository load with a client's override, the config a sleeping model would load with,
states) goes through ``GatewayPort``, which wraps the manager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from controlplane.lifecycle.loading import config_for
from controlplane.lifecycle.overrides import ForbiddenOverrideError, MalformedOverrideError, parse_override
from controlplane.store import PublishedModel

if TYPE_CHECKING:
    from controlplane.lifecycle.manager import LifecycleManager

__all__ = ["ForbiddenOverrideError", "GatewayPort", "MalformedOverrideError"]


class GatewayPort:
    """``LifecycleManager`` narrowed to what the activator may ask of it."""

    def __init__(self, manager: LifecycleManager) -> None:
        self.manager = manager

    def serving(self, model_id: str, *, timeout: float | None = None) -> contextlib.AbstractAsyncContextManager[None]:
        """``ensure_ready`` (wake, single flight), then hold the model loaded while the block runs."""
        return self.manager.serving(model_id, timeout=timeout)

    async def admit(self, model_id: str, request_id: str) -> None:
        """Raises if the request already ran in a model process that died."""
        await self.manager.admit(model_id, request_id)

    async def after_dead_answer(self, model_id: str, request_id: str) -> None:
        """Raises unless the request is safe to send again after a dead process answered it."""
        await self.manager.after_dead_answer(model_id, request_id)

    async def load(self, model_id: str, override_text: str | None = None) -> Any:
        """A repository load; ``override_text``: the client's ``config`` parameter (raises
        ``MalformedOverrideError`` / ``ForbiddenOverrideError`` for one the lifecycle refuses)."""
        override = None if override_text is None else parse_override(override_text, model_id)
        return await self.manager.load(model_id, override=override)

    def overridden_config(self, model: PublishedModel) -> dict[str, Any] | None:
        """The config ``model`` loads with when a client's override holds (its published config with the override
        merged in); None when there is none (it loads with its published config.pbtxt as it is)."""
        override = self.manager.config_override(model.id)
        return None if not override else config_for(model, override)

    async def unload(self, model_id: str, *, reason: str = "api") -> Any:
        return await self.manager.unload(model_id, reason=reason)

    def status(self, model_id: str) -> Any:
        return self.manager.status(model_id)

    def add_state_listener(self, listener: Callable[[str, Any], None]) -> None:
        self.manager.add_state_listener(listener)

    def remove_state_listener(self, listener: Callable[[str, Any], None]) -> None:
        self.manager.remove_state_listener(listener)
