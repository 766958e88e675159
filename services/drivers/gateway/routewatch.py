"""The route watcher: which node each awaited request was routed to (step 5 of app.py's lifecycle)."""

from __future__ import annotations

import asyncio
import contextlib

from events.catalog import RouteDecided
from events.subjects import token
from services.adapters.aio import wait_for
from services.adapters.bus import Bus
from services.adapters.bus.port import Delivery
from services.drivers.gateway.consumers import Watch


class RouteWatcher:
    """One ephemeral consumer of ``ei.<p>.route`` from the head at start; resolves the future
    of each awaited request with its first non-shadow ``RouteDecided``."""

    def __init__(self, bus: Bus, partition: str) -> None:
        self.bus, self.partition = bus, partition
        self._waiting: dict[str, asyncio.Future] = {}
        self._task: asyncio.Task | None = None
        self.reader = Watch(bus, "gateway-routes", f"ei.{token(partition)}.route", self._on)

    async def start(self) -> None:
        head = await self.bus.last_seq()
        self._task = asyncio.create_task(self.reader.run(head + 1), name="route-watcher")
        await wait_for(self.reader.ready.wait(), 10.0)

    def _on(self, d: Delivery) -> None:
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

