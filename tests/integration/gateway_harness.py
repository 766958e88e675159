"""What the in-process gateway tests share: a gateway app served by aiohttp's test server with a
fake cluster task answering its requests beside it, the task cancelled when the test leaves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine

from aiohttp.test_utils import TestClient, TestServer


@contextlib.asynccontextmanager
async def serving(gw, cluster: Coroutine) -> AsyncIterator[TestClient]:
    task = asyncio.create_task(cluster)
    try:
        async with TestClient(TestServer(gw.make_app())) as client:
            yield client
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
