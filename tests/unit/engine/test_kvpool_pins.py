"""The pool's pins are counted as they change: after any sequence of pins and unpins,
re-pins of the same owner with other lists included, the pinned blocks are exactly the union of
the owners' current lists (what ``pinned()`` rebuilt per eviction before), an eviction sees them
as pinned, evicts none of them nor of ``also_pinned``, and ``also_pinned`` counts for that call
only (it is never counted into the pins: the pool drops it from the chooser's answer)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from services.cores.directory._native import BlockCounts

from engine.kvpool import KvPool
from tests.hyp import examples

_OPS = st.lists(st.tuples(st.sampled_from(["pin", "pin", "unpin", "evict"]), st.integers(0, 3),
                          st.lists(st.integers(0, 40) | st.just(2**64 - 1), max_size=12)), max_size=40)


@settings(max_examples=examples(200), deadline=None)
@given(_OPS)
def test_pinned_is_the_union_of_the_owners_lists(ops):
    seen = []

    def choose(tier, tokens, pinned):
        seen.append(frozenset(pinned))
        return sorted(pool.l1)

    evicted = []
    pool = KvPool("n", 1, 8, 8, choose=choose, emit=lambda e: evicted.extend(e.blocks), now=lambda: 0.0)
    owners: dict[int, list[int]] = {}
    for op, owner, blocks in ops:
        if op == "pin":
            pool.pin(owner, blocks)
            owners[owner] = list(blocks)
        elif op == "unpin":
            pool.unpin(owner)
            owners.pop(owner, None)
        else:
            pool.add("L1", range(100, 108))
            want = set().union(*owners.values())
            evicted.clear()
            pool.make_room("L1", 1, also_pinned=blocks)
            assert seen[-1] == frozenset(want)  # the chooser saw the owners' pins
            assert not set(evicted) & (want | set(blocks))  # neither those nor the call's were evicted
            assert set(evicted) == set(range(100, 108)) - want - set(blocks)  # the chooser's order, less them
        want = frozenset(set().union(*owners.values()))
        assert pool.pinned() == want  # also_pinned is gone again
        assert all(pool.is_pinned(b) for b in want)


def test_a_pinned_block_is_never_a_victim_and_bad_hashes_change_nothing():
    pool = KvPool("n", 1, 4, 4, choose=lambda tier, tokens, pinned: [1, 2, 3, 4], emit=lambda e: None,
                  now=lambda: 0.0)
    pool.add("L1", [1, 2, 3, 4])
    pool.pin("a", [1, 2])
    pool.pin("b", [2])
    pool.unpin("a")
    assert pool.make_room("L1", 2, also_pinned=[3]) is True  # 1 and 4 go; 2 (b) and 3 (the call) stay
    assert pool.make_room("L1", 3, also_pinned=[3]) is False  # only 2 and 3 are left, both pinned
    assert pool.l1 == {2, 3} and pool.pinned() == frozenset({2})
    with pytest.raises(TypeError, match="not a uint64"):
        pool.pin("b", [2, -5])
    assert pool.pinned() == frozenset({2})  # b's old pin kept whole


def test_block_counts_is_a_multiset_of_uint64_hashes():
    c = BlockCounts()
    c.add([5, 5, 7])
    assert (c.count(5), c.count(7), len(c), 5 in c, 6 in c, "x" in c) == (2, 1, 2, True, False, False)
    assert c == frozenset({5, 7}) and frozenset({5, 7}) == c and c != {5}
    c.remove([5, 7])
    assert sorted(c) == [5]
    with pytest.raises(KeyError):
        c.remove([7])
    assert sorted(c) == [5]  # checked first: nothing changed


@settings(max_examples=examples(200), deadline=None)
@given(order=st.permutations(list(range(100, 116))), pinned=st.sets(st.integers(100, 115), max_size=6),
       also=st.lists(st.integers(100, 120), max_size=10), need=st.integers(1, 16))
def test_also_pinned_gives_the_policys_first_blocks_without_them(order, pinned, also, need):
    """A policy answers the first blocks of its order that are not pinned. The pool asks it
    without ``also_pinned`` and drops those blocks itself: the victims are those the policy
    gives when ``also_pinned`` is pinned too, in its order."""

    def choose(tier, tokens, pins):
        return [b for b in order if b not in pins][:tokens]

    evicted = []
    pool = KvPool("n", 1, 16, 16, choose=choose, emit=lambda e: evicted.extend(e.blocks), now=lambda: 0.0,
                  evict_batch=0.0)
    pool.add("L1", order)
    pool.pin("owner", sorted(pinned))
    fits = pool.make_room("L1", need, also_pinned=also)
    expected = choose("L1", need, pinned | set(also))
    assert evicted == expected
    assert fits == (len(expected) >= need)
    assert pool.pinned() == frozenset(pinned)
