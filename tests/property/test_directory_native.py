"""Hypothesis: the directory's compiled table kernels (``_native``: mark, touch, read, held_prefix,
runs, fresh, dropped, common_prefix, held_split, unmark, concat_u64, and the fold's one-pass
versions: refill, lookup_scan, refs_add, unused, fill_new, add_fresh, is_suffix, runs_ends) give
exactly what their numpy / Python definitions give (the code they replaced in table.py, lookup.py
and core.py), on random tables, slot lists and contexts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.cores.directory import _native
from services.cores.directory.lookup import _prefix_ends, _runs
from tests.hyp import examples

SLOTS = 16


@st.composite
def tables(draw):
    words = draw(st.integers(1, 3))
    held = np.array(draw(st.lists(st.lists(st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, 2, 3]),
                                           min_size=words, max_size=words), min_size=SLOTS, max_size=SLOTS)),
                    dtype=np.uint64)
    held[0] = 0  # the sentinel slot holds nothing
    s = np.array(draw(st.lists(st.integers(0, SLOTS - 1), max_size=40)), dtype=np.intp)
    j = draw(st.integers(0, 64 * words - 2)) & ~1
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))  # seeded by hypothesis: reproducible
    last = np.asfortranarray(rng.random((SLOTS, 64 * words)))
    return held, s, j, last, draw(st.floats(10, 20))


def _bit(j: int) -> np.uint64:
    return np.uint64(1 << (j & 63))


@settings(max_examples=examples(100), deadline=None)
@given(tables())
def test_mark_touch_read_match_their_numpy_definitions(t):
    held, s, j, last, ts = t
    col = held[:, j >> 6]  # a strided column view above one word

    h1, l1 = held.copy(), last.copy()
    _native.mark(h1[:, j >> 6], s, _bit(j), l1[:, j], ts)
    h2, l2 = held.copy(), last.copy()
    c2 = h2[:, j >> 6]
    c2[s] = c2[s] | _bit(j)
    l2[:, j][s] = ts
    assert (h1 == h2).all() and (l1 == l2).all()

    l1 = last.copy()
    ks = _native.touch(col, s, _bit(j), _bit(j + 1), l1[:, j], l1[:, j + 1], ts)
    l2 = last.copy()
    word = col[s]
    want = []
    for jj in (j, j + 1):
        c = (word & _bit(jj)).astype(bool)
        k = len(c) if c.all() else int(c.argmin())
        want.append(k)
        l2[:, jj][s[:k]] = ts
    assert list(ks) == want and (l1 == l2).all()

    l1 = last.copy()
    missing, m0, m1 = _native.read(col, s, _bit(j), _bit(j + 1), l1[:, j], l1[:, j + 1], ts, True)
    l2 = last.copy()
    hit = np.zeros(len(s), dtype=bool)
    masks = []
    for jj in (j, j + 1):
        c = (col[s] & _bit(jj)).astype(bool) & (s > 0)
        l2[:, jj][s[c]] = ts
        hit |= c
        masks.append(c)
    assert missing == int(len(s) - hit.sum()) and (l1 == l2).all()
    assert (m0 == masks[0]).all() and (m1 == masks[1]).all()
    assert _native.read(col, s, _bit(j), _bit(j + 1), l1[:, j], l1[:, j + 1], ts, False)[1:] == (None, None)

    a = np.zeros(len(s), dtype=bool)
    for w in range(held.shape[1]):
        a |= held[s, w].astype(bool)
    assert _native.held_prefix(held, s) == (len(a) if a.all() else int(a.argmin()))

    masks1 = held.take(s, axis=0)[:, 0]
    starts = [0, *(np.flatnonzero(masks1[1:] != masks1[:-1]) + 1).tolist()] if len(s) else []
    assert _native.runs(masks1) == (starts, masks1[starts].tolist() if len(s) else [])


BLOCK = st.integers(0, 30) | st.integers(0, 2**64 - 1)


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(BLOCK, max_size=50), st.lists(BLOCK, max_size=50), st.sets(BLOCK, max_size=30),
       st.frozensets(BLOCK, max_size=10))
def test_fresh_and_dropped_match_the_comprehensions(blocks, old, counted, excluded):
    counted |= set(old[::2])
    new = set(blocks) - excluded
    assert _native.fresh(blocks, counted, excluded) == [x for x in dict.fromkeys(blocks)
                                                        if x in new and x not in counted]
    assert _native.fresh(tuple(blocks), frozenset(counted), frozenset()) == [
        x for x in dict.fromkeys(blocks) if x not in counted]
    assert _native.dropped(old, counted, set(blocks), excluded) == [x for x in dict.fromkeys(old)
                                                                    if x in counted and x not in new]


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(BLOCK, max_size=30), st.lists(BLOCK, max_size=30), st.integers(0, 30))
def test_common_prefix_matches_its_definition(a, b, k):
    b = a[:k] + b  # a shared head of any length, then anything
    p = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert _native.common_prefix(a, b) == p
    assert _native.common_prefix(tuple(a), b) == p
    # equal values that are distinct int objects compare equal (not only identical ones)
    assert _native.common_prefix([int(str(x)) for x in a], a) == len(a)


@settings(max_examples=examples(100), deadline=None)
@given(tables(), st.booleans(), st.lists(st.integers(0, SLOTS - 1), max_size=80))  # past the prefetch distances
def test_bucket_pick_matches_its_numpy_definition(t, counted, arr):
    held, _, j, last, _ = t
    arr = np.array(arr, dtype=np.intp)
    cols = 32 * held.shape[1]  # node columns
    refs = np.asfortranarray(np.arange(SLOTS * cols, dtype=np.int32).reshape(SLOTS, cols) % 3)
    key = float(last[arr[0], j]) if len(arr) else 0.5
    last[arr[::2], j] = key  # some entries carry the bucket's key
    mark = np.zeros(SLOTS, dtype=np.uint8)
    bit = _bit(j)
    block = np.arange(SLOTS, dtype=np.uint64) * 7 + 1  # slot -> its block hash
    pins = _native.BlockCounts()
    pins.add(block[::3].tolist())
    ok = (held[arr, j >> 6] & bit).astype(bool) & ((refs[arr, j >> 1] > 0) == counted) & (last[arr, j] == key)
    want = list(dict.fromkeys(arr[ok].tolist()))  # valid, each once, first occurrence
    for pinned in (None, pins):
        valid, free = _native.bucket_pick(held[:, j >> 6], bit, refs[:, j >> 1], counted, last[:, j], key, arr,
                                          mark, block, pinned)
        assert (arr.tolist() if valid is None else valid.tolist()) == want
        assert valid is not None or len(want) == len(arr)  # None: every entry valid and distinct
        assert free.tolist() == [x for x in want if pinned is None or int(block[x]) not in pins]
        assert not mark.any()


@settings(max_examples=examples(100), deadline=None)
@given(tables(), st.lists(st.integers(-2, 3), min_size=SLOTS, max_size=SLOTS))
def test_held_split_matches_its_numpy_definition(t, counts):
    held, s, j, _, _ = t
    refs = np.asfortranarray(np.array([counts, counts[::-1]], dtype=np.int32).T)  # a node column of a table
    one, zero = _native.held_split(held[:, j >> 6], _bit(j), refs[:, 1], s)
    kept = s[(held[s, j >> 6] & _bit(j)).astype(bool)]  # what BlockTable._track did
    c = refs[kept, 1] > 0
    assert one.tolist() == kept[c].tolist() and zero.tolist() == kept[~c].tolist()
    assert one.dtype == zero.dtype == np.intp


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.lists(BLOCK, max_size=20), max_size=8))
def test_concat_u64_matches_fromiter(lists):
    total = sum(len(b) for b in lists)
    want = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.uint64, count=total)
    got = _native.concat_u64(lists, total)
    assert got.dtype == np.uint64 and got.tolist() == want.tolist()
    if lists and lists[-1]:
        with pytest.raises(ValueError):
            _native.concat_u64(lists, total - 1)
        with pytest.raises(ValueError):
            _native.concat_u64(lists, total + 1)


@pytest.mark.parametrize("bad", [-1, 2**64, "x", None])
def test_concat_u64_refuses_what_is_not_a_uint64(bad):
    with pytest.raises((OverflowError, TypeError, ValueError)):
        np.fromiter([1, bad], dtype=np.uint64, count=2)  # numpy refuses it too (its own error kind)
    with pytest.raises(OverflowError):
        _native.concat_u64([[1], [bad]], 2)


@settings(max_examples=examples(100), deadline=None)
@given(tables())
def test_unmark_matches_its_numpy_definition(t):
    held, s, j, _, _ = t
    h1 = held.copy()
    had = _native.unmark(h1[:, j >> 6], s, _bit(j))
    h2 = held.copy()  # what BlockTable.evict did
    have = (h2[s, j >> 6] & _bit(j)).astype(bool) & (s > 0)
    want = s[have]
    h2[want, j >> 6] &= ~_bit(j)
    assert had.tolist() == want.tolist() and (h1 == h2).all()


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(BLOCK, max_size=50), st.sets(BLOCK, max_size=30), st.frozensets(BLOCK, max_size=10))
def test_add_fresh_is_fresh_then_update(blocks, counted, excluded):
    want = _native.fresh(blocks, counted, excluded)
    got_set = set(counted)
    assert _native.add_fresh(blocks, got_set, excluded) == want
    assert got_set == counted | set(want)


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(BLOCK, max_size=30), st.lists(BLOCK, max_size=30), st.integers(0, 30))
def test_is_suffix_matches_the_slice(a, b, k):
    for tail in (b, a[len(a) - min(k, len(a)):], b + a[len(a) - min(k, len(a)):]):
        want = len(tail) <= len(a) and a[len(a) - len(tail):] == tail
        assert _native.is_suffix(a, tail) == want
        assert _native.is_suffix(tuple(a), [int(str(x)) for x in tail]) == want  # equal, not identical


@settings(max_examples=examples(200), deadline=None)
@given(tables())
def test_runs_ends_matches_runs_and_prefix_ends(t):
    held, s, _, _, _ = t
    masks = held.take(s, axis=0)[:, :1]  # one word
    starts, rows, tiers, local = _native.runs_ends(masks[:, 0])
    runs = _runs(masks)
    assert (starts, rows) == runs
    assert (tiers, local) == _prefix_ends(masks, runs)


@st.composite
def indexed(draw):
    """A SlotMap of some keys (slots 1..), a block list mixing them with unknown and non-uint64
    hashes, and cached slots of a prefix of it, some of them stale 0s."""
    keys = draw(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=40, unique=True))
    index = _native.SlotMap()
    index.insert(np.array(keys, dtype=np.uint64), np.arange(1, len(keys) + 1, dtype=np.intp))
    pick = st.sampled_from(keys) | st.integers(0, 2**64 - 1) | st.sampled_from([-1, 2**64])
    blocks = draw(st.lists(pick, max_size=150))
    k = draw(st.integers(0, len(blocks)))
    prefix = index.find_seq(blocks[:k], k)
    prefix[draw(st.lists(st.integers(0, max(k - 1, 0)), max_size=5)) if k else []] = 0
    return index, keys, blocks, prefix


@settings(max_examples=examples(150), deadline=None)
@given(indexed(), st.integers(1, 2), st.integers(0, 2**32 - 1))
def test_lookup_scan_and_refill_match_their_numpy_definitions(x, words, seed):
    index, keys, blocks, prefix = x
    rng = np.random.default_rng(seed)  # seeded by hypothesis: reproducible
    held = rng.integers(0, 4, size=(len(keys) + 1, words)).astype(np.uint64)
    held[0] = 0  # the sentinel slot holds nothing
    k = len(prefix)
    for pre in (None, prefix):  # what BlockTable.scan did
        want = np.empty(len(blocks), dtype=np.intp)
        if pre is None:
            want = index.find_seq(blocks, len(blocks))
        else:
            want[:k] = pre
            z = np.flatnonzero(pre == 0)
            if len(z):
                want[z] = index.find_seq([blocks[i] for i in z.tolist()], len(z))
            want[k:] = index.find_seq(blocks[k:], len(blocks) - k)
        pool = _native.held_prefix(held, want)
        got_pool, masks, s = _native.lookup_scan(index, blocks, pre, held)
        assert got_pool == pool and s.tolist() == want.tolist() and s.dtype == np.intp
        assert masks.dtype == np.uint64 and masks.tolist() == held.take(want[:pool], axis=0).tolist()
    # refill (BlockTable.resolve of cached slots): the same array when no 0, else 0s re-probed
    got = _native.refill(index, blocks[:k], prefix)
    z = np.flatnonzero(prefix == 0)
    if not len(z):
        assert got is prefix
    else:
        want = prefix.copy()
        want[z] = index.find_seq([blocks[i] for i in z.tolist()], len(z))
        assert got is not prefix and got.tolist() == want.tolist()


@settings(max_examples=examples(150), deadline=None)
@given(tables(), st.lists(st.integers(0, 3), min_size=SLOTS * 2, max_size=SLOTS * 2), st.integers(0, 1))
def test_refs_add_and_unused_match_their_numpy_definitions(t, counts, n):
    held, s, _, _, _ = t
    held[::3] = 0  # some slots hold nothing
    refs = np.asfortranarray(np.array(counts, dtype=np.int32).reshape(SLOTS, 2))

    def unused_def(r, slots):  # BlockTable.release's candidates
        slots = slots[slots > 0]
        return slots[~held.take(slots, axis=0).any(axis=1) & ~r[slots].any(axis=1)].tolist()

    assert _native.unused(held, refs, s).tolist() == unused_def(refs, s)
    r1, r2 = refs.copy(order="F"), refs.copy(order="F")
    assert _native.refs_add(r1[:, n], s, 1, held, r1) is None
    r2[:, n][s] = r2[:, n].take(s) + 1
    assert (r1 == r2).all()
    r1, r2 = refs.copy(order="F"), refs.copy(order="F")
    dead = _native.refs_add(r1[:, n], s, -1, held, r1)
    if not ((s > 0).all() and (r2[s, n] > 0).all()):
        assert dead is None and (r1 == r2).all()  # refused, nothing written
        return
    r2[:, n][s] = r2[:, n].take(s) - 1
    assert (r1 == r2).all() and dead.tolist() == unused_def(r2, s)


def test_fill_new_asks_for_room_and_allocates_nothing_without_it():
    index = _native.SlotMap()  # slots 1 and 2 in use before, 2 freed since: size 3, free [2]
    free = [2]
    s = np.zeros(4, dtype=np.intp)
    block = np.zeros(4, dtype=np.uint64)
    need = _native.fill_new(index, [9, 8, 9, 7], s, block, free, 3)  # 3 new: slot 2, then 3, 4
    assert need == -5 and len(index) == 0 and free == [2] and not block.any() and not s.any()
    block = np.zeros(5, dtype=np.uint64)
    assert _native.fill_new(index, [9, 8, 9, 7], s, block, free, 3) == 5
    assert s.tolist() == [2, 3, 2, 4] and free == [] and block.tolist() == [0, 0, 9, 8, 7]
    assert index.find_seq([7, 8, 9, 6], 4).tolist() == [4, 3, 2, 0]


@settings(max_examples=examples(200), deadline=None)
@given(indexed(), st.data())
def test_picked_slots_is_find_seq(x, data):
    """``picked_slots`` (a ``KvEvicted``'s slots taken from the eviction order that chose its
    blocks) answers what ``find_seq`` answers for any list: the order's blocks in order with gaps
    (more than PICK_AHEAD = 64 too), repeats, unknown and non-uint64 hashes between."""
    index, keys, blocks, _ = x
    order = np.array(data.draw(st.permutations(keys)), dtype=np.uint64)
    order_s = index.find_seq(order.tolist(), len(order))
    picked = [b for b in order.tolist() if data.draw(st.booleans())]
    mixed = data.draw(st.sampled_from([picked, blocks, picked + blocks, blocks[:5] + picked, picked[::-1]]))
    got = _native.picked_slots(index, mixed, order, order_s)
    assert got.dtype == np.intp and got.tolist() == index.find_seq(mixed, len(mixed)).tolist()
    # a long order: a victim more than 64 entries after the last match is probed
    long_keys = list(range(1, 300))
    big = _native.SlotMap()
    big.insert(np.array(long_keys, dtype=np.uint64), np.arange(1, 300, dtype=np.intp))
    big_order = np.array(long_keys, dtype=np.uint64)
    sel = [1, 2, 200, 3, 299, 150, 2**64, -1, True]
    assert _native.picked_slots(big, sel, big_order, big.find_seq(long_keys)).tolist() == big.find_seq(sel).tolist()
    with pytest.raises(ValueError):
        _native.picked_slots(index, mixed, order, order_s[:-1] if len(order_s) else np.ones(1, np.intp))


def test_the_directorys_conversion_at_each_digit_boundary():
    """The shared conversion (``u64_of`` / ``as_u64`` in _native.pxd: an exact int's 30-bit digits
    read in place) as the directory's tables use it: every size of int, each side of 2**64,
    negatives, bools, numpy integers and int subclasses mean what a set of the hashes says, and
    ``concat_u64`` refuses what is no uint64 hash."""
    class Sub(int):
        pass

    edges = [0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**63, 2**64 - 1, 2**60 + 7, 2**34 + 5]
    outside = [2**64, 2**64 + 1, 2**90, 2**200, -1, -(2**30), -(2**64 - 1), 1.0, "x", None]
    held = set(edges)
    store = _native.BlockSet()
    store.update(edges)
    index = _native.SlotMap()
    index.insert(np.array(edges, dtype=np.uint64), np.arange(1, len(edges) + 1, dtype=np.intp))
    probes = edges + outside + [True, False, np.uint64(2**63), np.int64(5), np.int64(-1), Sub(2**63), Sub(-3)]
    for b in probes:
        want = isinstance(b, (int, np.integer)) and b in held
        assert (b in store) is want, b
        got = index.find_seq([b], 1)[0]
        assert (got == edges.index(int(b)) + 1) if want else got == 0, b
    ints = [b for b in probes if isinstance(b, (int, np.integer)) and 0 <= b < 2**64]
    assert _native.concat_u64([ints], len(ints)).tolist() == [int(b) for b in ints]
    for bad in (2**64, -1, 2**200, "x"):
        with pytest.raises(OverflowError):
            _native.concat_u64([[bad]], 1)
