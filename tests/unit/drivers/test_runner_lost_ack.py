"""A decision the bus acknowledged but never stored is published again (`evolving chaos
--engines`, kill-nats-leader). After the stream leader was killed, the router's retried publish
of one decision was answered "duplicate" although the new leader never stored it: the request
stayed undecided until a later restart of the router re-published it 50 s later, behind the
decisions that followed it (609 verify divergences). The runner now expects the echo of every
own decision on its consumer and re-publishes, under a fresh id, one whose acknowledged sequence
it passed without seeing it."""

from __future__ import annotations

import asyncio

import pytest

from events.catalog import RequestSubmitted
from services.adapters.bus import MSG_ID, InMemoryBus
from services.adapters.runner import base_msg_id
from services.drivers.bench import harness as workload
from services.drivers.options import ServiceOptions
from services.drivers.serve import build_runner
from services.drivers.up.testing import acting_route_counts, read_all, wait_until

pytestmark = pytest.mark.asyncio


class PhantomAckBus(InMemoryBus):
    """Answers the first publication of each id in ``lose`` like a JetStream retry after a
    leader change can: "duplicate" of a sequence that holds another message; nothing stored."""

    def __init__(self, lose: set[str]) -> None:
        super().__init__("p")
        self.lose, self.phantoms = set(lose), 0

    async def publish_raw(self, subject, data, headers=None, msg_id=None) -> int:
        if msg_id in self.lose:
            self.lose.discard(msg_id)
            self.phantoms += 1
            return len(self._log)  # the head: another message's sequence
        return await super().publish_raw(subject, data, headers, msg_id=msg_id)


def _args() -> ServiceOptions:
    return ServiceOptions.of("router", router="evolving", router_arg=[], shadow=None, snapshot_every=1000,
                             snapshot_interval_s=60.0)


async def test_a_decision_acknowledged_but_never_stored_is_published_again():
    events = workload.nodes(2, 2) + [e for b in range(3) for e in workload.branch_events(b, 3)]
    seqs = {ev.request: i + 1 for i, ev in enumerate(events) if isinstance(ev, RequestSubmitted)}
    lost = {f"router:{seqs['b0/1']}:0", f"router:{seqs['b2/2']}:0"}  # the decisions for two requests
    bus = PhantomAckBus(lost)
    await bus.publish_many(events)
    runner = build_runner("router", _args(), bus)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        async def all_decided() -> bool:
            counts = acting_route_counts(await read_all(bus, "ei.p.route", idle_s=0.05))
            return all(counts[r] for r in seqs)

        # a later event moves the consumer past the phantom sequence: the loss shows
        await bus.publish_many(workload.branch_events(9, 1))
        await wait_until(all_decided, 10, what="every request decided")
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert bus.phantoms == 2
    routes = [d for d in await read_all(bus, "ei.p.route", idle_s=0.05)]
    counts = acting_route_counts(routes)
    assert all(counts[r] == 1 for r in seqs), counts  # decided once each, none twice
    again = {d.headers[MSG_ID] for d in routes if "~" in d.headers[MSG_ID]}
    assert {base_msg_id(m) for m in again} == lost  # re-published under fresh ids
