"""The figures' demand fold (distinct blocks of the active branches over time) on compiled
tables equals the set-and-dict fold it replaced, on any sequence of contexts and ends: the
same token count after each step, the same area and peak inside the window."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from replay.sim.figures import _Demand
from tests.hyp import examples


class _SetDemand(_Demand):
    """The previous fold: a Python set per branch and a dict of counts (the definition). The
    window's area and peak (``_advance``, ``tokens``, ``end``) are the class under test's: only
    the counting is redefined."""

    def __init__(self) -> None:
        super().__init__()
        self.branch: dict[str, set[int]] = {}
        self.refs: dict[int, int] = {}

    def set_context(self, branch: str, blocks, ts: float, warmup_s: float, end_s: float) -> None:
        self._advance(ts, warmup_s, end_s)
        old = self.branch.get(branch)
        refs = self.refs
        prev = self.ctx.get(branch)
        if old is not None and prev is not None and len(blocks) >= len(prev) and blocks[:len(prev)] == prev:
            added, removed = set(blocks[len(prev):]) - old, ()
            new = old
            new |= added
        else:
            new = set(blocks)
            if old is None:
                added, removed = new, ()
            else:
                added, removed = new - old, old - new
        for b in added:
            refs[b] = refs.get(b, 0) + 1
        for b in removed:
            n = refs[b] - 1
            if n:
                refs[b] = n
            else:
                del refs[b]
        self.branch[branch] = new
        self.ctx[branch] = blocks
        self._advance(ts, warmup_s, end_s)


BRANCH = st.sampled_from(["a", "b", "c"])
BLOCKS = st.lists(st.integers(0, 40) | st.sampled_from([2**64 - 1, 2**40 + 3]), max_size=12)
OP = st.one_of(
    st.tuples(st.just("set"), BRANCH, BLOCKS, st.booleans(), st.booleans()),  # extend the last one?, as a tuple?
    st.tuples(st.just("end"), BRANCH, st.none(), st.booleans(), st.booleans()),
)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(OP, max_size=40), st.floats(0, 5), st.floats(5, 20))
def test_compiled_demand_equals_the_set_fold(ops, warmup_s, end_s):
    got, want = _Demand(), _SetDemand()
    for i, (kind, branch, blocks, extend, as_tuple) in enumerate(ops):
        ts = 0.5 * i
        if kind == "end":
            got.end(branch, ts, warmup_s, end_s)
            want.end(branch, ts, warmup_s, end_s)
        else:
            if extend and branch in want.ctx:  # a continuation: the last context, then more blocks
                blocks = [*want.ctx[branch], *blocks]
            ctx = tuple(blocks) if as_tuple else blocks
            got.set_context(branch, ctx, ts, warmup_s, end_s)
            want.set_context(branch, ctx, ts, warmup_s, end_s)
        assert got.tokens() == want.tokens()
        assert {b: set(s) for b, s in got.branch.items()} == want.branch
    assert (got.area, got.peak) == (want.area, want.peak)
