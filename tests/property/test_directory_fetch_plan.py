"""The vectorised fetch plan equals its step-by-step definition on random holder layouts."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from events.catalog import FetchStep
from services.cores.directory.lookup import Lookup
from tests.hyp import examples

NODES = [f"n{i}" for i in range(5)]


def reference_plan(lk: Lookup, node: str, cols: dict[str, int] | None = None) -> list[FetchStep]:
    """METHOD-level definition: from each position, read from the peer whose copy (L2 first,
    L1 only where no peer has L2) covers the longest run, ties to the smallest id; skip
    positions no peer holds. ``cols``: node id -> column (default: ``NODES`` in order)."""
    cols = cols or dict(zip(NODES, range(len(NODES))))
    nodes = list(cols)
    own = cols[node]
    pos = lk.per_node[node].local_blocks
    steps = []

    def held(col: int, tier: int, b: int) -> bool:
        j = 2 * col + tier
        return bool((int(lk._masks[b, j // 64]) >> (j % 64)) & 1)

    while pos < lk.pool_blocks:
        found = None
        for tier, name in ((1, "L2"), (0, "L1")):
            best = None
            for nid in sorted(nodes):
                c = cols[nid]
                if c == own or not held(c, tier, pos):
                    continue
                end = pos
                while end < lk.pool_blocks and held(c, tier, end):
                    end += 1
                if best is None or end > best[0]:
                    best = (end, nid)
            if best is not None:
                found = (best[1], best[0], name)
                break
        if found is None:
            pos += 1
            continue
        src, end, tier = found
        steps.append(FetchStep(src_node=src, first_block=pos, n_blocks=end - pos, tier=tier))
        pos = end
    return steps


@settings(max_examples=examples(150), deadline=None)
@given(st.integers(min_value=1, max_value=40).flatmap(
    lambda n: st.lists(st.integers(min_value=0, max_value=(1 << (2 * len(NODES))) - 1), min_size=n, max_size=n)),
    st.sampled_from(NODES))
def test_fetch_plan_equals_the_step_by_step_definition(words, node):
    # every block held by someone (a pool prefix), as the directory guarantees
    words = [w or 0b10 for w in words]
    masks = np.array(words, dtype=np.uint64).reshape(-1, 1)
    lk = Lookup(len(words), len(words), masks, [(nid, i) for i, nid in enumerate(NODES)])
    assert lk.fetch_plan(node) == reference_plan(lk, node)


WIDE = [f"w{i:02d}" for i in range(40)]  # 80 copy bits: two words


@settings(max_examples=examples(100), deadline=None)
@given(st.integers(min_value=1, max_value=30).flatmap(
    lambda n: st.lists(st.sets(st.integers(min_value=0, max_value=79), max_size=6), min_size=n, max_size=n)),
    st.sampled_from(WIDE), st.permutations(range(len(WIDE))))
def test_fetch_plan_on_two_words_and_ids_out_of_column_order(bits, node, perm):
    # node ids not in column order (ties go to the smallest id, not the smallest column); some
    # blocks held by nobody but ``node`` or nobody at all inside the range
    cols = {nid: perm[i] for i, nid in enumerate(WIDE)}
    masks = np.zeros((len(bits), 2), dtype=np.uint64)
    for b, row in enumerate(bits):
        for j in row or {1}:
            masks[b, j // 64] |= np.uint64(1 << (j % 64))
    lk = Lookup(len(bits), len(bits), masks, list(cols.items()))
    assert lk.fetch_plan(node) == reference_plan(lk, node, cols)
