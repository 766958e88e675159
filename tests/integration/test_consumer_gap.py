"""Deliveries lost in transit are read again (in `evolving chaos --engines`, when all
three NATS servers were killed and started again, the recorder's durable consumer had been
handed three messages that never arrived, and its next cumulative ack acknowledged them unseen:
three events missing from the DuckDB log, and `verify` diverged from there). The consumer
sequence of the next message skips; the consumer starts again right after the last message it
handed out, durable (recorder, services) or ephemeral (engine workers, the gateway)."""

from __future__ import annotations

import asyncio

import pytest

from services.adapters.bus import NatsBus
from services.drivers.bench import harness as workload

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("durable", ["rec", None])
async def test_messages_lost_on_the_way_are_delivered_again_in_order(nats_url, partition, durable):
    bus = await NatsBus.connect(nats_url, partition)
    try:
        events = [e for b in range(3) for e in workload.branch_events(b, 3)]  # 12 events
        await bus.publish_many(events)
        got: list[int] = []
        async with bus.consumer(durable, start_seq=1) as c:
            deliver = c._on_msg
            dropped: list[int] = []

            async def lossy(msg) -> None:  # what a dying connection does to messages in flight
                if msg.reply and msg.metadata.sequence.stream in (4, 5, 6) and len(dropped) < 3:
                    dropped.append(msg.metadata.sequence.stream)
                    return
                await deliver(msg)

            c._on_msg = lossy
            c._sub._cb = lossy
            it = c.__aiter__()
            while len(got) < len(events):
                d = await asyncio.wait_for(it.__anext__(), 10)
                got.append(d.seq)
                if durable:
                    await c.ack(d.seq)
            assert got == list(range(1, 13)) and dropped == [4, 5, 6]
            assert c.gaps == 1
    finally:
        await bus.close()
