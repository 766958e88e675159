"""What the gateway reads of its partition's stream besides the route decisions (routewatch.py).

- :func:`rebuild`: at start, the harness events ``ei.<p>.agent.>`` from the stream's first
  sequence up to its head, folded into the branch table (``BranchTable.fold``), so a restarted
  gateway continues every open branch with its id, version and previous prompt (the next request
  extends it: no second ``BranchOpened``, no compaction, the same prefix for the router) and
  refuses requests on ended ones as before. One-request branches of the dead instance are
  returned so the caller ends them.
- :class:`FailWatcher`: one ephemeral consumer of ``ei.<p>.node.*`` from the head at start; a
  ``RequestFinished`` with an ``error`` for a request in flight here (e.g. the liveness watcher's
  "decode node N was removed mid-decode") ends that request: an ``error`` token message is put
  into its token queue (the relays answer a 503 or an error event in the stream) and a request
  still waiting for its route fails with the same 503. The engines send no token message for
  such a failure: their node is gone, and the decision is the control plane's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from events.authority import Admission
from events.catalog import NodeHeartbeat, NodeRemoved, RequestFinished
from events.subjects import token
from events.wire import TokenMsg
from services.adapters.aio import wait_for
from services.adapters.bus import Bus
from services.adapters.bus.port import Delivery
from services.adapters.logging import get_logger
from services.cores.branches import BranchTable
from services.drivers.gateway.consumers import Watch
from services.drivers.gateway.meta import STREAM_FAILURE, failure_error

log = get_logger("gateway")

async def rebuild(bus: Bus, table: BranchTable, idle_s: float = 0.25, timeout_s: float = 120.0) -> int:
    """Fold the partition's harness events up to the head seen now into ``table``; the number
    of events folded. Ends when the head is reached, or when the consumer is idle and the
    bus holds nothing more for it (``Consumer.pending``, read twice)."""
    head = await bus.last_seq()
    if head == 0:
        return 0
    n = idle = 0
    admission = Admission()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with bus.consumer(None, start_seq=1, subjects=f"ei.{token(bus.partition)}.agent.>") as c:
        it = c.__aiter__()
        nxt: asyncio.Future | None = None  # never cancelled while reading: that would end the iterator
        try:
            while True:
                if loop.time() > deadline:
                    log.warning("branch_rebuild_timeout", partition=bus.partition, folded=n, head=head)
                    break
                if nxt is None:
                    nxt = asyncio.ensure_future(it.__anext__())
                done, _ = await asyncio.wait({nxt}, timeout=idle_s)
                if not done:
                    left = await c.pending()
                    # nothing left on the server twice in a row: a message it had sent before
                    # the first check (on its way to us) would have come in between
                    idle = idle + 1 if left == 0 else 0
                    if idle >= 2:
                        break
                    continue
                try:
                    d = nxt.result()
                except StopAsyncIteration:
                    break
                nxt = None
                idle = 0
                if d.seq > head:
                    break
                why = admission.reason(d.event, d.subject)
                if why is not None:  # forged or malformed: the live watchers refused it too
                    log.error("branch_rebuild_refused", seq=d.seq, subject=d.subject, reason=why)
                else:
                    table.fold(d.event)
                    n += 1
                if d.seq == head:
                    break
        finally:
            if nxt is not None:
                nxt.cancel()
                with contextlib.suppress(BaseException):  # the consumer closes next
                    await nxt
    return n


class FailWatcher:
    """Ends the requests in flight here that the stream says failed (module docstring)."""

    def __init__(self, bus: Bus, partition: str) -> None:
        self.bus, self.partition = bus, partition
        self._flight: dict[str, tuple[object, asyncio.Future | None]] = {}  # request -> (token sub, route future)
        self._task: asyncio.Task | None = None
        self.failed = 0
        self._progress: dict[str, float] = {}  # node -> monotonic time of its last progress
        self._counters: dict[str, tuple[int, int]] = {}  # node -> its last heartbeat's (applied_seq, published)
        self._clock = time.monotonic
        self.reader = Watch(bus, "gateway-failures", f"ei.{token(partition)}.node.*", self._on)

    async def start(self) -> None:
        head = await self.bus.last_seq()
        self._task = asyncio.create_task(self.reader.run(head + 1), name="fail-watcher")
        await wait_for(self.reader.ready.wait(), 10.0)

    def _on(self, d: Delivery) -> None:
        ev = d.event
        self._note_progress(ev)
        if isinstance(ev, RequestFinished) and ev.error and ev.request in self._flight:
            self.fail(ev.request, ev.node, ev.error)

    def _note_progress(self, ev) -> None:
        """When each node last showed progress: any of its own facts, or a heartbeat whose
        counters moved (its worker folded or published since the last one); a removal forgets it."""
        node = getattr(ev, "node", None)
        if node is None:
            return
        if isinstance(ev, NodeRemoved):
            self._progress.pop(node, None)
            self._counters.pop(node, None)
            return
        if isinstance(ev, NodeHeartbeat):
            counters = (ev.applied_seq, ev.published)
            if self._counters.get(node) == counters:
                return
            self._counters[node] = counters
        self._progress[node] = self._clock()

    def quiet_s(self, node: str) -> float | None:
        """Seconds since ``node`` last showed progress on the stream (None: never, or removed)."""
        t = self._progress.get(node)
        return None if t is None else self._clock() - t

    def fail(self, request: str, node: str, error: str) -> None:
        """End ``request``: an error message into its token queue, its route wait failed."""
        tsub, fut = self._flight.pop(request, (None, None))
        if tsub is None:
            return
        self.failed += 1
        log.warning("request_failed_on_stream", request=request, node=node, error=error[:300])
        if fut is not None and not fut.done():
            fut.set_exception(failure_error(request, node, error))
        tsub.queue.put_nowait(TokenMsg(request=request, kind="error", node=node, error=error,
                                       finish_reason=STREAM_FAILURE))

    def in_flight(self) -> list:
        """The token subscriptions of the requests in flight here."""
        return [tsub for tsub, _ in self._flight.values()]

    def fail_all(self, error: str) -> int:
        """End every request in flight here (the gateway is stopping); how many."""
        reqs = list(self._flight)
        for r in reqs:
            self.fail(r, "", error)
        return len(reqs)

    def watch(self, request: str, tsub, route: asyncio.Future | None = None) -> None:
        self._flight[request] = (tsub, route)

    def forget(self, request: str) -> None:
        self._flight.pop(request, None)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # shutting down
                await self._task
