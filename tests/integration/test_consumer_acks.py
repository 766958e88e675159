"""An idle durable consumer sends its cumulative ack ``ack_delay_s`` after the oldest unsent
one, not at every wake-up (the router sent one ack per event it read, most of its socket
writes per request), and a steady trickle of events does not postpone it past that delay."""

from __future__ import annotations

import asyncio

import pytest

from services.adapters.bus import NatsBus
from services.drivers.bench import harness as workload

pytestmark = pytest.mark.asyncio


async def _ack_floor(bus: NatsBus, durable: str) -> int:
    info = await bus.js.consumer_info(bus.stream, durable)
    return info.ack_floor.stream_seq


async def _wait_floor(bus: NatsBus, durable: str, want: int, within: float) -> int:
    deadline = asyncio.get_running_loop().time() + within
    while (floor := await _ack_floor(bus, durable)) < want and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    return floor


async def test_idle_ack_waits_for_the_delay_then_goes_out(nats_url, partition):
    bus = await NatsBus.connect(nats_url, partition)
    try:
        events = workload.branch_events(0, 3)
        await bus.publish_many(events)
        async with bus.consumer("acks", start_seq=1) as c:
            c.ack_delay_s = 1.0
            it = c.__aiter__()
            for _ in events:
                d = await asyncio.wait_for(it.__anext__(), 10)
                await c.ack(d.seq)
            nxt = asyncio.ensure_future(it.__anext__())  # idles: the ack is pending, not sent
            await asyncio.sleep(0.1)
            assert await _ack_floor(bus, "acks") == 0
            assert await _wait_floor(bus, "acks", len(events), 5.0) == len(events)
            nxt.cancel()
    finally:
        await bus.close()


async def test_a_trickle_of_events_does_not_postpone_the_ack(nats_url, partition):
    bus = await NatsBus.connect(nats_url, partition)
    try:
        events = workload.branch_events(1, 6)
        async with bus.consumer("trickle", start_seq=1) as c:
            c.ack_delay_s = 0.2
            seen: list[int] = []

            async def read() -> None:  # as the runner's pump: the reader idles between events
                async for d in c:
                    await c.ack(d.seq)
                    seen.append(d.seq)

            reader = asyncio.create_task(read())
            for ev in events:  # one every 0.1 s: each arrives before a delay restarted by it would end
                await bus.publish(ev)
                await asyncio.sleep(0.1)
            while len(seen) < len(events):
                await asyncio.sleep(0.01)
            # the first pending ack was due 0.2 s after the first idle: it went out mid-trickle
            floor = await _ack_floor(bus, "trickle")
            reader.cancel()
            assert len(events) >= 6 and floor >= 1
    finally:
        await bus.close()
