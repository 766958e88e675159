"""The figures' ideal reuse (replay/sim/figures.py ``_Fold.submitted_ev``): the run of a prompt's
blocks submitted before, by any branch. The fold starts a prompt's probe where it leaves its
branch's last prompt; the answer is the walk from the first block, whatever the branches
submit, shorten, rewrite or end."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from events.catalog import BranchEnded, RequestSubmitted
from replay.sim.figures import MetricsFold
from tests.hyp import examples

BLOCKS = st.lists(st.integers(0, 40), max_size=30)
STEP = st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["extend", "new", "cut", "end"]), BLOCKS,
                 st.integers(0, 30))


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(STEP, max_size=40))
def test_ideal_is_the_run_of_blocks_submitted_before(steps):
    fold = MetricsFold(0.0, 1e9)
    last: dict[str, list[int]] = {}
    seen: set[int] = set()
    want: dict[str, int] = {}
    for i, (branch, how, blocks, cut) in enumerate(steps):
        ts = float(i)
        if how == "end":
            fold(BranchEnded(ts=ts, src="t", branch=branch))
            last.pop(branch, None)
            continue
        prev = last.get(branch, [])
        blocks = {"extend": prev + blocks, "new": blocks, "cut": prev[:cut]}[how]
        n = 0
        while n < len(blocks) and blocks[n] in seen:
            n += 1
        seen.update(blocks)
        rid = f"r{i}"
        want[rid] = min(n * 64, max(0, 64 * len(blocks) + 10 - 1))
        fold(RequestSubmitted(ts=ts, src="t", request=rid, branch=branch, blocks=blocks,
                              prompt_tokens=64 * len(blocks) + 10))
        last[branch] = blocks
    assert {r: s[2] for r, s in fold.state.sub.items()} == want
