"""services.adapters.aio.wait_for: a cancellation that meets a completion in the same loop turn
is never lost (asyncio.wait_for on 3.11 returns the result then), and the timeout behaves as
asyncio.wait_for's."""

from __future__ import annotations

import asyncio
import sys

import pytest

from services.adapters.aio import wait_for


async def _cancel_as_it_completes(waiter) -> str:
    """Run ``waiter(fut)`` in a task; complete ``fut`` and cancel the task in one loop turn."""
    fut = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(waiter(fut))
    await asyncio.sleep(0)  # the task waits on fut
    fut.set_result("token")
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


async def test_a_cancellation_that_meets_a_completion_is_not_lost():
    assert await _cancel_as_it_completes(lambda f: wait_for(f, 10.0)) == "cancelled"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12 rebuilt asyncio.wait_for on asyncio.timeout")
async def test_asyncio_wait_for_on_311_loses_it():  # why the lint bans it
    assert await _cancel_as_it_completes(lambda f: asyncio.wait_for(f, 10.0)) == "token"


async def _at_once() -> str:
    return "now"


async def test_the_timeout_raises_and_cancels_what_it_waited_on():
    fut = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await wait_for(fut, 0.01)
    assert fut.cancelled()
    assert await wait_for(_at_once(), 0) == "now"  # done without waiting: returned
    assert await wait_for(asyncio.sleep(0.01, "late"), None) == "late"
    with pytest.raises(TimeoutError):
        await wait_for(asyncio.sleep(1), 0)
