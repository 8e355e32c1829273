"""The one error root of snoozeml.

Every error the project raises on purpose is a ``SnoozeError``: it carries an HTTP status, a
stable machine-readable ``code``, a human ``message`` and, where one exists, a ``hint`` naming the fix.
"""

from __future__ import annotations


class SnoozeError(Exception):
    """Base error: ``SnoozeError(message, *, hint=None)``."""

    status_code: int = 500
    code: str = "internal"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} (fix: {self.hint})" if self.hint else self.message

    def to_dict(self) -> dict[str, str | None]:
        return {"error": self.message, "code": self.code, "hint": self.hint}


class NotFoundError(SnoozeError):
    status_code = 404
    code = "not_found"


class InvalidPackageError(SnoozeError):
    status_code = 422
    code = "invalid_package"


class ConflictError(SnoozeError):
    status_code = 409
    code = "conflict"


class UnavailableError(SnoozeError):
    """Temporarily unable to serve; ``retry_after`` (seconds) feeds the Retry-After header."""

    status_code = 503
    code = "unavailable"

    def __init__(self, message: str, *, hint: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message, hint=hint)
        self.retry_after = retry_after


class AuthError(SnoozeError):
    status_code = 401
    code = "unauthorized"


class ForbiddenError(SnoozeError):
    status_code = 403
    code = "forbidden"


class TritonLaunchError(SnoozeError):
    """tritonserver could not be found, prepared or started."""

    status_code = 500
    code = "triton_launch_failed"


class GatewayError(SnoozeError):
    """Envoy could not be found, configured or started."""

    status_code = 500
    code = "gateway_failed"


class TritonError(SnoozeError):
    """Triton answered an admin request with an error, or did not answer at all."""

    status_code = 502
    code = "triton_error"


class TritonModelLoadError(TritonError):
    """Triton failed to load (or unload) a model; ``reason`` is Triton's own message."""

    code = "model_load_failed"

    def __init__(self, name: str, reason: str, *, hint: str | None = None) -> None:
        super().__init__(f"Triton failed to load model '{name}': {reason}", hint=hint)
        self.model_name = name
        self.reason = reason
