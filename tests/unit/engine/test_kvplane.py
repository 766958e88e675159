"""The worker's KV data plane (``--kv-bytes``): real bytes follow a worker's KV facts, a P->D
move is a write by the prefill node, a peer fetch a read from the owner's host pool, every
checksum verified; in-process over the loopback fabric (the live test does the same across
processes with Mooncake over TCP)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kvbytes import KvBytes, synthesize
from engine.kvplane import KvBytesConfig, LocalExchange, TcpExchange, layout_for, parse_endpoint
from engine.profiles import load_profile
from engine.transfer import TransferError
from engine.transfer.loopback import LoopbackFabric
from engine.worker.__main__ import main
from engine.worker.loop import EngineWorker
from events.catalog import (
    FetchStep,
    KvEvicted,
    KvStored,
    NodeRegistered,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RouteDecided,
)
from kernels.checksum import block_checksum
from kernels.layout import KvLayoutError
from kernels.pool import BlockPool
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens
from tests.hyp import examples

PROFILE = load_profile("gb300-glm52")
BLOCK_BYTES = 256
LAYOUT = layout_for(PROFILE.block_tokens, BLOCK_BYTES)


def expected(block: int) -> int:
    scratch = BlockPool(LAYOUT, 1)
    synthesize(scratch, 0, block)
    return block_checksum(scratch, 0)


def submit(request: str, blocks: list[int], max_tokens: int = 5) -> RequestSubmitted:
    return RequestSubmitted(ts=0.0, src="test", request=request, branch="b", blocks=blocks,
                            prompt_tokens=len(blocks) * 64 + 10, max_tokens=max_tokens)


async def wait_for(bus, pred, timeout: float = 15.0):
    async def run():
        async with bus.consumer(None, start_seq=1) as c:
            async for d in c:
                if pred(d.event):
                    return d.event
    return await asyncio.wait_for(run(), timeout)


async def settled(*workers, timeout: float = 10.0) -> None:
    for w in workers:
        await asyncio.wait_for(w.kv.drain(), timeout)


@pytest.fixture
def cluster():
    fabric, hub = LoopbackFabric(), LocalExchange()
    bus, tokens = InMemoryBus("kv"), MemoryTokens("kv")

    def worker(node: str, role: str) -> EngineWorker:
        cfg = KvBytesConfig(block_bytes=BLOCK_BYTES, transfer="loopback", fabric=fabric, exchange=hub)
        return EngineWorker(bus, tokens, node, role, PROFILE, time_scale=20.0, heartbeat_s=0.05, kv_bytes=cfg)

    return bus, worker


async def test_p2d_move_and_peer_fetch_move_verified_bytes(cluster):
    bus, worker = cluster
    p1, p2, d1 = worker("p1", "prefill"), worker("p2", "prefill"), worker("d1", "decode")
    for w in (p1, p2, d1):
        await w.start()
    try:
        reg = await wait_for(bus, lambda e: isinstance(e, NodeRegistered) and e.node == "d1")
        assert reg.transfer_endpoint.startswith("loopback://loopback:d1;ctl=local-")
        assert parse_endpoint(reg.transfer_endpoint)[0] == "loopback"
        blocks = [7000 + i for i in range(12)]
        await bus.publish(submit("ra", blocks))
        await bus.publish(RouteDecided(ts=0.0, request="ra", prefill_node="p1", decode_node="d1", policy="t"))
        await wait_for(bus, lambda e: isinstance(e, RequestFinished) and e.request == "ra")
        await settled(p1, d1)
        # P->D: p1 wrote the blocks into d1's L1 slots; d1 verified each one
        assert d1.kv.stats.moved_blocks == 12 and d1.kv.stats.failed == 0
        assert {b: d1.kv.tiers["L1"].checksum_of[b] for b in blocks} == {b: expected(b) for b in blocks}
        assert p1.kv.stats.served_blocks == 12 and p1.kv.stats.bytes_out == 12 * BLOCK_BYTES
        # a second request with the same prefix, prefilled on p2 with a fetch plan from p1's host memory
        await bus.publish(submit("rb", blocks))
        await bus.publish(RouteDecided(ts=0.0, request="rb", prefill_node="p2", decode_node="d1", policy="t",
                                       fetch_plan=[FetchStep(src_node="p1", first_block=0, n_blocks=12)]))
        await wait_for(bus, lambda e: isinstance(e, RequestFinished) and e.request == "rb")
        await settled(p1, p2, d1)
        s = p2.kv.stats
        assert (s.fetched_blocks, s.local_copies, s.unavailable, s.failed) == (12, 12, 0, 0)
        assert s.verified == 24 and s.bytes_in == 12 * BLOCK_BYTES  # read once, copied on L2 -> L1
        for tier in ("L1", "L2"):
            kb = p2.kv.tiers[tier]
            assert {b: kb.checksum_of[b] for b in blocks} == {b: expected(b) for b in blocks}
        assert all(kb.held_slots == 0 for w in (p1, p2, d1) for kb in w.kv.tiers.values())  # leases released
    finally:
        for w in (p1, p2, d1):
            await w.stop()


async def test_a_corrupted_block_is_refused_and_the_prefill_recomputes_it(cluster):
    """The owner's copy is torn: the read lands bytes whose checksum is not the owner's, the
    transfer layer refuses them (before, the block was kept without bytes and the
    prefill counted it as cached), the block is evicted and the prefill computes it."""
    bus, worker = cluster
    p1, p2 = worker("p1", "collocated"), worker("p2", "collocated")
    for w in (p1, p2):
        await w.start()
    try:
        blocks = [9100 + i for i in range(4)]
        await bus.publish(submit("ra", blocks))
        await bus.publish(RouteDecided(ts=0.0, request="ra", prefill_node="p1", decode_node="p1", policy="t"))
        await wait_for(bus, lambda e: isinstance(e, RequestFinished) and e.request == "ra")
        l2 = p1.kv.tiers["L2"]
        l2.pool.bytes[l2.slot_of[blocks[2]], 5] ^= 0x40  # a torn copy in the owner's host memory
        await bus.publish(submit("rb", blocks))
        await bus.publish(RouteDecided(ts=0.0, request="rb", prefill_node="p2", decode_node="p2", policy="t",
                                       fetch_plan=[FetchStep(src_node="p1", first_block=0, n_blocks=4)]))
        await wait_for(bus, lambda e: isinstance(e, RequestFinished) and e.request == "rb")
        await settled(p1, p2)
        s = p2.kv.stats
        assert s.failed == 1 and s.fetched_blocks == 3
        assert any("kv_transfer_refused" in e for e in s.errors)
        started = await wait_for(bus, lambda e: isinstance(e, RequestStarted) and e.request == "rb"
                                 and e.phase == "prefill")
        assert started.node == "p2" and started.cached_tokens == 2 * PROFILE.block_tokens  # up to the gap
        evicted = await wait_for(bus, lambda e: isinstance(e, KvEvicted) and e.node == "p2")
        assert evicted.blocks == [blocks[2]]
        # computed by the prefill: its bytes are the block's own again
        assert p2.kv.tiers["L2"].checksum_of[blocks[2]] == expected(blocks[2])
        assert p2.kvgate.recomputed_blocks == 1
    finally:
        for w in (p1, p2):
            await w.stop()


def test_held_slots_are_never_handed_out_until_released():
    kb = KvBytes("a", "L2", LAYOUT, 4)
    kb.observe(KvStored(ts=0, src="a", node="a", tier="L2", blocks=[1, 2]))
    kb.hold([kb.slot_of[1]])  # a peer reads block 1
    kb.observe(KvEvicted(ts=0, src="a", node="a", tier="L2", blocks=[1]))
    kb.observe(KvStored(ts=0, src="a", node="a", tier="L2", blocks=[3]))
    assert kb.slot_of[3] != 0  # slot 0 still held by the reader
    kb.release([0])
    kb.observe(KvStored(ts=0, src="a", node="a", tier="L2", blocks=[4]))
    assert kb.slot_of[4] == 0


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "evict", "expect", "land", "abandon", "hold", "release"]),
                          st.lists(st.integers(0, 9), min_size=1, max_size=3)), max_size=30))
def test_slots_stay_consistent_under_any_mix_of_stores_transfers_and_holds(ops):
    kb = KvBytes("a", "L2", LAYOUT, 40)
    inflight: list[tuple[int, int]] = []
    holds: list[int] = []
    for op, blocks in ops:
        if op == "store":
            kb.observe(KvStored(ts=0, src="a", node="a", tier="L2", blocks=blocks))
        elif op == "evict":
            kb.observe(KvEvicted(ts=0, src="a", node="a", tier="L2", blocks=blocks))
        elif op == "expect":
            inflight += kb.expect(blocks)
        elif op in ("land", "abandon") and inflight:
            b, s = inflight.pop(0)
            if op == "land":
                synthesize(kb.pool, s, b)
                assert kb.land(b, s, expected(b), block_checksum(kb.pool, s))
            else:
                kb.abandon(b, s)
        elif op == "hold":
            held = [kb.slot_of[b] for b in blocks if kb.has_bytes(b)]
            kb.hold(held)
            holds += held
        elif op == "release" and holds:
            kb.release([holds.pop()])
        live = list(kb.slot_of.values())
        assert len(set(live)) == len(live), "two blocks share a slot"
        assert set(kb.pending) <= set(kb.slot_of)
        for b in kb.checksum_of:
            assert block_checksum(kb.pool, kb.slot_of[b]) == expected(b)
    for b, s in inflight:
        kb.abandon(b, s)
    kb.release(holds)
    kb.observe(KvEvicted(ts=0, src="a", node="a", tier="L2", blocks=list(range(10))))
    assert kb.slots.num_free == kb.pool.num_slots and kb.held_slots == 0


async def test_tcp_control_channel_round_trip_and_a_dead_peer_in_one_line():
    from engine.kvplane import Lease, Reply

    server, client = TcpExchange(), TcpExchange()

    async def handler(msg):
        assert isinstance(msg, Lease)
        return Reply(where=["L2"] * len(msg.blocks), slots=list(range(len(msg.blocks))),
                     checksums=[2**64 - 1] * len(msg.blocks), lease=7)

    await server.start(handler)
    await client.start(handler)
    try:
        reply = await client.request(server.address, Lease(blocks=[1, 2**64 - 1]), 5.0)
        assert (reply.slots, reply.checksums, reply.lease) == ([0, 1], [2**64 - 1] * 2, 7)
        reply = await client.request(server.address, Lease(blocks=[3]), 5.0)  # same connection
        assert reply.slots == [0]
        await server.close()
        with pytest.raises(TransferError, match="KV plane at 127.0.0.1:"):
            for _ in range(3):
                await client.request(server.address, Lease(blocks=[1]), 1.0)
    finally:
        await client.close()


def test_bad_settings_are_one_line_errors(capsys):
    with pytest.raises(KvLayoutError, match="--kv-block-bytes 100: must be a positive multiple of 128"):
        layout_for(64, 100)
    with pytest.raises(TransferError, match="is not '<backend>://<endpoint>;ctl=<host:port>'"):
        parse_endpoint("127.0.0.1:1234")
    rc = main(["--node", "n1", "--nats-url", "nats://127.0.0.1:1", "--backend", "sglang", "--kv-bytes"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == "engine.worker: --kv-bytes runs with --backend sim (SGLang moves its own KV)"
