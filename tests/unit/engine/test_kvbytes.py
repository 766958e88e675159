"""Byte-backed KV tiers: a real KvPool's events move real bytes, and blocks fetched or pushed
between two nodes (loopback transfer) arrive with verified checksums."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kvbytes import ChecksumMismatch, KvBytes, synthesize
from engine.kvpool import KvPool
from engine.transfer import TransferError
from engine.transfer.loopback import LoopbackFabric, LoopbackTransfer
from events.catalog import KvEvicted, KvStored
from kernels.checksum import block_checksum
from kernels.layout import KvLayout
from kernels.pool import BlockPool
from tests.hyp import examples

LAYOUT = KvLayout(4, 2, 1, 8, "bf16")  # 128-byte blocks


class Node:
    """A node's L2 tier: a KvPool (oldest-stored evicted first) with KvBytes tapped in."""

    def __init__(self, name: str, fabric: LoopbackFabric | None, l2_blocks: int = 6, transfer=None) -> None:
        self.order: list[int] = []
        self.log: list = []
        self.bytes = KvBytes(name, "L2", LAYOUT, l2_blocks)
        self.pool = KvPool(
            name,
            64,
            64,
            l2_blocks * 64,
            choose=self.choose,
            emit=self.bytes.tap(self.emit),
            now=lambda: 0.0,
            evict_batch=0.0,
        )
        self.transfer = transfer if transfer is not None else LoopbackTransfer(fabric, name)
        self.desc = self.transfer.register_pool(self.bytes.pool)

    def choose(self, tier, tokens, pinned):
        return [b for b in self.order if b not in pinned][: tokens // 64]

    def emit(self, e):
        self.log.append(e)
        if isinstance(e, KvStored):
            self.order.extend(e.blocks)
        elif isinstance(e, KvEvicted):
            self.order = [b for b in self.order if b not in e.blocks]


def expected_checksum(block: int) -> int:
    scratch = BlockPool(LAYOUT, 1)
    synthesize(scratch, 0, block)
    return block_checksum(scratch, 0)


def consistent(node: Node) -> None:
    kb = node.bytes
    assert set(kb.slot_of) == node.pool.l2
    assert len(set(kb.slot_of.values())) == len(kb.slot_of), "two blocks share a slot"
    assert kb.slots.num_free == kb.pool.num_slots - len(kb.slot_of)
    for block, slot in kb.slot_of.items():
        assert block_checksum(kb.pool, slot) == kb.checksum_of[block]


def test_stored_blocks_get_bytes_and_the_same_block_has_the_same_checksum_everywhere():
    fabric = LoopbackFabric()
    a, b = Node("a", fabric), Node("b", fabric)
    a.pool.store("L2", [11, 12, 2**64 - 1])
    b.pool.store("L2", [12])
    assert a.bytes.checksum_of[12] == b.bytes.checksum_of[12] == expected_checksum(12)
    assert a.bytes.checksum_of[11] != a.bytes.checksum_of[12]
    assert a.bytes.slot_of == {11: 0, 12: 1, 2**64 - 1: 2}
    consistent(a)


def test_eviction_frees_slots_for_the_next_store():
    a = Node("a", LoopbackFabric(), l2_blocks=3)
    a.pool.store("L2", [1, 2, 3])
    a.pool.store("L2", [4, 5])
    assert a.pool.l2 == {3, 4, 5}
    assert sorted(a.bytes.slot_of[b] for b in (4, 5)) == [0, 1]
    consistent(a)


def test_events_of_other_nodes_and_tiers_move_no_bytes():
    a = Node("a", LoopbackFabric())
    a.bytes.observe(KvStored(ts=0.0, src="b", node="b", tier="L2", blocks=[1]))
    a.bytes.observe(KvStored(ts=0.0, src="a", node="a", tier="L1", blocks=[1]))
    assert a.bytes.slot_of == {}


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.lists(st.integers(0, 15), min_size=1, max_size=5), max_size=12))
def test_slots_follow_the_pool_through_any_store_sequence(batches):
    a = Node("a", LoopbackFabric(), l2_blocks=5)
    for batch in batches:
        a.pool.store("L2", batch)
        consistent(a)


def test_peer_fetch_moves_verified_bytes():
    fabric = LoopbackFabric()
    a, b = Node("a", fabric), Node("b", fabric)
    a.pool.store("L2", [21, 22, 23])
    b.pool.store("L2", [99])
    slots, sums = a.bytes.export([23, 21])
    assert b.pool.make_room("L2", 2)
    got = b.bytes.receive([23, 21], transfer=b.transfer, peer=a.desc, peer_slots=slots, checksums=sums)
    b.pool.add("L2", got)
    assert got == [23, 21]
    assert b.bytes.checksum_of[23] == expected_checksum(23)
    consistent(b)
    # blocks held already are not read again
    assert (
        b.bytes.receive([21], transfer=b.transfer, peer=a.desc, peer_slots=slots[1:], checksums=sums[1:])
        == []
    )


def test_a_corrupted_block_is_refused_and_nothing_is_kept():
    fabric = LoopbackFabric()
    a, b = Node("a", fabric), Node("b", fabric)
    a.pool.store("L2", [31, 32])
    slots, sums = a.bytes.export([31, 32])
    a.bytes.pool.bytes[slots[1], 7] ^= 0xFF  # a torn copy on the owner's side
    free = b.bytes.slots.num_free
    with pytest.raises(ChecksumMismatch, match="block 0x20 from loopback:a"):
        b.bytes.receive([31, 32], transfer=b.transfer, peer=a.desc, peer_slots=slots, checksums=sums)
    assert b.bytes.slot_of == {} and b.bytes.slots.num_free == free


def test_export_of_a_block_not_held_names_it():
    a = Node("a", LoopbackFabric())
    with pytest.raises(TransferError, match="does not hold block 0x2a"):
        a.bytes.export([42])


def test_prefill_pushes_into_slots_the_decode_reserved():
    fabric = LoopbackFabric()
    p, d = Node("p", fabric), Node("d", fabric)
    p.pool.store("L2", [41, 42])
    target = d.bytes.reserve(2)
    sums = p.bytes.push([41, 42], transfer=p.transfer, peer=d.desc, peer_slots=target)
    d.bytes.adopt([41, 42], target, sums)
    d.pool.add("L2", [41, 42])
    assert d.bytes.checksum_of == {41: expected_checksum(41), 42: expected_checksum(42)}
    consistent(d)


def test_a_push_with_wrong_checksums_is_not_adopted():
    fabric = LoopbackFabric()
    p, d = Node("p", fabric), Node("d", fabric)
    p.pool.store("L2", [51])
    target = d.bytes.reserve(1)
    sums = p.bytes.push([51], transfer=p.transfer, peer=d.desc, peer_slots=target)
    with pytest.raises(ChecksumMismatch, match="block 0x33 written by a peer"):
        d.bytes.adopt([51], target, [sums[0] ^ 1])
    assert d.bytes.slot_of == {} and d.bytes.slots.num_free == d.bytes.pool.num_slots


def test_peer_fetch_through_mooncake_tcp_verifies_every_block():
    from engine.transfer.mooncake import MooncakeTransfer, mooncake_available

    ok, why = mooncake_available()
    if not ok:
        pytest.skip(f"Mooncake unavailable: {why}")
    a = Node("a", None, transfer=MooncakeTransfer())
    b = Node("b", None, transfer=MooncakeTransfer())
    try:
        a.pool.store("L2", [61, 62, 63, 64])
        slots, sums = a.bytes.export([64, 62, 61])
        assert b.pool.make_room("L2", 3)
        got = b.bytes.receive(
            [64, 62, 61], transfer=b.transfer, peer=a.desc, peer_slots=slots, checksums=sums
        )
        b.pool.add("L2", got)
        assert {blk: b.bytes.checksum_of[blk] for blk in got} == {blk: expected_checksum(blk) for blk in got}
        consistent(b)
    finally:
        a.transfer.close()
        b.transfer.close()


def test_a_cut_push_into_a_slot_that_held_the_same_block_before_is_refused():
    """Slots are handed out lowest first: a block evicted and pushed again lands in the slot its
    old bytes are still in, so a push cut mid-way would leave the right bytes behind and pass
    unseen. Reserved slots are poisoned (``BlockPool.poison``) before a peer writes them."""
    fabric = LoopbackFabric()
    p, d = Node("p", fabric), Node("d", fabric, l2_blocks=1)
    p.pool.store("L2", [61])
    d.pool.store("L2", [61])
    old = d.bytes.slot_of[61]
    assert d.pool.make_room("L2", 1) and 61 not in d.bytes.slot_of  # evicted: its bytes stay in the slot
    target = d.bytes.reserve(1)
    assert target == [old]
    p.transfer.cut_transfers = 1
    sums = p.bytes.push([61], transfer=p.transfer, peer=d.desc, peer_slots=target)
    assert p.transfer.cut_transfers == 0
    with pytest.raises(ChecksumMismatch, match="block 0x3d written by a peer"):
        d.bytes.adopt([61], target, sums)
