"""Hypothesis: the block table's two routes to a slot agree. Long lists are probed in a
vectorised copy of the index that is brought up to date lazily (keys changed since its last
update are read from the dict); short ones in the dict. After any mix of allocations (short
and long lists, repeated keys) and frees, a long probe answers exactly what the dict holds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.cores.directory.table import _VECTOR, _VSYNC, BlockTable

KEY = st.integers(min_value=0, max_value=3000)
PROBE = list(range(0, 3001, 2))  # 1,501 keys: the vectorised route
assert len(PROBE) >= _VECTOR


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.one_of(st.lists(KEY, max_size=40), st.lists(KEY, min_size=300, max_size=900))),
                max_size=14))
def test_long_probes_answer_what_the_dict_holds(ops):
    t = BlockTable()
    for alloc, keys in ops:
        if alloc:
            s = t.ensure(keys)
            assert s.tolist() == [t.index[k] for k in keys]
        else:  # allocated, unheld, unreferenced slots are freed at once
            t.release(t.slots(keys, len(keys)))
            assert not any(k in t.index for k in keys)
        assert t.slots(PROBE, len(PROBE)).tolist() == [t.index.get(k, 0) for k in PROBE]
    assert len(t._vpend) <= _VSYNC  # folded in bulk once past the threshold
