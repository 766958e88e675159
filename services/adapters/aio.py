"""``wait_for`` that never loses a cancellation.

On Python 3.11, ``asyncio.wait_for`` returns the awaited result when its own task is cancelled in
the same loop turn as the awaited thing completes: the cancellation is swallowed (fixed in 3.12,
which rebuilt ``wait_for`` on ``asyncio.timeout``). A task that reads a stream of messages through
``wait_for`` then carries on after ``task.cancel()``: the gateway's relay of a request whose
client left kept reading tokens until its token timeout, and only then cancelled the request on
its engine. This ``wait_for`` is 3.12's: the wait runs in the caller's task under
``asyncio.timeout``, so a cancellation always propagates, and no task is made per call.
``asyncio.wait_for`` is banned by the lint (pyproject.toml, TID251)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """``await aw``, raising ``TimeoutError`` once ``timeout`` seconds pass (``None``: no limit;
    zero or less: what completes without waiting still returns). On the timeout the wait is
    cancelled, and with it a task or future ``aw`` names, as ``asyncio.wait_for`` does; a
    cancellation of the caller is never lost."""
    async with asyncio.timeout(timeout):
        return await aw
