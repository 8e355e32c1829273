"""API keys and scopes, free of any web framework (the control API and the activator both use it).

A key is read from ``X-API-Key`` or ``Authorization: Bearer <key>`` (HTTP headers or gRPC metadata,
any case). Every configured key is compared, in constant time, on every check: the time taken does
not tell which key, or how much of one, matched. ``admin`` implies ``inference``.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from enum import StrEnum

from controlplane.errors import AuthError, ForbiddenError, SnoozeError
from controlplane.metrics import SnoozeMetrics
from controlplane.modes import AuthMode
from controlplane.settings import Settings

_KEY_HINT = "send the key as 'X-API-Key: <key>' or 'Authorization: Bearer <key>'"


class Scope(StrEnum):
    INFERENCE = "inference"
    ADMIN = "admin"


def presented_key(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> str | None:
    """The key a request carries, or None. Accepts a header mapping or gRPC metadata pairs."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    api_key = bearer = None
    for name, value in pairs:
        lowered = name.lower()
        if lowered == "x-api-key" and api_key is None:
            api_key = value.strip()
        elif lowered == "authorization" and bearer is None:
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                bearer = token.strip()
    return api_key or bearer


def _matches_any(key: bytes, keys: Iterable[bytes]) -> bool:
    found = False
    for candidate in keys:  # no early exit: every key is compared on every call
        found |= hmac.compare_digest(key, candidate)
    return found


def key_scopes(settings: Settings, key: str) -> set[Scope]:
    """The scopes a key grants (empty for an unknown key)."""
    raw = key.encode()
    admin = _matches_any(raw, (k.get_secret_value().encode() for k in settings.admin_keys))
    inference = _matches_any(raw, (k.get_secret_value().encode() for k in settings.api_keys))
    if admin:
        return {Scope.ADMIN, Scope.INFERENCE}
    return {Scope.INFERENCE} if inference else set()


def check_scope(
    settings: Settings,
    headers: Mapping[str, str] | Iterable[tuple[str, str]],
    scope: Scope | str,
    *,
    metrics: SnoozeMetrics | None = None,
    surface: str = "api",
) -> None:
    """Return if the request may act with ``scope``; raise AuthError (401) or ForbiddenError (403).

    Refusals are counted in ``metrics.auth_failures`` by ``surface`` (api, activator, ...) and reason."""
    if settings.auth == AuthMode.OFF:
        return
    refusal = _refusal(settings, presented_key(headers), Scope(scope))
    if refusal is not None:
        reason, error = refusal
        if metrics is not None:
            metrics.auth_failures.labels(surface=surface, reason=reason).inc()
        raise error


def _refusal(settings: Settings, key: str | None, wanted: Scope) -> tuple[str, SnoozeError] | None:
    """(metrics reason, error) when the request is refused, else None."""
    if not settings.api_keys and not settings.admin_keys:
        return "no_keys_configured", AuthError(
            "authentication is on but the server has no API keys configured",
            hint="set SNOOZE_ADMIN_KEYS / SNOOZE_API_KEYS on the server, or SNOOZE_AUTH=off for local use only",
        )
    if key is None:
        return "missing", AuthError("missing API key", hint=_KEY_HINT)
    scopes = key_scopes(settings, key)
    if not scopes:
        return "invalid", AuthError("invalid API key", hint="check the key; " + _KEY_HINT)
    if wanted not in scopes:
        return "scope", ForbiddenError(
            f"this API key does not have the '{wanted.value}' scope",
            hint="use an admin key (SNOOZE_ADMIN_KEYS)" if wanted is Scope.ADMIN else None,
        )
    return None
