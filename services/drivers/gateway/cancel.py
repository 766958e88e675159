"""Cancellation (docs/gateway.md, "Cancellation"): a request whose client went
away, or that the gateway gave up on, is cancelled on its engine.

As vLLM aborts a request when its HTTP client disconnects (and SGLang has ``/abort_request``),
the gateway publishes ``RequestCancelled(request, branch, reason)`` once, on the branch's agent
subject; the engine holding the request stops it within an iteration and reports
``RequestFinished(error="cancelled")`` (engine/worker/cancel.py). Reasons:

- ``client_disconnected``: the connection closed before the response ended. A stream finds out
  when a write fails; :class:`Cancels` also looks at every guarded request's connection every
  ``poll_s`` (0.2 s, one task for the whole gateway), so a client that leaves between two
  messages, or while it waits for a non-streamed answer, is seen within ``poll_s``. The handler
  then stops relaying, its work is cancelled, and it returns quietly: one ``request_cancelled``
  log line, ``ei_gateway_cancelled_total{reason}``, no traceback (aiohttp cannot write the
  answer and logs a premature disconnection at debug level).
- ``timeout``: ``token_timeout_s`` without a token message (the 504, or the error event of a
  stream).
- ``route_timeout``: no ``RouteDecided`` within ``route_timeout_s`` (the 503); the router may
  still place the request later, the engine then finishes it at once.
- ``gateway_error``: the gateway's own failure while it served the request (a 500).

Nothing is cancelled after the request's last token message (``done``, or an ``error``: the
engine or the stream ended it) and nothing for a request that was refused before its
``RequestSubmitted`` went out.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine

from aiohttp import web
from prometheus_client import Counter

from events.catalog import Event, RequestCancelled
from events.wire import TokenMsg
from services.adapters.logging import get_logger
from services.drivers.gateway.api import ApiError

log = get_logger("gateway")


class Tracked:
    """A request's token subscription that remembers whether the request's last message came
    (``done`` or ``error``) and whether a wait for one timed out; the rest is the subscription's."""

    __slots__ = ("_sub", "branch", "cancelled", "ended", "partition", "request", "timed_out")

    def __init__(self, sub, request: str, branch: str, partition: str) -> None:
        self._sub, self.request, self.branch, self.partition = sub, request, branch, partition
        self.ended = self.timed_out = self.cancelled = False

    async def get(self, timeout_s: float) -> TokenMsg:
        try:
            m = await self._sub.get(timeout_s)
        except TimeoutError:
            self.timed_out = True
            raise
        if m.kind in ("done", "error"):
            self.ended = True
        return m

    @property
    def queue(self):  # the stream's failures are put here (streamwatch.FailWatcher)
        return self._sub.queue

    async def close(self) -> None:
        await self._sub.close()


_TRACKED: web.RequestKey[Tracked] = web.RequestKey("ei_cancel_tracked")


class Cancels:
    """The gateway's cancellations: :meth:`track` a request's subscription, :meth:`guard` its
    handler's work. ``publish(events, partition)`` is the gateway's (raises ``ApiError`` when the
    bus is away); ``clock`` stamps the events."""

    def __init__(self, publish: Callable[[list[Event], str], Awaitable[None]], clock: Callable[[], float],
                 src: str, registry, poll_s: float = 0.2) -> None:
        self.publish, self.clock, self.src, self.poll_s = publish, clock, src, poll_s
        self.count = Counter("ei_gateway_cancelled_total", "RequestCancelled published, by reason", ("reason",),
                             registry=registry)
        self._watched: dict[asyncio.Future, web.Request] = {}
        self._poller: asyncio.Task | None = None
        self._spawned: set[asyncio.Task] = set()

    def track(self, req: web.Request, sub, request: str, branch: str, partition: str) -> Tracked:
        """Wrap the subscription of ``request`` (once its ``RequestSubmitted`` is about to go out)."""
        t = req[_TRACKED] = Tracked(sub, request, branch, partition)
        return t

    async def guard(self, req: web.Request, work: Coroutine) -> web.StreamResponse:
        """Run ``work`` (the handler's serving of ``req``) and cancel the request on its engine
        when the client leaves or the gateway gives up (module docstring)."""
        task = asyncio.ensure_future(work)
        gone = asyncio.get_running_loop().create_future()
        self._watch(req, gone)
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the handler itself was cancelled (a server's handler_cancellation)
            task.cancel()
            self._spawn_cancel(req, "client_disconnected")
            raise
        finally:
            self._watched.pop(gone, None)
        if not task.done():  # the connection closed while the work waited
            task.cancel()
            resp = await self._gone(req)  # the engine is told first: the work's unwinding never delays it
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            return resp
        try:
            resp = task.result()
        except ConnectionResetError:  # a write to the closed connection
            return await self._gone(req)
        except ApiError as exc:
            await self._after(req, exc.code)
            raise
        except Exception:
            await self._after(req, "gateway_error")
            raise
        await self._after(req, None)
        return resp

    async def _after(self, req: web.Request, code: str | None) -> None:
        """The work ended (``code``: the error it ended with): cancel what still runs on the engine."""
        t = req.get(_TRACKED)
        if t is None or t.ended:
            return
        if t.timed_out:
            await self.cancel(req, "timeout")
        elif code in ("route_timeout", "gateway_error"):
            await self.cancel(req, code)

    async def _gone(self, req: web.Request) -> web.StreamResponse:
        await self.cancel(req, "client_disconnected")
        # aiohttp writes this to the closed connection, fails quietly and logs at debug level
        return web.Response(status=499)

    async def cancel(self, req: web.Request, reason: str) -> None:
        """Publish ``RequestCancelled`` for ``req``'s request, once; one log line."""
        await self.cancel_tracked(req.get(_TRACKED), reason)

    async def cancel_tracked(self, t: Tracked | None, reason: str) -> None:
        """:meth:`cancel` for a tracked request (the gateway stopping cancels what it fails)."""
        if t is None or t.ended or t.cancelled:
            return
        t.cancelled = True
        self.count.labels(reason).inc()
        log.info("request_cancelled", request=t.request, branch=t.branch, reason=reason)
        ev = RequestCancelled(ts=self.clock(), src=self.src, request=t.request, branch=t.branch, reason=reason)
        with contextlib.suppress(ApiError):  # logged by publish; the engine's request then runs to its end
            await self.publish([ev], t.partition)

    def _spawn_cancel(self, req: web.Request, reason: str) -> None:
        task = asyncio.ensure_future(self.cancel(req, reason))
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    # ---------------------------------------------------------------- the connection watch
    def _watch(self, req: web.Request, gone: asyncio.Future) -> None:
        self._watched[gone] = req
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        """Every ``poll_s`` while a request is guarded: a closed connection resolves its future."""
        while self._watched:
            await asyncio.sleep(self.poll_s)
            for gone, req in list(self._watched.items()):
                tr = req.transport
                if (tr is None or tr.is_closing()) and not gone.done():
                    gone.set_result(None)

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
