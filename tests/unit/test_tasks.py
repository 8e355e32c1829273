"""``controlplane.tasks.read_task``: a task given up on leaves no "exception was never retrieved" behind."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from controlplane.tasks import read_task


async def _fails_soon() -> None:
    await asyncio.sleep(0)
    raise RuntimeError("failed after its waiter left")


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_task_whose_waiter_gave_up_is_read_only_when_wrapped(wrapped: bool, caplog: pytest.LogCaptureFixture):
    async def main() -> None:
        task = read_task(_fails_soon()) if wrapped else asyncio.ensure_future(_fails_soon())
        del task  # nobody awaits it to the end, as after wait_for's caller was cancelled just as it failed
        await asyncio.sleep(0.01)

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(main())
        gc.collect()
    unread = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert bool(unread) is not wrapped
