"""Triton's own error words, the ones standard clients parse, for the answers the gateway gives itself.

Measured on the wheel's tritonserver 2.51 (``docs/internals.md``, "Errors clients parse"): a request for
a model Triton never loaded gets ``Request for unknown model: '<m>' is not found``; for one that was
loaded before or failed to load, ``... '<m>' has no available versions``; for a version it lacks,
``... '<m>' version <v> is not found``. HTTP 404 with ``{"error": ...}`` / gRPC NOT_FOUND, on infer,
generate, generate_stream, metadata and config alike (a stream gets it as an error message on the
stream). HTTP ``/ready`` answers 400 ``Model version not ready``; gRPC ``ModelReady`` answers
``ready: false`` without an error. Triton's client examples check ``message().startswith("Request for
unknown model")``, so snoozeml's explanation always comes after Triton's words, never before.
"""

from __future__ import annotations

from controlplane.errors import NotFoundError, SnoozeError, UnavailableError

UNKNOWN_MODEL = "Request for unknown model"
NOT_READY = "Model version not ready"


def not_found(name: str) -> str:
    return f"{UNKNOWN_MODEL}: '{name}' is not found"


def no_available_versions(name: str) -> str:
    return f"{UNKNOWN_MODEL}: '{name}' has no available versions"


def version_not_found(name: str, version: str) -> str:
    return f"{UNKNOWN_MODEL}: '{name}' version {version} is not found"


def explained(words: str, error: SnoozeError | str) -> str:
    """Triton's ``words`` first, then snoozeml's explanation (the error's message, without its hint)."""
    text = error.message if isinstance(error, SnoozeError) else error
    return f"{words}: snoozeml: {text}"


class UnknownModelError(NotFoundError):
    """A model (or version) the gateway cannot serve, in Triton's words: HTTP 404 / gRPC NOT_FOUND."""

    def __init__(self, words: str, explanation: SnoozeError | str, *, hint: str | None = None) -> None:
        if hint is None and isinstance(explanation, SnoozeError):
            hint = explanation.hint
        super().__init__(explained(words, explanation), hint=hint)


class NotYetAvailableError(UnavailableError):
    """A wake-up whose load failed or outlived its deadline: Triton's words, but 503 / UNAVAILABLE with
    Retry-After, since the next request tries the load again (a client that retries 503 does right)."""

    def __init__(self, name: str, cause: UnavailableError) -> None:
        super().__init__(explained(no_available_versions(name), cause), hint=cause.hint, retry_after=cause.retry_after)


class NotYetPublishedError(UnavailableError):
    """A model ``serve --models`` has still to publish (it publishes in the background): Triton's words for an
    unknown model, but 503 / UNAVAILABLE with Retry-After, since it will be there shortly."""

    def __init__(self, name: str, why: str, retry_after: float) -> None:
        super().__init__(
            explained(not_found(name), why),
            hint=f"retry after {retry_after:g}s: the server is publishing its models ('{name}' is next)",
            retry_after=retry_after,
        )


LOAD_FAILED = "load failed for model"
LOAD_UNKNOWN = "failed to load"  # Triton's client examples check `"failed to load" in message()`


def load_unknown(name: str) -> str:
    return f"{LOAD_UNKNOWN} '{name}', failed to poll from model repository"


class LoadUnknownModelError(SnoozeError):
    """A repository load of a model that is not published, as Triton answers one its repository lacks: HTTP 500 /
    gRPC INTERNAL, ``failed to load 'm', failed to poll from model repository``, snoozeml's reason after."""

    status_code = 500
    code = "not_found"

    def __init__(self, name: str, explanation: SnoozeError) -> None:
        super().__init__(explained(load_unknown(name), explanation), hint=explanation.hint)


class BadConfigOverrideError(LoadUnknownModelError):
    """A repository load whose config override Triton cannot read (not ModelConfig JSON): Triton 2.51 answers it
    as one its repository lacks (measured: HTTP 500 / gRPC INTERNAL, ``failed to load 'm', failed to poll from
    model repository``); snoozeml's reason after."""

    code = "bad_config_override"


class RefusedLoadFilesError(LoadUnknownModelError):
    """A repository load with ``file:`` parameters, refused before Triton sees it (Triton 2.51 aborts on a file name
    longer than NAME_MAX): as Triton answers a load whose repository poll failed, HTTP 500 / gRPC INTERNAL,
    ``failed to load 'm', failed to poll from model repository`` (Triton's model-control example checks it);
    snoozeml's reason after."""

    code = "load_files_refused"


class LoadFailedError(SnoozeError):
    """A repository load that failed, as Triton answers it: HTTP 400 / gRPC INVALID_ARGUMENT, its words first."""

    status_code = 400
    code = "model_load_failed"

    def __init__(self, name: str, cause: SnoozeError) -> None:
        reason = getattr(cause, "reason", None) or cause.message
        head = reason if reason.startswith(f"{LOAD_FAILED} '{name}'") else f"{LOAD_FAILED} '{name}': {reason}"
        super().__init__(head, hint=cause.hint or "fix the model and publish it again")


def internal_error_message(error: Exception) -> str:
    """What a client is told when the activator itself failed (a bug): what failed, and where to look."""
    return (
        f"snoozeml: internal error in the activator ({type(error).__name__}: {error}); the control plane's log has "
        "the traceback: please report it"
    )
