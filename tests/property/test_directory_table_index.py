"""Hypothesis: the block table's slots follow a dict model of ``block -> slot`` through any mix
of allocations (short and long lists, repeated keys), lookups and frees: every allocated block
has one slot of its own, an unknown or freed block resolves to 0, a freed slot is reused, and
new blocks are allocated in the order the fold relies on (first occurrence when up to 64 positions
of a list are unknown, sorted by hash above), which keeps the pinned simulator digests in place."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.cores.directory.table import BlockTable
from tests.hyp import examples

KEY = st.integers(min_value=0, max_value=3000)
PROBE = list(range(0, 3001, 2))


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.one_of(st.lists(KEY, max_size=40), st.lists(KEY, min_size=300, max_size=900))),
                max_size=14))
def test_slots_follow_a_dict_model(ops):
    t = BlockTable()
    model: dict[int, int] = {}
    for alloc, keys in ops:
        if alloc:
            free_before, size_before = list(t.free), t.size
            s = t.ensure(keys).tolist()
            new = [k for k in dict.fromkeys(keys) if k not in model]
            if sum(k not in model for k in keys) > 64:  # more than 64 unknown positions: by hash
                new = sorted(new)
            reused = free_before[len(free_before) - min(len(new), len(free_before)):]
            expect = reused + list(range(size_before, size_before + len(new) - len(reused)))
            model.update(zip(new, expect))
            assert s == [model[k] for k in keys]
        else:  # allocated, unheld, unreferenced slots are freed at once
            t.release(t.slots(keys, len(keys)))
            for k in keys:
                model.pop(k, None)
            assert all(t.find(k) is None for k in keys)
        assert len(set(model.values())) == len(model) and 0 not in model.values()
        assert t.slots(PROBE, len(PROBE)).tolist() == [model.get(k, 0) for k in PROBE]
        assert len(t.index) == len(model)


@settings(max_examples=examples(80), deadline=None)
@given(st.lists(KEY, max_size=80), st.lists(KEY, max_size=80), st.lists(KEY, max_size=80))
def test_ensure_of_a_stale_probe_equals_a_fresh_one(seed, between, keys):
    """``ensure(keys, s)`` with ``s`` probed before other blocks were allocated (the fold's
    cached slots, exact while no slot is freed; the compiled pass re-probes each 0)
    gives what a fresh ``ensure(keys)`` gives, and leaves the same table behind (free slots
    reused in the same order)."""
    a, b = BlockTable(), BlockTable()
    for t in (a, b):
        t.ensure(seed)
        t.release(t.slots(seed[::3], len(seed[::3])))
    stale = a.slots(keys, len(keys))
    for t in (a, b):
        t.ensure(between)
    assert a.ensure(keys, stale).tolist() == b.ensure(keys).tolist()
    assert (a.size, a.free) == (b.size, b.free)
    assert a.slots(PROBE, len(PROBE)).tolist() == b.slots(PROBE, len(PROBE)).tolist()


def test_a_hash_outside_64_bits_allocates_nothing():
    t = BlockTable()
    t.ensure([1, 2])
    for bad in ([3, 2**64], [3, -1]):
        try:
            t.ensure(bad)
        except OverflowError:
            pass
        else:
            raise AssertionError(f"{bad} was allocated")
        assert (t.size, len(t.index), t.find(3)) == (3, 2, None)
