"""The pool's compiled scans (engine/_kvscan.pyx) give the same answers against its typed tables
(a tier is a ``BlockSet``, the pins a ``BlockCounts``, probed with the uint64 hashes)
as against Python sets holding the same hashes: on random block lists with repeats and with
entries that are no uint64 hash (negative, too large: in no table, as in no set of hashes). The
typed scans convert and probe in chunks of 64 blocks: lists cross the chunk edges."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from services.cores.directory._native import BlockCounts, BlockSet

from engine import _kvscan
from tests.hyp import examples

HASHES = st.integers(0, 30) | st.sampled_from([2**64 - 1, 2**63 + 5, 1 << 40])
ENTRIES = HASHES | st.sampled_from([-1, -(2**70), 2**64, 2**80])


def _tables(held: list[int], pins: list[int]) -> tuple[BlockSet, BlockCounts]:
    store, counts = BlockSet(), BlockCounts()
    store.update(held)
    counts.add(pins)
    counts.add(pins[: len(pins) // 2])  # counts above 1 are still "pinned"
    return store, counts


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(ENTRIES, max_size=200), st.lists(HASHES, max_size=40), st.lists(HASHES, max_size=20),
       st.integers(-2, 150))
def test_scans_against_blockset_and_blockcounts_match_sets(blocks, held, pins, start):
    store, counts = _tables(held, pins)
    s_held, s_pins = set(held), set(pins)
    for seq in (blocks, tuple(blocks)):
        assert _kvscan.prefix_len(seq, start, store) == _kvscan.prefix_len(seq, start, s_held)
        assert _kvscan.missing_after(seq, start, store) == _kvscan.missing_after(seq, start, s_held)
        assert _kvscan.missing_after(seq, start, counts) == _kvscan.missing_after(seq, start, s_pins)
        want = _kvscan.held_unpinned(seq, s_held, s_pins)
        assert _kvscan.held_unpinned(seq, store, counts) == want
        assert _kvscan.held_unpinned(seq, store, s_pins) == want  # a tier with a set of pins
        pin_set = BlockSet()
        pin_set.update(pins)
        assert _kvscan.held_unpinned(seq, store, pin_set) == want
    # the set answers themselves, spelled out (so that a wrong reference cannot hide a bug)
    st_ = max(start, 0)
    k = next((i for i in range(st_, len(blocks)) if blocks[i] not in s_held), max(st_, len(blocks)))
    assert _kvscan.prefix_len(blocks, start, store) == k
    assert _kvscan.missing_after(blocks, start, store) == list(dict.fromkeys(b for b in blocks[st_:]
                                                                            if b not in s_held))
    assert _kvscan.held_unpinned(blocks, store, counts) == [b for b in blocks if b in s_held and b not in s_pins]


def test_scans_keep_the_callers_objects_in_order():
    store, counts = _tables([1, 2, 3], [2])
    big = 2**64 - 1
    out = _kvscan.missing_after([5, big, 5, -1, -1, 1], 0, store)
    assert out == [5, big, -1] and out[1] is not None
    assert _kvscan.held_unpinned([3, 2, 1, 3], store, counts) == [3, 1, 3]  # repeats kept, as before
    assert _kvscan.prefix_len([1, 2, 3], 5, store) == 5  # a start past the end is returned


def test_a_held_run_ends_where_it_ends_across_chunk_edges():
    blocks = list(range(1 << 40, (1 << 40) + 300))
    store = BlockSet()
    store.update(blocks)
    for end in (0, 1, 63, 64, 65, 127, 128, 129, 200, 299):
        for gap in (blocks[end] + 10**6, -1, 2**64):  # a block not held, a negative, a too-large one
            seq = blocks[:end] + [gap] + blocks[end + 1:]
            for start in (0, end - 1, end, end + 1):
                s = set(blocks) - {blocks[end]}
                assert _kvscan.prefix_len(seq, start, store) == _kvscan.prefix_len(seq, start, s), (end, gap, start)
            assert _kvscan.missing_after(seq, 0, store) == [gap]
            assert _kvscan.held_unpinned(seq, store, BlockCounts()) == blocks[:end] + blocks[end + 1:]
    assert _kvscan.prefix_len(blocks, 0, store) == 300 and _kvscan.prefix_len(blocks, 64, store) == 300


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(ENTRIES, max_size=120), st.lists(ENTRIES, max_size=120))
def test_meets_is_a_set_intersection_test(a, b):
    want = not set(a).isdisjoint(b)
    for x, y in ((a, b), (tuple(a), b), (a, tuple(b))):
        assert _kvscan.meets(x, y) is want
    assert _kvscan.meets(b, a) is want


def test_meets_on_lists_of_other_objects_asks_python_sets():
    assert _kvscan.meets(["x", 3], [3]) is True
    assert _kvscan.meets(["x", 3], ["y", 4]) is False
    assert _kvscan.meets([1, 2], []) is False and _kvscan.meets([], [1]) is False


def test_ints_at_each_digit_boundary_convert_as_the_hashes_they_are():
    """The scans read an exact int's 30-bit digits themselves: every size of int, each side of
    the 2**64 edge, negatives, bools and numpy integers mean what a set of the hashes says."""
    import numpy as np

    edges = [0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**63, 2**64 - 1]
    outside = [2**64, 2**64 + 1, 2**90, 2**200, -1, -(2**30), -(2**64 - 1)]
    store = BlockSet()
    store.update(edges)
    s_held = set(edges)
    probes = edges + outside + [True, np.uint64(2**63), np.int64(5), 2**60 + 7]
    for b in probes:
        want = b in s_held  # True is 1, a numpy integer its value
        assert (_kvscan.prefix_len([b], 0, store) == 1) is want, b
        assert _kvscan.held_unpinned([b], store, set()) == ([b] if want else []), b
        assert _kvscan.meets(edges, [b]) is want, b
    assert _kvscan.missing_after(probes, 0, store) == [b for b in probes if b not in s_held]
