"""What the fake SGLang and vLLM servers share (engine/backends/sglang/fake.py,
engine/backends/vllm/fake.py): an aiohttp app on a port (0: a free one), a ZMQ PUB socket
for KV events on ``kv_events_port`` (0: a free one, written back), the batches published in
order with a sequence number, and ``python -m`` serving until interrupted. A subclass builds
its routes in ``app()``, its wire's batch in ``_batch(events)`` and sets ``frames``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, ClassVar

import zmq
from aiohttp import web


class FakeServer:
    """The lifecycle and KV-event publisher of a fake engine server (module docstring)."""

    frames: ClassVar[Callable[[str, int, Any], list[bytes]]]  # the wire's three ZMQ frames
    handler_cancellation: ClassVar[bool] = False  # a client that goes away cancels its handler

    def __init__(self, kv_events_port: int | None, topic: str) -> None:
        self.kv_events_port, self.topic = kv_events_port, topic
        self.inflight: dict[str, asyncio.Task] = {}
        self.published: list = []
        self.seq = 0
        self._pub = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    def app(self) -> web.Application:
        raise NotImplementedError

    def _batch(self, events: list) -> Any:
        raise NotImplementedError

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        if self.kv_events_port is not None:
            self._pub = zmq.Context.instance().socket(zmq.PUB)
            if self.kv_events_port == 0:
                self.kv_events_port = self._pub.bind_to_random_port(f"tcp://{host}")
            else:
                self._pub.bind(f"tcp://{host}:{self.kv_events_port}")
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=self.handler_cancellation)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return f"http://{host}:{self.port}"

    async def stop(self) -> None:
        for t in list(self.inflight.values()):
            t.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._pub is not None:
            self._pub.close(linger=0)

    def _publish(self, events: list) -> None:
        if not events:
            return
        batch = self._batch(events)
        self.published.append(batch)
        if self._pub is not None:
            self._pub.send_multipart(type(self).frames(self.topic, self.seq, batch))
        self.seq += 1

    def serve_forever(self, host: str, port: int, label: str) -> int:
        """``python -m``: serve on ``host:port`` until interrupted, the URL on stdout first."""
        async def serve() -> None:
            url = await self.start(host, port)
            print(f"{label} at {url}", flush=True)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()

        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve())
        return 0
