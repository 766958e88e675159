"""The route watcher: which node each awaited request was routed to (step 5 of app.py's lifecycle)."""

from __future__ import annotations

import asyncio
import contextlib

from events.catalog import RouteDecided
from events.subjects import token
from services.adapters.bus import Bus


class RouteWatcher:
    """One ephemeral consumer of ``ei.<p>.route`` from the head at start; resolves the future
    of each awaited request with its first non-shadow ``RouteDecided``."""

    def __init__(self, bus: Bus, partition: str) -> None:
        self.bus, self.partition = bus, partition
        self._waiting: dict[str, asyncio.Future] = {}
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()

    async def start(self) -> None:
        head = await self.bus.last_seq()
        self._task = asyncio.create_task(self._run(head + 1), name="route-watcher")
        await asyncio.wait_for(self._ready.wait(), 10.0)

    async def _run(self, start: int) -> None:
        subj = f"ei.{token(self.partition)}.route"
        async with self.bus.consumer(None, start_seq=start, subjects=subj) as c:
            self._ready.set()
            async for d in c:
                ev = d.event
                if isinstance(ev, RouteDecided) and not ev.shadow:
                    fut = self._waiting.get(ev.request)
                    if fut is not None and not fut.done():
                        fut.set_result(ev)

    def expect(self, request: str) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._waiting[request] = fut
        return fut

    def forget(self, request: str) -> None:
        self._waiting.pop(request, None)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # shutting down
                await self._task

