"""The harness's own copy of the stream, read as it grows, and the load generator's
publications as the bus acknowledged them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from events.catalog import Event, RequestSubmitted
from services.adapters.aio import wait_for
from services.adapters.bus import Delivery, NatsBus
from services.adapters.logging import get_logger

log = get_logger("chaos")


@dataclass
class Published:
    msg_id: str
    event: Event
    seq: int
    t: float  # monotonic time the bus acknowledged it


class Tail:
    """The harness's own copy of the stream, read from a cursor every ``every_s`` (an ephemeral
    consumer per read, so a killed server only costs one retried read)."""

    def __init__(self, bus: NatsBus, every_s: float = 0.2) -> None:
        self.bus, self.every_s = bus, every_s
        self.deliveries: list[Delivery] = []
        self.seen_at: dict[int, float] = {}  # seq -> monotonic time first read
        self.cursor = 0  # every sequence up to here is read (or undecodable)
        self.errors = 0
        self.undecodable: set[int] = set()

        async def count_only(consumer, seq, subject, data, reason) -> None:
            bus.dead_lettered += 1  # the services' consumers dead-letter it; the harness only reads
            self.undecodable.add(seq)

        bus._dead_letter = count_only

    async def poll(self, idle_s: float = 0.3) -> None:
        head = await wait_for(self.bus.last_seq(), 5)
        if head <= self.cursor:
            return
        got: set[int] = set()
        async with self.bus.consumer(None, start_seq=self.cursor + 1) as c:
            it = c.__aiter__()
            while max(got, default=self.cursor) < head:
                try:
                    d = await wait_for(it.__anext__(), timeout=idle_s)
                except (TimeoutError, StopAsyncIteration):
                    break
                got.add(d.seq)
                if d.seq not in self.seen_at:  # read again after a gap: keep the first copy
                    self.deliveries.append(d)
                    self.seen_at[d.seq] = time.monotonic()
        # the cursor moves over what was read and what the consumer skipped as undecodable, and
        # stops at the first gap (a message not delivered yet is read again next time)
        while self.cursor + 1 in got or self.cursor + 1 in self.undecodable:
            self.cursor += 1

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await wait_for(self.poll(), 30)
            except Exception as exc:  # noqa: BLE001 - a server lost mid-read: read again
                self.errors += 1
                log.debug("tail_retry", error=f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(TimeoutError):
                await wait_for(stop.wait(), self.every_s)

    def first_decision_after(self, published: list[Published], t: float) -> float | None:
        """Monotonic time the first acting ``RouteDecided`` of a request published after ``t``
        was read, or None."""
        after = {p.event.request for p in published if p.t >= t and isinstance(p.event, RequestSubmitted)}
        if not after:
            return None
        for d in self.deliveries:
            ev = d.event
            if type(ev).__name__ == "RouteDecided" and not ev.shadow and not ev.reroute and ev.request in after:
                return self.seen_at[d.seq]
        return None

    def decided_after(self, published: list[Published], t: float, since: int = 0) -> int:
        """How many requests published after ``t`` have an acting ``RouteDecided`` in the copy
        (deliveries from index ``since`` on: a caller that knows where they start)."""
        after = {p.event.request for p in published if p.t >= t and isinstance(p.event, RequestSubmitted)}
        if not after:
            return 0
        seen = {d.event.request for d in self.deliveries[since:]
                if type(d.event).__name__ == "RouteDecided" and not d.event.shadow and not d.event.reroute
                and d.event.request in after}
        return len(seen)
