"""Hypothesis: the cache-aware router's trees as one table (``RouteTrees``) answer what the dicts
they replaced answered (per block an owner mask, per worker block -> last routed time, per block
its depth): after any run of routes, evictions of the oldest and lost workers, the same matched
prefix per worker, the same tree sizes and blocks, the same snapshot rows, and a table rebuilt
from those rows is the same table."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.cores.router.cache_aware import RouteTrees
from tests.hyp import examples

WORKERS = 4
# a small pool of hashes (64-bit ones included) so that prompts share prefixes and blocks
POOL = st.sampled_from([1, 2, 3, 5, 8, 13, 2**40 + 7, 2**63 + 11, 2**64 - 1])
OPS = st.lists(st.one_of(
    st.tuples(st.just("route"), st.integers(0, WORKERS - 1), st.lists(POOL, max_size=7), st.integers(0, 5)),
    st.tuples(st.just("evict"), st.integers(0, 6)),
    st.tuples(st.just("lose"), st.integers(0, WORKERS - 1)),
    st.tuples(st.just("match"), st.lists(POOL, max_size=7), st.lists(st.integers(0, WORKERS - 1), unique=True)),
), max_size=30)


class DictTrees:
    """The router's former state, operation for operation (services/cores/router/cache_aware.py
    before the table)."""

    def __init__(self) -> None:
        self.owners: dict[int, int] = {}
        self.last: list[dict[int, float]] = [{} for _ in range(WORKERS)]
        self.depth: dict[int, int] = {}

    def insert(self, w: int, blocks, ts: float) -> None:
        for i, b in enumerate(blocks):
            self.owners[b] = self.owners.get(b, 0) | 1 << w
            self.last[w][b] = ts
            self.depth[b] = i

    def drop(self, w: int, blocks) -> None:
        keep = ~(1 << w)
        for b in blocks:
            self.last[w].pop(b, None)
            m = self.owners.get(b, 0) & keep
            if m:
                self.owners[b] = m
            else:
                self.owners.pop(b, None)
                self.depth.pop(b, None)

    def evict(self, cap: int) -> None:
        for w, last in enumerate(self.last):
            if len(last) > cap:
                order = sorted(last.items(), key=lambda kv: (kv[1], -self.depth.get(kv[0], 0), kv[0]))
                self.drop(w, [b for b, _ in order[: len(last) - cap]])

    def matched(self, blocks, workers) -> list[int]:
        alive = 0
        for w in workers:
            alive |= 1 << w
        out = dict.fromkeys(workers, 0)
        i = 0
        for b in blocks:
            m = self.owners.get(b, 0) & alive
            if m != alive:
                for w in workers:
                    if (alive & ~m) >> w & 1:
                        out[w] = i
                alive = m
                if not alive:
                    break
            i += 1
        for w in workers:
            if alive >> w & 1:
                out[w] = i
        return [out[w] for w in workers]

    def rows(self):
        return [(b, self.depth.get(b, 0), [self.last[i].get(b, -1.0) for i in range(WORKERS)])
                for b in sorted(self.owners)]


@settings(max_examples=examples(150), deadline=None)
@given(ops=OPS)
def test_the_table_answers_what_the_dicts_answered(ops):
    ref, t = DictTrees(), RouteTrees(capacity=4)  # a small table: growth is exercised
    for _ in range(WORKERS):
        t.add_worker()
    for k, op in enumerate(ops):
        if op[0] == "route":
            _, w, blocks, ts = op
            ref.insert(w, blocks, float(ts))
            t.insert(w, blocks, float(ts))
        elif op[0] == "evict":
            ref.evict(op[1])
            for w in range(WORKERS):
                if t.sizes[w] > op[1]:
                    t.drop(w, t.oldest(w, t.sizes[w] - op[1]))
        elif op[0] == "lose":
            ref.drop(op[1], list(ref.last[op[1]]))
            t.drop(op[1], t.held_by(op[1]))
        else:
            _, blocks, workers = op
            assert t.matched(blocks, workers) == ref.matched(blocks, workers), (k, op)
        assert t.sizes == [len(d) for d in ref.last], (k, op)
        assert [t.blocks_of(w) for w in range(WORKERS)] == [sorted(d) for d in ref.last]
        assert len(t) == len(ref.owners)
        # every slot handed out is held by a block or free again: freed slots are reused, not lost
        assert t.top - 1 == len(t) + len(t.free) and len(set(t.free)) == len(t.free), (k, op)
    assert t.rows() == ref.rows()
    again = RouteTrees.from_rows(WORKERS, t.rows())
    assert again.rows() == t.rows() and again.sizes == t.sizes
    probe = [b for b, _, _ in ref.rows()][:5]
    assert again.matched(probe, list(range(WORKERS))) == ref.matched(probe, list(range(WORKERS)))
