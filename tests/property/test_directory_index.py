"""Hypothesis: the directory's compiled block index (``_native.SlotMap``) behaves like a dict
under inserts, overwrites and deletes, including colliding keys, tombstones, growth and
rebuilds, and resolves lists of Python ints (also ones outside 64 bits) as ``dict.get`` would."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from services.cores.directory._native import SlotMap

from tests.hyp import examples

KEYS = st.one_of(st.integers(0, 40), st.integers(0, 2**64 - 1))
ODD = st.one_of(st.integers(-5, -1), st.integers(2**64, 2**70), st.just(1.5), st.just("b"), st.none())


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(KEYS, max_size=90)), max_size=25), st.lists(ODD, max_size=4))
def test_slot_map_matches_a_dict(ops, odd):
    idx, model = SlotMap(4), {}
    nxt = 1
    for insert, keys in ops:
        if insert:  # new keys and, for some, a new slot for a key already there
            new = sorted(set(keys))
            vals = list(range(nxt, nxt + len(new)))
            nxt += len(new)
            idx.insert(np.array(new, dtype=np.uint64), np.array(vals, dtype=np.intp))
            model.update(zip(new, vals))
        else:
            idx.delete(np.array(keys, dtype=np.uint64))
            for k in keys:
                model.pop(k, None)
        probe = keys + list(model)[:20]
        want = [model.get(k, 0) for k in probe]
        assert idx.find(np.array(probe, dtype=np.uint64)).tolist() == want
        assert idx.find_seq(probe, len(probe)).tolist() == want
        assert idx.find_seq(tuple(probe)).tolist() == want
        mixed = [*probe[:3], *odd]  # not a uint64: in no table (slot 0), as a dict of uint64 keys says
        assert idx.find_seq(mixed).tolist() == [model.get(k, 0) for k in probe[:3]] + [0] * len(odd)
        long = probe + odd + probe  # across find_seq's 64-block chunks, the odd ones anywhere in them
        assert idx.find_seq(long).tolist() == want + [0] * len(odd) + want
        assert [idx.get(k) for k in probe[:5]] == [model.get(k) for k in probe[:5]]
        assert len(idx) == len(model)
        used, deleted = idx.load
        assert used == len(model) and 2 * (used + deleted) <= idx.capacity
    k, v = idx.items()
    assert dict(zip(k.tolist(), v.tolist())) == model
    assert idx.find_seq(np.array(list(model), dtype=np.uint64)).tolist() == list(model.values())  # numpy ints


def test_slot_map_refuses_a_slot_below_one_and_a_length_mismatch():
    idx = SlotMap()
    for bad in (0, -1):
        try:
            idx.insert(np.array([7], dtype=np.uint64), np.array([bad], dtype=np.intp))
        except ValueError as exc:
            assert "not >= 1" in str(exc)
        else:
            raise AssertionError("a slot below 1 was accepted")
    assert len(idx) == 0 and idx.get(7) is None
    try:
        idx.find_seq([1, 2], 3)
    except ValueError as exc:
        assert "expected 3" in str(exc)
    else:
        raise AssertionError("a length mismatch was accepted")
