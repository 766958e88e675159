"""Hypothesis: the vectorised hash index behaves like a dict under inserts and deletes,
including colliding keys, tombstones and rebuilds."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.cores.directory.index import HashIndex

KEYS = st.one_of(st.integers(0, 40), st.integers(0, 2**64 - 1))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(KEYS, max_size=90)), max_size=25))
def test_index_matches_a_dict(ops):
    idx, model = HashIndex(capacity=4), {}
    nxt = 1
    for insert, keys in ops:
        if insert:
            new = sorted({k for k in keys if k not in model})
            vals = list(range(nxt, nxt + len(new)))
            nxt += len(new)
            idx.insert(np.array(new, dtype=np.uint64), np.array(vals, dtype=np.intp))
            model.update(zip(new, vals))
        else:
            idx.delete(np.array(keys, dtype=np.uint64))
            for k in keys:
                model.pop(k, None)
        probe = keys + list(model)[:20]
        got = idx.find(np.array(probe, dtype=np.uint64)).tolist()
        assert got == [model.get(k, 0) for k in probe]
        assert len(idx) == len(model)
        assert 2 * (idx.used + idx.deleted) <= len(idx.cells)
    k, v = idx.items()
    assert dict(zip(k.tolist(), v.tolist())) == model
