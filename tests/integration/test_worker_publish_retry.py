"""The engine worker retries a publication the bus did not confirm, with the
same message id, so the stream's duplicate window stores it once: a bus that fails a few
publications (one of them after storing it: the ack was lost) loses and duplicates nothing,
and the events stay in the node's order. An error a retry cannot fix is not retried.
Heartbeats go straight to the bus (never queued behind the node's events) with
message ids of their own, and a failed one is not retried: the next one follows."""

from __future__ import annotations

import asyncio

import nats.errors
from nats.js.errors import BadRequestError

from engine.profiles import load_profile
from engine.worker.loop import EngineWorker
from engine.worker.publish import _retryable
from events.catalog import NodeHeartbeat, NodeRegistered
from services.adapters.bus import MSG_ID, InMemoryBus
from services.adapters.bus.tokens import MemoryTokens

PROFILE = load_profile("gb300-glm52")


class FlakyBus(InMemoryBus):
    """Fails publications number ``fail_at`` (1-based); ``stored_then_fail`` ones are stored
    first (the server took it, the ack never came back)."""

    def __init__(self, partition: str, fail_at: set[int], stored_then_fail: set[int]) -> None:
        super().__init__(partition)
        self.calls, self.fail_at, self.stored_then_fail = 0, fail_at, stored_then_fail

    async def publish(self, event, *, msg_id=None, shadow=None) -> int:
        if isinstance(event, NodeHeartbeat):  # published outside the events' queue, never retried
            return await super().publish(event, msg_id=msg_id, shadow=shadow)
        self.calls += 1
        if self.calls in self.stored_then_fail:
            await super().publish(event, msg_id=msg_id, shadow=shadow)
            raise nats.errors.TimeoutError
        if self.calls in self.fail_at:
            raise nats.errors.NoRespondersError
        return await super().publish(event, msg_id=msg_id, shadow=shadow)


async def test_failed_publications_are_retried_once_stored_in_order(partition):
    bus = FlakyBus(partition, fail_at={1, 2, 5}, stored_then_fail={3})
    w = EngineWorker(bus, MemoryTokens(partition), "n1", "collocated", PROFILE, time_scale=5.0, heartbeat_s=0.02)
    await w.start()
    await asyncio.sleep(0.3)  # a dozen heartbeats
    await w.stop()
    stored = [h[MSG_ID] for _s, _d, h in bus._log]
    assert len(stored) == len(set(stored)) and all(i.startswith("n1:") for i in stored)  # nothing twice
    ids = [i for i in stored if ":hb" not in i]  # heartbeats: ids of their own, not in the queue's order
    assert [int(i.rsplit(":", 1)[1]) for i in ids] == list(range(1, len(ids) + 1))  # nothing lost, in order
    assert w.published == len(stored) and w.publish_retries == 2  # calls 1-4: the first event, 5-6: the second
    events = [e async for e in _events(bus)]
    assert isinstance(events[0], NodeRegistered) and sum(isinstance(e, NodeHeartbeat) for e in events) >= 3


async def _events(bus):
    head = await bus.last_seq()
    async with bus.consumer(None, start_seq=1) as c:
        async for d in c:
            yield d.event
            if d.seq >= head:
                return


def test_only_transient_errors_are_retried():
    assert _retryable(nats.errors.NoRespondersError()) and _retryable(nats.errors.TimeoutError())
    assert _retryable(nats.errors.ConnectionClosedError()) and _retryable(OSError("reset"))
    assert not _retryable(BadRequestError()) and not _retryable(TypeError("not encodable"))


async def test_a_publication_that_cannot_pass_is_dropped_not_retried_forever(partition):
    class Refusing(InMemoryBus):
        async def publish(self, event, *, msg_id=None, shadow=None) -> int:
            if isinstance(event, NodeHeartbeat):
                raise BadRequestError()
            return await super().publish(event, msg_id=msg_id, shadow=shadow)

    bus = Refusing(partition)
    w = EngineWorker(bus, MemoryTokens(partition), "n1", "collocated", PROFILE, time_scale=5.0, heartbeat_s=0.02)
    await w.start()
    await asyncio.sleep(0.2)
    await w.stop()
    assert w.publish_retries == 0 and w._out.empty()
    assert not any(isinstance(e, NodeHeartbeat) for _s, e in [(0, e) async for e in _events(bus)])

