"""A KV transfer cut mid-way between workers (``evolving chaos --engines``'s
``cut-kv-transfer``): the transport reports it done, half of the bytes are missing, the
checksums refuse it and the request recomputes the refused blocks; in-process over the
loopback fabric (tests/contract/test_transfer.py has the same refusal on Mooncake)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from events.catalog import FetchStep, KvEvicted, KvStored, RequestFinished, RequestStarted, RouteDecided

from .test_kvplane import PROFILE, cluster, expected, settled, submit, wait_for  # noqa: F401 - the fixture


async def test_a_peer_fetch_cut_mid_way_is_refused_and_the_prefill_computes_the_blocks(cluster):  # noqa: F811
    bus, worker = cluster
    p1, p2 = worker("p1", "collocated"), worker("p2", "collocated")
    for w in (p1, p2):
        await w.start()
    try:
        blocks = [5100 + i for i in range(8)]
        await bus.publish(submit("ra", blocks))
        await bus.publish(RouteDecided(ts=0.0, request="ra", prefill_node="p1", decode_node="p1", policy="t"))
        await wait_for(bus, lambda e: isinstance(e, RequestFinished) and e.request == "ra")
        p2.kv.transfer.cut_transfers = 1  # p2 reads: its next read moves half of the bytes
        await bus.publish(submit("rb", blocks))
        await bus.publish(RouteDecided(ts=0.0, request="rb", prefill_node="p2", decode_node="p2", policy="t",
                                       fetch_plan=[FetchStep(src_node="p1", first_block=0, n_blocks=8)]))
        await wait_for(bus, lambda e: isinstance(e, RequestFinished) and e.request == "rb")
        await settled(p1, p2)
        s = p2.kv.stats
        assert s.failed == 4 and s.fetched_blocks == 4  # the second half refused, none kept without bytes
        assert any("kv_transfer_refused" in e for e in s.errors)
        evicted = await wait_for(bus, lambda e: isinstance(e, KvEvicted) and e.node == "p2" and e.tier == "L2")
        assert evicted.blocks == blocks[4:]
        started = await wait_for(bus, lambda e: isinstance(e, RequestStarted) and e.request == "rb"
                                 and e.phase == "prefill")
        assert started.cached_tokens == 4 * PROFILE.block_tokens  # the refused half was computed
        # the prefill stored what it computed: every block's bytes are verified again on p2
        for tier in ("L1", "L2"):
            assert {b: p2.kv.tiers[tier].checksum_of[b] for b in blocks} == {b: expected(b) for b in blocks}
    finally:
        for w in (p1, p2):
            await w.stop()


async def test_a_p2d_push_cut_mid_way_is_refused_and_recomputed_on_the_decode_node(cluster):  # noqa: F811
    bus, worker = cluster
    p1, d1 = worker("p1", "prefill"), worker("d1", "decode")
    for w in (p1, d1):
        await w.start()
    try:
        blocks = [6100 + i for i in range(8)]
        p1.kv.transfer.cut_transfers = 1  # p1 writes into d1's slots: half of the bytes arrive
        await bus.publish(submit("ra", blocks))
        await bus.publish(RouteDecided(ts=0.0, request="ra", prefill_node="p1", decode_node="d1", policy="t"))
        await wait_for(bus, lambda e: isinstance(e, RequestFinished) and e.request == "ra")
        await settled(p1, d1)
        assert d1.kv.stats.failed == 4 and d1.kvgate.recomputed_blocks == 4
        evicted = await wait_for(bus, lambda e: isinstance(e, KvEvicted) and e.node == "d1")
        assert evicted.blocks == blocks[4:] and evicted.tier == "L1"
        again = await wait_for(bus, lambda e: isinstance(e, KvStored) and e.node == "d1" and e.request == "ra"
                               and e.tier == "L1")
        assert again.blocks == blocks[4:]
        assert {b: d1.kv.tiers["L1"].checksum_of[b] for b in blocks} == {b: expected(b) for b in blocks}
    finally:
        for w in (p1, d1):
            await w.stop()
