"""reblock: a session re-cut to another block size charges the same tokens and keeps every
prefix hit (hypothesis), for splits (512 -> 64) and merges (16 -> 64)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from replay.traces.format import Branch, Compact, End, Request, Session, reblock, validate_session
from tests.hyp import examples


def _common(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@st.composite
def sessions(draw):
    src = draw(st.sampled_from([16, 32, 64, 128, 512]))
    base = draw(st.lists(st.integers(1, 2**40), min_size=0, max_size=12, unique=True))
    reqs = []
    for _ in range(draw(st.integers(1, 6))):
        k = draw(st.integers(0, len(base)))
        extra = draw(st.lists(st.integers(2**41, 2**42), max_size=4, unique=True))
        reqs.append(Request(blocks=base[:k] + extra, tail_tokens=draw(st.integers(0, src - 1)),
                            output_tokens=1))
    steps = [*reqs[:-1], Compact(blocks=base[: len(base) // 2]), reqs[-1], End()]
    return Session(id="s", block_tokens=src, branches=[Branch(id="main", steps=steps)])


@settings(max_examples=examples(150), deadline=None)
@given(sessions(), st.sampled_from([16, 64, 128]))
def test_reblock_keeps_tokens_and_prefix_hits(s, dst):
    src = s.block_tokens
    if src % dst and dst % src:
        return
    r = reblock(s, dst)
    assert validate_session(r) == [] and r.block_tokens == dst
    a = [q for _b, _i, q in s.requests()]
    b = [q for _b, _i, q in r.requests()]
    for x, y in zip(a, b):  # every token is charged as the trace says
        assert len(x.blocks) * src + x.tail_tokens == len(y.blocks) * dst + y.tail_tokens
    for i in range(len(a)):
        for j in range(len(a)):
            hit_src = _common(a[i].blocks, a[j].blocks) * src
            hit_dst = _common(b[i].blocks, b[j].blocks) * dst
            if src >= dst:  # split: the same hit tokens exactly
                assert hit_dst == hit_src or (i == j)
            else:  # merge: hits rounded down to whole serving blocks, never invented
                assert hit_src - dst < hit_dst <= hit_src or i == j
    assert reblock(r, dst) is r
