"""``KvPool.store_through``: L1 written through to L2 is ``store("L1")`` then
``store("L2")`` - same tiers, same evictions in the same order, same blocks returned - with the
two ``KvStored`` sent as one ``write_through`` event when both tiers add the same blocks and L2
has room for them without evicting (a prompt a full tier cuts short stays a pair)."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kvpool import KvPool
from events.catalog import KvEvicted, KvStored
from tests.hyp import examples


class Fixture:
    """A pool whose policy evicts oldest-stored first, the order kept from the pool's own events
    (as the directory keeps it): a merged event must feed it as the pair did."""

    def __init__(self, l1: int, l2: int, evict_batch: float, reserved: int = 0) -> None:
        self.log: list = []
        self.order: dict[str, list[int]] = {"L1": [], "L2": []}
        self.pool = KvPool("n1", 64, l1 * 64, l2 * 64, choose=self.choose, emit=self.emit, now=lambda: 7.0,
                           evict_batch=evict_batch)
        self.pool.reserved_tokens = reserved

    def choose(self, tier, tokens, pinned):
        return [b for b in self.order[tier] if b not in pinned][: max(1, tokens // 64)]

    def emit(self, e) -> None:
        self.log.append(e)
        if isinstance(e, KvStored):
            for t in e.tiers():
                self.order[t].extend(e.blocks)
        elif isinstance(e, KvEvicted):
            self.order[e.tier] = [b for b in self.order[e.tier] if b not in e.blocks]


def _expand(log: list) -> list:
    """The log as an older producer wrote it: a write-through store as L1 then L2."""
    out = []
    for e in log:
        if isinstance(e, KvStored) and e.write_through is True:
            out += [KvStored(ts=e.ts, src=e.src, node=e.node, tier="L1", blocks=e.blocks, request=e.request),
                    KvStored(ts=e.ts, src=e.src, node=e.node, tier="L2", blocks=list(e.blocks), request=e.request)]
        else:
            out.append(e)
    return out


blocks = st.lists(st.integers(1, 14), min_size=0, max_size=7)
OPS = st.lists(st.one_of(
    st.tuples(st.just("through"), blocks, st.booleans()),  # pinned: the blocks themselves, or none
    st.tuples(st.just("store"), st.sampled_from(["L1", "L2"]), blocks),
    st.tuples(st.just("pin"), st.integers(0, 2), blocks),
    st.tuples(st.just("unpin"), st.integers(0, 2)),
    st.tuples(st.just("drop"), st.sampled_from(["L1", "L2"]), blocks),
), min_size=1, max_size=30)


@settings(max_examples=examples(400), deadline=None)
@given(ops=OPS, l1=st.integers(1, 6), l2=st.integers(1, 9), batch=st.sampled_from([0.0, 0.3]),
       reserved=st.sampled_from([0, 64, 130]))
def test_store_through_is_the_l1_then_l2_pair(ops, l1, l2, batch, reserved):
    pair, through = Fixture(l1, l2, batch, reserved), Fixture(l1, l2, batch, reserved)
    for op in ops:
        kind = op[0]
        if kind == "through":
            pins = op[1] if op[2] else ()
            want = (pair.pool.store("L1", op[1], pins, "r"), pair.pool.store("L2", op[1], pins, "r"))
            assert through.pool.store_through(op[1], pins, "r") == want
        elif kind == "store":
            for f in (pair, through):
                f.pool.store(op[1], op[2])
        elif kind == "pin":
            for f in (pair, through):
                f.pool.pin(op[1], op[2])
        elif kind == "unpin":
            for f in (pair, through):
                f.pool.unpin(op[1])
        else:
            for f in (pair, through):
                f.pool.observe_removed(op[1], op[2])
        assert (through.pool.l1, through.pool.l2) == (pair.pool.l1, pair.pool.l2)
        assert _expand(through.log) == pair.log
        assert through.order == pair.order


def test_one_event_when_both_tiers_add_the_same_blocks():
    f = Fixture(4, 6, 0.0)
    assert f.pool.store_through([1, 2, 3], [1, 2, 3], "r") == ([1, 2, 3], [1, 2, 3])
    assert f.log == [KvStored(ts=7.0, src="n1", node="n1", tier="L1", blocks=[1, 2, 3], request="r",
                              write_through=True)]
    assert f.pool.l1 == f.pool.l2 == {1, 2, 3}


def test_two_events_when_the_tiers_add_different_blocks_or_l2_must_evict():
    f = Fixture(4, 6, 0.0)
    f.pool.store("L2", [1])  # L2 already holds 1: L1 adds [1, 2], L2 adds [2]
    f.log.clear()
    assert f.pool.store_through([1, 2]) == ([1, 2], [2])
    assert [(e.tier, e.blocks, e.write_through) for e in f.log] == [
        ("L1", [1, 2], msgspec.UNSET), ("L2", [2], msgspec.UNSET)]
    g = Fixture(6, 3, 0.0)
    g.pool.store("L2", [7, 8])
    g.log.clear()
    assert g.pool.store_through([1, 2]) == ([1, 2], [1, 2])  # L2 holds 2 of 3: one eviction first
    assert [(type(e).__name__, e.tier, e.blocks) for e in g.log] == [
        ("KvStored", "L1", [1, 2]), ("KvEvicted", "L2", [7]), ("KvStored", "L2", [1, 2])]
