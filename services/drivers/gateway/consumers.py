"""What the gateway's ``/health`` says of the stream's readers (an engine whose input
stopped on one malformed message while every health check said ok).

- :class:`Watch`: one of the gateway's own readers (the route watcher, the failure watcher):
  an ephemeral consumer folded by a handler, which bad input never stops. Every delivery passes
  the event authority first (events/authority.py: a refused one is dead-lettered to the
  gateway's account, counted, never handled); a consumer that fails is opened again after the
  last sequence it handed over. Its state (position, refusals, last error) is reported.
- :class:`ConsumerHealth`: every consumer of the partition's stream as the bus sees it
  (``Bus.consumers``: on NATS ``$JS.API.CONSUMER.LIST.<stream>``, a read-only call the gateway's
  account may make; the in-process bus lists its durables and open readers): the
  durables of the directory, planner, router and recorder, and the ephemerals of the engines and
  of the gateway (named after their account: ``engine-n0-<hex>``). A consumer with messages
  waiting whose position has not moved for ``stuck_after_s`` is **stuck**; one with more than
  ``lag_events`` waiting is **lagging**. ``/health`` names both, and ``/metrics`` exports each
  consumer's pending count.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from events import codec
from events.authority import Admission
from services.adapters.aio import wait_for
from services.adapters.bus import Bus
from services.adapters.bus.port import ConsumerState, Delivery, dead_letter
from services.adapters.logging import get_logger

log = get_logger("gateway")

#: a consumer behind the head that has not moved for this long is stuck. /health names a reader
#: that stopped within 10 s: an ephemeral one is still handed messages for up to its pull
#: request's 2 s (nats_bus.EPHEMERAL_EXPIRES_S), then 4 s unmoved, then the next poll (every 2 s)
STUCK_AFTER_S = 4.0
#: how often the gateway asks for every consumer's state (``$JS.API.CONSUMER.LIST``: a JSON
#: answer per consumer, decoded into nats-py's dataclasses, and nats-server's walk of every
#: consumer): at 1 s it was in every profile of an idle gateway; at 2 s a stuck reader is
#: still named within 8 s (2 + 4 + 2)
POLL_S = 2.0
#: a consumer with more messages than this waiting is lagging
LAG_EVENTS = 5000


@dataclass
class WatchState:
    name: str
    subjects: str
    last_seq: int = 0
    handled: int = 0
    refused: int = 0
    dead_letters_failed: int = 0
    restarts: int = 0
    error: str | None = None
    last_refusal: str | None = None

    def as_dict(self) -> dict:
        return {"subjects": self.subjects, "last_seq": self.last_seq, "handled": self.handled,
                "refused": self.refused, "restarts": self.restarts, "error": self.error,
                "last_refusal": self.last_refusal}


class Watch:
    """A gateway reader that never stops on bad input (module docstring)."""

    def __init__(self, bus: Bus, name: str, subjects: str, handle: Callable[[Delivery], None],
                 retry_s: float = 1.0) -> None:
        self.bus, self.handle, self.retry_s = bus, handle, retry_s
        self.state = WatchState(name, subjects)
        self.admission = Admission()
        self.ready = asyncio.Event()

    async def run(self, start: int) -> None:
        st = self.state
        st.last_seq = start - 1
        while True:
            try:
                async with self.bus.consumer(None, start_seq=st.last_seq + 1, subjects=st.subjects) as c:
                    self.ready.set()
                    async for d in c:
                        st.last_seq = max(st.last_seq, d.seq)
                        await self._take(d)
                    return  # the consumer ended (an in-process bus closing)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the gateway's input must come back
                st.restarts += 1
                st.error = f"{type(exc).__name__}: {exc}"[:500]
                log.error("gateway_watch_failed", watch=st.name, last_seq=st.last_seq, error=st.error,
                          action=f"reopening after sequence {st.last_seq} in {self.retry_s:g} s")
                await asyncio.sleep(self.retry_s)

    async def _take(self, d: Delivery) -> None:
        st = self.state
        why = self.admission.reason(d.event, d.subject)
        if why is not None:
            st.refused += 1
            st.last_refusal = f"seq {d.seq} on {d.subject}: {why}"[:500]
            log.error("dead_letter", consumer=st.name, seq=d.seq, subject=d.subject, reason=f"refused: {why}")
            if not await dead_letter(self.bus, st.name, d.seq, d.subject, codec.encode(d.event), f"refused: {why}"):
                st.dead_letters_failed += 1
            return
        try:
            self.handle(d)
            st.handled += 1
        except Exception as exc:  # noqa: BLE001 - one bad event must not stop the watch
            st.error = f"seq {d.seq}: {type(exc).__name__}: {exc}"[:500]
            log.error("gateway_watch_handler_failed", watch=st.name, seq=d.seq, error=st.error)


@dataclass
class _Seen:
    position: int
    moved_at: float
    pending: int = 0
    info: dict = field(default_factory=dict)


class ConsumerHealth:
    """Polls the bus's view of every consumer of the stream (``Bus.consumers``; module docstring)."""

    def __init__(self, bus: Bus, every_s: float = POLL_S, stuck_after_s: float = STUCK_AFTER_S,
                 lag_events: int = LAG_EVENTS, clock: Callable[[], float] = time.monotonic) -> None:
        self.bus, self.every_s, self.stuck_after_s, self.lag_events = bus, every_s, stuck_after_s, lag_events
        self.clock = clock
        self.seen: dict[str, _Seen] = {}
        self.error: str | None = None
        self.polled_at: float | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="consumer-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.every_s)

    async def poll(self) -> None:
        try:
            states = await wait_for(self.bus.consumers(), 5.0)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            self.error = f"{type(exc).__name__}: {exc}"[:300] or type(exc).__name__
            return
        self.error = None
        self.observe([_row(c) for c in states])

    def observe(self, rows: list[dict]) -> None:
        """Fold one poll's rows (``name``, ``pending``, ``position``, ...): what moved and when."""
        now = self.clock()
        self.polled_at = now
        current = {}
        for row in rows:
            old = self.seen.get(row["name"])
            if old is None or row["position"] != old.position or row["pending"] == 0:
                s = _Seen(row["position"], now)
            else:
                s = old
            s.pending, s.info = row["pending"], row
            current[row["name"]] = s
        self.seen = current

    def report(self) -> dict:
        """``{"consumers": {...}, "stuck": [...], "lagging": [...]}`` for ``/health``."""
        now = self.clock()
        consumers, stuck, lagging = {}, [], []
        for name in sorted(self.seen):
            s = self.seen[name]
            still = round(now - s.moved_at, 1) if s.pending else 0.0
            state = "ok"
            if s.pending and still > self.stuck_after_s:
                state = "stuck"
                stuck.append(name)
            elif s.pending > self.lag_events:
                state = "lagging"
                lagging.append(name)
            consumers[name] = {**s.info, "state": state, "unmoved_s": still}
        out = {"consumers": consumers, "stuck": stuck, "lagging": lagging}
        if self.error:
            out["error"] = self.error
        return out


def _row(c: ConsumerState) -> dict:
    """A consumer's row in ``/health``."""
    return {"name": c.name, "durable": c.durable, "filter": c.filter, "pending": c.pending,
            "position": c.position, "delivered": c.delivered, "ack_floor": c.ack_floor}
