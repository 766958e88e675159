"""Hypothesis: ``BlockSet`` (a node KV pool's tier, services/cores/directory/_native.pyx)
is a Python ``set`` of uint64 hashes: the same members, length, membership answers and
comparisons under any sequence of writes, whatever the table's growth and tombstones do; a write
naming a bad hash (negative, >= 2**64, not an int) raises and leaves the set as it was. One
difference, on purpose: only ints are hashes, so ``1.0 in {1}`` but no float is in a BlockSet."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from services.cores.directory._native import BlockCounts, BlockSet

from tests.hyp import examples

# a small pool of hashes so that writes collide (re-adds, removes of members), plus the edges
HASHES = st.integers(0, 40) | st.sampled_from([2**64 - 1, 2**63, 2**32, 1 << 40])
BAD = st.integers(max_value=-1) | st.integers(min_value=2**64) | st.sampled_from(["1", 1.0, None, (1,)])
LISTS = st.lists(HASHES, max_size=30)

OPS = st.one_of(
    st.tuples(st.just("update"), LISTS),
    st.tuples(st.just("difference_update"), LISTS),
    st.tuples(st.just("add"), HASHES),
    st.tuples(st.just("discard"), HASHES),
    st.tuples(st.just("clear")),
    st.tuples(st.just("bad update"), LISTS, BAD),
    st.tuples(st.just("bad difference_update"), LISTS, BAD),
    st.tuples(st.just("bad add"), BAD),
)


def _apply(bs: BlockSet, ref: set, op: tuple) -> None:
    name = op[0]
    if name.startswith("bad "):
        before = set(bs)
        *good, bad = op[1:]
        arg = (good[0] + [bad]) if good else bad
        with pytest.raises(TypeError, match="not a uint64 hash"):
            getattr(bs, name[4:])(arg)
        assert set(bs) == before and len(bs) == len(before)  # nothing changed, not even a prefix
        return
    getattr(bs, name)(*op[1:])
    getattr(ref, name)(*op[1:])


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(OPS, max_size=40), st.lists(HASHES | BAD, max_size=20))
def test_blockset_is_a_set_of_uint64_hashes_under_any_writes(ops, probes):
    bs, ref = BlockSet(16), set()
    for op in ops:
        _apply(bs, ref, op)
        assert len(bs) == len(ref) and bool(bs) == bool(ref)
        assert sorted(bs) == sorted(ref)
        assert bs == ref and ref == bs and (bs != ref) is False and bs == frozenset(ref)
        for x in probes + list(ref):
            # only ints are hashes: ``1.0 in {1}`` but a float is in no BlockSet
            want = isinstance(x, int) and x in ref
            assert (x in bs) == want, x
    # comparisons and copies
    sub = set(list(ref)[: len(ref) // 2])
    assert (bs >= sub, bs <= sub, bs > sub, bs < sub) == (ref >= sub, ref <= sub, ref > sub, ref < sub)
    assert (frozenset(sub) <= bs) == (sub <= ref) and bs.issuperset(sub) and bs.issubset(ref)
    assert bs.isdisjoint(probes) == ref.isdisjoint(x for x in probes if isinstance(x, int))
    c = bs.copy()
    assert c == bs and c is not bs and pickle.loads(pickle.dumps(bs)) == ref
    c.add(2**64 - 2)
    assert (2**64 - 2 in bs) == (2**64 - 2 in ref)  # the copy is independent
    counts = BlockCounts()
    counts.add(sorted(ref))
    assert bs == counts and (bs != counts) is False


def test_a_bad_hash_names_itself_and_changes_nothing():
    bs = BlockSet()
    bs.update([1, 2, 3])
    for bad in (-1, 2**64, "7", 1.5, None):
        with pytest.raises(TypeError, match=r"BlockSet: block .* is not a uint64 hash"):
            bs.update([4, 5, bad])
        with pytest.raises(TypeError, match="not a uint64 hash"):
            bs.difference_update([1, bad])
        assert sorted(bs) == [1, 2, 3]
        assert bad not in bs if bad is not None else None not in bs
    with pytest.raises(TypeError):
        hash(bs)  # mutable, as a set
    assert bs != [1, 2, 3] and (bs == [1, 2, 3]) is False  # only sets compare equal
