"""The shared KV pool: capacity, reservation, pins, the policy's eviction order and the
events it emits - exact block ids, exact events."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kvpool import KvPool
from events.catalog import KvEvicted, KvStored
from tests.hyp import examples


class Fixture:
    """A pool of 4 L1 blocks / 6 L2 blocks whose policy evicts oldest-stored first."""

    def __init__(self, l1=4, l2=6, evict_batch=0.0):
        self.log = []
        self.order = {"L1": [], "L2": []}
        self.asked = []
        self.pool = KvPool("n1", 64, l1 * 64, l2 * 64, choose=self.choose, emit=self.emit, now=lambda: 7.0,
                           evict_batch=evict_batch)

    def choose(self, tier, tokens, pinned):
        self.asked.append((tier, tokens, pinned))
        return [b for b in self.order[tier] if b not in pinned][: tokens // 64]

    def emit(self, e):
        self.log.append(e)
        if isinstance(e, KvStored):
            self.order[e.tier].extend(e.blocks)
        elif isinstance(e, KvEvicted):
            self.order[e.tier] = [b for b in self.order[e.tier] if b not in e.blocks]


def test_store_reports_only_new_blocks_in_order():
    f = Fixture()
    assert f.pool.store("L1", [1, 2, 2, 3], request="r") == [1, 2, 3]
    assert f.pool.store("L1", [1, 2, 3, 4]) == [4]
    assert f.pool.store("L1", [1, 2]) == []
    assert [(type(e).__name__, e.tier, e.blocks, e.ts) for e in f.log] == [
        ("KvStored", "L1", [1, 2, 3], 7.0), ("KvStored", "L1", [4], 7.0)]
    assert f.log[0].request == "r" and f.log[0].node == "n1" and f.log[0].src == "n1"


def test_eviction_follows_the_policy_and_spares_pinned_blocks():
    f = Fixture()
    f.pool.store("L1", [1, 2, 3, 4])
    f.pool.pin(("d", "r"), [1])
    assert f.pool.store("L1", [5, 6]) == [5, 6]
    assert f.log[-2].blocks == [2, 3] and isinstance(f.log[-2], KvEvicted)
    assert f.pool.l1 == {1, 4, 5, 6}
    assert f.asked[-1] == ("L1", 128, frozenset({1}))
    f.pool.unpin(("d", "r"))
    assert f.pool.pinned() == frozenset()


def test_all_pinned_keeps_the_prefix_that_fits():
    f = Fixture(l1=3)
    f.pool.store("L1", [1, 2])
    f.pool.pin("a", [1, 2])
    assert f.pool.store("L1", [7, 8, 9]) == [7]
    assert f.pool.l1 == {1, 2, 7}


def test_reserved_tokens_count_in_whole_blocks_against_l1_only():
    f = Fixture(l1=4, l2=2)
    f.pool.reserved_tokens = 65  # two blocks' worth
    assert f.pool.make_room("L1", 2) is True
    assert f.pool.make_room("L1", 3) is False  # nothing to evict
    assert f.pool.make_room("L2", 2) is True
    assert f.pool.make_room("L1", 1, extra_tokens=64) is True
    assert f.pool.make_room("L1", 1, extra_tokens=128) is False


def test_low_watermark_frees_a_batch():
    f = Fixture(l1=100, evict_batch=0.1)
    f.pool.store("L1", list(range(100)))
    f.pool.store("L1", [1000])
    assert f.log[-2].blocks == list(range(10))  # 10% of the tier, not 1 block


def test_drop_all_and_add_and_observed_tiers():
    f = Fixture()
    f.pool.add("L2", [5, 6])
    assert f.log == [] and f.pool.holds(5, "L2")
    f.pool.store("L1", [1])
    f.pool.drop_all()
    assert [(e.tier, e.blocks) for e in f.log[-2:]] == [("L1", [1]), ("L2", [5, 6])]
    assert f.pool.observe_stored("L2", [9, 9, 10]) == [9, 10]
    assert f.pool.observe_removed("L2", [10, 11]) == [10]
    assert f.pool.l2 == {9} and (f.log[-1].tier, f.log[-1].blocks) == ("L2", [10])


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "pin", "unpin"]), st.lists(st.integers(0, 30), max_size=8)),
                max_size=40))
def test_capacity_and_pins_hold_under_any_sequence(ops):
    f = Fixture(l1=5, l2=5)
    held = {"L1": set(), "L2": set()}
    for i, (op, blocks) in enumerate(ops):
        if op == "store":
            for tier in ("L1", "L2"):
                before = set(f.pool.tier(tier))
                pinned = f.pool.pinned()
                f.pool.store(tier, blocks)
                assert len(f.pool.tier(tier)) <= 5
                assert pinned & before <= f.pool.tier(tier), "a pinned block was evicted"
        elif op == "pin":
            f.pool.pin(i % 3, blocks)
        else:
            f.pool.unpin(i % 3)
    for e in f.log:  # the events replay to exactly the pool's state
        if isinstance(e, KvStored):
            held[e.tier].update(e.blocks)
        else:
            held[e.tier].difference_update(e.blocks)
    assert held["L1"] == f.pool.l1 and held["L2"] == f.pool.l2
