"""KvPool.prefix_len (a compiled loop, engine/_kvscan.pyx) equals its definition: the end of the
run of ``blocks[start:]`` held in the store, walked block by block; ``missing`` equals the
ordered, de-duplicated filter it replaced."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine import _kvscan
from engine.kvpool import KvPool

_CHUNK = 64  # the chunk of the set-test scan it replaced: its boundaries stay worth testing


def _walk(blocks, start, store) -> int:
    i = start
    while i < len(blocks) and blocks[i] in store:
        i += 1
    return max(i, start)


@given(blocks=st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 30), max_size=3 * _CHUNK + 5),
       held=st.data(), start=st.integers(0, 3 * _CHUNK + 10))
def test_prefix_len_is_the_held_run(blocks, held, start):
    store = set(held.draw(st.lists(st.sampled_from(blocks), unique=True))) if blocks else set()
    store |= set(held.draw(st.lists(st.integers(0, 30), max_size=5)))
    assert KvPool.prefix_len(blocks, start, store) == _walk(blocks, start, store)


def test_prefix_len_at_chunk_boundaries():
    c = _CHUNK
    blocks = list(range(3 * c))
    for k in (0, 1, c - 1, c, c + 1, 2 * c, 3 * c - 1, 3 * c):
        store = set(blocks[:k])
        for start in (0, 1, c - 1, c, k, 3 * c):
            assert KvPool.prefix_len(blocks, start, store) == _walk(blocks, start, store), (k, start)
    assert KvPool.prefix_len(blocks, 0, set(blocks)) == 3 * c
    assert KvPool.prefix_len((5, 6, 7), 1, {6}) == 2  # any sequence, not only lists
    assert KvPool.prefix_len([5, 6], 0, frozenset({5, 6})) == 2
    with pytest.raises(TypeError, match="must be a BlockSet or a set"):
        KvPool.prefix_len([5], 0, {5: 1})


@given(blocks=st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 30), max_size=200), held=st.data(),
       start=st.integers(0, 210))
def test_missing_after_is_the_ordered_distinct_filter(blocks, held, start):
    store = set(held.draw(st.lists(st.sampled_from(blocks), unique=True))) if blocks else set()
    want = [b for b in dict.fromkeys(blocks[start:]) if b not in store]
    assert _kvscan.missing_after(blocks, start, store) == want
    assert _kvscan.missing_after(tuple(blocks), start, frozenset(store)) == want
    pinned = set(blocks[::3])
    assert _kvscan.held_unpinned(blocks, store, pinned) == [b for b in blocks if b in store and b not in pinned]


_OPS = st.lists(st.tuples(st.sampled_from(["scan", "store", "add", "evict", "observe_removed", "drop_all"]),
                          st.integers(0, 2), st.sampled_from(["L1", "L2"]), st.integers(0, 12), st.integers(0, 40)),
                max_size=40)


@given(ops=_OPS, cap=st.integers(4, 60))
def test_held_run_equals_the_walk_across_stores_and_evictions(ops, cap):
    """The memo of ``held_run`` never answers from a run that a removal broke: after any mix of
    stores, silent adds, evictions (make_room through the policy), engine-side removals and
    drops, every scan of every list equals the block-by-block walk."""
    lists = [list(range(30)), list(range(20)) + [99, 98], list(range(5, 45))]  # shared prefixes
    order = list(range(200))

    def choose(tier, tokens, pinned):
        return [b for b in order if b not in pinned]

    pool = KvPool("n", 1, cap, cap, choose=choose, emit=lambda ev: None, now=lambda: 0.0)
    for op, li, tier, start, k in ops:
        blocks, store = lists[li], pool.tier(tier)
        if op == "scan":
            assert pool.held_run(blocks, start, store) == _walk(blocks, start, store)
        elif op == "store":
            pool.store(tier, blocks[:k])
        elif op == "add":
            room = pool.capacity_blocks(tier) - len(store)
            pool.add(tier, pool.missing(blocks[:k], store)[:max(0, room)])
        elif op == "evict":
            pool.make_room(tier, k)
        elif op == "observe_removed":
            pool.observe_removed(tier, blocks[start:start + 3])
        else:
            pool.drop_all()
        for other in lists:  # every list against both tiers, from every start that matters
            for t in ("L1", "L2"):
                s = pool.tier(t)
                for st_ in (0, start, len(other)):
                    assert pool.held_run(other, st_, s) == _walk(other, st_, s)
