"""The load generator: harness traffic for 2 prefill + 2 decode nodes."""

from __future__ import annotations

import asyncio
import contextlib
import time

from events.catalog import (
    BranchOpened,
    Event,
    NodeHeartbeat,
    NodeRegistered,
    NodeRemoved,
    RequestFinished,
    RequestSubmitted,
)
from services.adapters.aio import wait_for
from services.adapters.bus import NatsBus
from services.drivers.chaos.tail import Published, Tail

LOAD_SRC = "harness"
NODES = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))
#: the node partition-engine silences
PARTITIONED = "d1"


class Load:
    """Harness traffic for 2 prefill + 2 decode nodes: registrations, heartbeats every
    ``heartbeat_s`` (except for silenced nodes), and ``rate`` requests/s in agent branches whose
    prompts grow (each request extends its branch's context). Every event carries a message id
    and a failed publish is retried with the same id, as an engine does."""

    def __init__(self, bus: NatsBus, rate: float = 20.0, heartbeat_s: float = 0.5,
                 branch_len: int = 6, blocks_per_request: int = 4, retry_for_s: float = 60.0,
                 max_in_flight: int | None = None, in_flight_for_s: float = 120.0) -> None:
        self.bus, self.rate, self.heartbeat_s = bus, rate, heartbeat_s
        #: at most this many of its requests unfinished at once (None: open loop, every tick sends):
        #: an arrival that finds them all busy is skipped, as a client with that many slots would
        #: (aiperf's --concurrency). A request with no RequestFinished after ``in_flight_for_s``
        #: (one a fault left hanging: the accounting reports it) stops holding a slot.
        self.max_in_flight, self.in_flight_for_s = max_in_flight, in_flight_for_s
        self.skipped = 0  # arrivals skipped for want of a slot
        self._granted = 0  # arrivals to send even with every slot taken (:meth:`grant`)
        self._open: dict[str, float] = {}  # request -> monotonic time it was published
        self._fin_scan = 0
        self.branch_len, self.bpr, self.retry_for_s = branch_len, blocks_per_request, retry_for_s
        self.published: list[Published] = []
        self.silent: set[str] = set()
        #: no new requests while set (heartbeats go on): restart-gateway lets the engines' queues
        #: drain so its own client's tokens come within the gateway's timeouts
        self.paused = False
        self.nodes = NODES  # () when sim engine workers register and heartbeat themselves
        self.tail: Tail | None = None  # set by the stack: where the generator sees NodeRemoved
        self.rejoins: list[str] = []  # nodes registered again after an unintended removal
        self._registered_at: dict[str, int] = {}  # node -> stream seq of its last NodeRegistered
        self._scan = 0
        self.retries = 0
        self._n = 0
        self._branch = -1
        self._k = branch_len

    async def publish(self, ev: Event, msg_id: str | None = None) -> Published:
        mid = msg_id or f"load:{self._n}"
        self._n += 1
        deadline = time.monotonic() + self.retry_for_s
        while True:
            try:
                seq = await wait_for(self.bus.publish(ev, msg_id=mid), 5)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                self.retries += 1
                await asyncio.sleep(0.2)
        p = Published(mid, ev, seq, time.monotonic())
        self.published.append(p)
        return p

    async def register(self, node: str, role: str) -> None:
        p = await self.publish(NodeRegistered(ts=time.time(), src=LOAD_SRC, node=node, role=role,
                                              l1_capacity_tokens=1 << 22, l2_capacity_tokens=1 << 24))
        self._registered_at[node] = p.seq

    async def rejoin_removed(self) -> None:
        """A node removed while it was not silenced (a stall of the harness itself, or a bus
        outage longer than the heartbeat timeout) registers again, as an engine that learns of
        its own removal should (docs/chaos.md: the sim worker does not yet)."""
        if self.tail is None:
            return
        new, self._scan = self.tail.deliveries[self._scan:], len(self.tail.deliveries)
        roles = dict(self.nodes)
        for d in new:
            ev = d.event
            if (isinstance(ev, NodeRemoved) and ev.node in roles and ev.node not in self.silent
                    and d.seq > self._registered_at.get(ev.node, 0)):
                self.rejoins.append(ev.node)
                await self.register(ev.node, roles[ev.node])

    async def next_request(self) -> None:
        if self._k >= self.branch_len:
            self._branch += 1
            self._k = 0
            await self.publish(BranchOpened(ts=time.time(), src=LOAD_SRC, branch=f"c{self._branch}",
                                            session=f"c{self._branch}"))
        bid, k = f"c{self._branch}", self._k
        base = (self._branch + 1) * 1_000_003
        blocks = [base * 131 + j for j in range((k + 1) * self.bpr)]
        p = await self.publish(RequestSubmitted(ts=time.time(), src=LOAD_SRC, request=f"{bid}/{k}", branch=bid,
                                                blocks=blocks, prompt_tokens=len(blocks) * 64 + 10, max_tokens=16))
        if self.max_in_flight is not None:
            self._open[p.event.request] = p.t
        self._k += 1

    def in_flight(self) -> int:
        """Its requests with no RequestFinished on the tail yet, published in the last
        ``in_flight_for_s`` seconds."""
        if self.tail is not None:
            new, self._fin_scan = self.tail.deliveries[self._fin_scan:], len(self.tail.deliveries)
            for d in new:
                if type(d.event) is RequestFinished:
                    self._open.pop(d.event.request, None)
        cutoff = time.monotonic() - self.in_flight_for_s
        for req in [r for r, t in self._open.items() if t < cutoff]:
            del self._open[req]
        return len(self._open)

    def has_slot(self) -> bool:
        return self.max_in_flight is None or self.in_flight() < self.max_in_flight

    def grant(self, n: int = 1) -> None:
        """Let the next ``n`` arrivals through even with every slot taken: the probe a
        recovery measurement needs (a request published after the fault, decided) while the
        faulted node's requests still hold the slots."""
        self._granted += n

    async def run(self, stop: asyncio.Event) -> None:
        for node, role in self.nodes:
            await self.register(node, role)
        loop = asyncio.get_running_loop()
        next_req = next_hb = loop.time()
        while not stop.is_set():
            now = loop.time()
            if now >= next_hb:
                await self.rejoin_removed()
                for node, role in self.nodes:
                    if node not in self.silent:
                        await self.publish(NodeHeartbeat(ts=time.time(), src=LOAD_SRC, node=node, role=role))
                next_hb = max(next_hb + self.heartbeat_s, now)
            if now >= next_req:
                if not self.paused:
                    if self.has_slot():
                        await self.next_request()
                    elif self._granted:
                        self._granted -= 1
                        await self.next_request()
                    else:
                        self.skipped += 1
                next_req = max(next_req + 1.0 / self.rate, now - 1.0)  # after a stall: no burst
            wait = max(0.0, min(next_req, next_hb) - loop.time())
            with contextlib.suppress(TimeoutError):
                await wait_for(stop.wait(), wait)

    def requests(self, lo: int = 0, hi: int | None = None) -> list[str]:
        return [p.event.request for p in self.published[lo:hi] if isinstance(p.event, RequestSubmitted)]
