"""A pipelined batch (the gateway's BranchOpened + RequestSubmitted) that no stream answers waits
out the election instead of failing the request: after a NATS server of an R3 cluster is lost, the
stream's leader is elected again in seconds, and the compose stack's first chat after ``podman kill
nats-2`` got a 503 "no response from stream" at once, where a single publish already retried.

Real nats-server (the session's): the batch is published before its partition's stream exists
(no responder, as during an election) and the stream is created half a second later."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.errors import NoStreamResponseError

from events.catalog import BranchOpened, RequestSubmitted
from services.adapters.bus.nats_bus import NatsBus
from tests.contract.test_bus import _take


def _batch() -> list:
    return [BranchOpened(ts=1.0, branch="b", session="s"),
            RequestSubmitted(ts=1.0, request="r", branch="b", blocks=[1], prompt_tokens=64, max_tokens=4)]


async def test_a_batch_no_stream_answers_waits_for_the_stream(nats_url, partition):
    bus = await NatsBus.connect(nats_url, partition, ensure=False)
    admin = await NatsBus.connect(nats_url, partition, ensure=False)
    try:
        async def late_stream():
            await asyncio.sleep(0.5)
            await admin.ensure_streams()

        maker = asyncio.create_task(late_stream())
        seqs = await bus.publish_many(_batch())
        await maker
        assert seqs == sorted(seqs) and len(set(seqs)) == 2
        got = await _read(bus, 2)
        assert [type(d.event).__name__ for d in got] == ["BranchOpened", "RequestSubmitted"]
        assert [d.seq for d in got] == seqs
    finally:
        await bus.close()
        await admin.close()


async def test_a_batch_that_never_finds_its_stream_fails_with_the_cause(nats_url, partition):
    bus = await NatsBus.connect(nats_url, partition, ensure=False)
    try:
        bus.retry_for_s = 0.3
        with pytest.raises(NoStreamResponseError):
            await bus.publish_many(_batch())
    finally:
        await bus.close()


async def _read(bus: NatsBus, n: int) -> list:
    async with bus.consumer(None, start_seq=1) as c:
        return await _take(c, n)
