"""What the control-API commands share: the URL and key options, and a client whose errors end the command."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from controlplane.cli.output import err_console, fail
from controlplane.errors import SnoozeError

if TYPE_CHECKING:
    from controlplane.api.client import ControlPlaneClient


def default_url(env: Mapping[str, str] = os.environ) -> str:
    """The control API of a serve on this machine: on ``SNOOZE_API_PORT``, as ``snoozectl serve`` reads it."""
    port = env.get("SNOOZE_API_PORT", "").strip() or "8080"
    return f"http://127.0.0.1:{port}"


DEFAULT_URL = default_url()

Url = Annotated[
    str, typer.Option("--url", envvar="SNOOZE_API_URL", help="Control API URL [http://127.0.0.1:SNOOZE_API_PORT]")
]
ApiKey = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="SNOOZE_API_KEY",
        show_default=False,
        help="An admin key of the control API (every /v1 call needs one; inference keys only infer)",
    ),
]

T = TypeVar("T")


@contextmanager
def open_client(url: str, api_key: str | None, as_json: bool) -> Iterator[ControlPlaneClient]:
    """A client whose errors end the command as `error: ...` + `fix: ...` (or JSON) with exit code 1."""
    from controlplane.api.client import ControlPlaneClient  # httpx: imported only by commands that use it

    try:
        with ControlPlaneClient(url, api_key) as client:
            yield client
    except SnoozeError as exc:
        raise fail(exc, as_json) from None


def waiting(message: str, as_json: bool, call: Callable[[], T]) -> T:
    if as_json:
        return call()
    with err_console.status(message):
        return call()
