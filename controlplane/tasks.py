"""Tasks whose outcome is always read.

``asyncio.wait_for`` in Python 3.11 leaves its inner task's exception unread when the caller is cancelled just as
that task fails. The task is then logged as "exception was never retrieved" when it is collected, and Python 3.11
formats that traceback with ``ast.parse``. If the collection happens inside another ``ast.parse`` (a publish reads
the package's source), the nested parse breaks the outer one with ``SystemError: AST constructor recursion depth
mismatch`` (seen in the lifecycle tier). A caller that may give up on a task wraps it here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _read(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # read: the caller that gave up on it has its own answer


def read_task(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """``coro`` as a task whose exception counts as read even when nobody awaits it to the end."""
    task = asyncio.ensure_future(coro)
    task.add_done_callback(_read)
    return task
