"""The incrementally kept eviction order (``CopyOrder`` buckets by count class and last access,
block order within) equals its sorted definition after any interleaving of stores, reads,
touches, moves, count changes (routes, branch ends, role switches), evictions, node removals,
slot reuse and out-of-order timestamps: ``CountAwareEviction`` by ``(count > 0, last_access,
block)``, ``LruEviction`` by ``(last_access, block)``, pinned blocks left out, any prefix."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from services.cores.directory._native import BlockCounts

from events.catalog import (
    BranchEnded,
    BranchOpened,
    KvEvicted,
    KvMoved,
    KvStored,
    NodeRegistered,
    NodeRemoved,
    RequestStarted,
    RequestSubmitted,
    RoleSwitched,
    RouteDecided,
)
from services.cores.directory import CountAwareEviction, DirectoryCore, LruEviction

NODES = ["p0", "p1", "d0"]
node = st.sampled_from(NODES)
tier = st.sampled_from(["L1", "L2"])
ts = st.sampled_from([0.0, 1.0, 1.0, 2.0, 3.5, 7.0])  # ties and timestamps going backwards
blocks = st.lists(st.integers(1, 24), min_size=1, max_size=8)
OPS = st.one_of(
    st.tuples(st.just("store"), node, tier, blocks, ts),
    st.tuples(st.just("evict"), node, tier, blocks, ts),
    st.tuples(st.just("request"), st.integers(0, 3), blocks, node, node, ts),
    st.tuples(st.just("start"), st.integers(0, 30), node, ts),
    st.tuples(st.just("move"), node, node, blocks, ts),
    st.tuples(st.just("end"), st.integers(0, 3), ts),
    st.tuples(st.just("switch"), node, st.sampled_from(["prefill", "decode"]), ts),
    st.tuples(st.just("remove"), node, ts),
    st.tuples(st.just("register"), node, ts),
    st.tuples(st.just("check"), node, tier, st.integers(0, 30), st.lists(st.integers(1, 24), max_size=4)),
)
POLICIES = (CountAwareEviction(block_tokens=1), LruEviction(block_tokens=1))


def compare(d: DirectoryCore, n: str, t: str, k: int, pinned: frozenset) -> None:
    for p in POLICIES:
        want = p.sorted_order(d, n, t, pinned).tolist()
        assert p.order(d, n, t, pinned) == want, (p.name, n, t)
        assert p.choose(d, n, t, k, pinned) == want[:k], (p.name, n, t, k)
        counts = BlockCounts()  # the pool's pins (engine/kvpool.py): probed as uint64, same answer
        counts.add(sorted(pinned))
        assert p.choose(d, n, t, k, counts) == want[:k], (p.name, n, t, k)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=1, max_size=60))
def test_incremental_order_equals_the_sorted_definition(ops):
    d = DirectoryCore()
    for n in NODES:
        d.apply(NodeRegistered(ts=0.0, node=n, role="decode" if n.startswith("d") else "prefill"))
    for n in NODES:  # track every column from the start, so every update path is exercised
        for t in ("L1", "L2"):
            compare(d, n, t, 3, frozenset())
    reqs = 0
    for op in ops:
        kind = op[0]
        if kind == "store":
            d.apply(KvStored(ts=op[4], node=op[1], tier=op[2], blocks=op[3]))
        elif kind == "evict":
            d.apply(KvEvicted(ts=op[4], node=op[1], tier=op[2], blocks=op[3]))
        elif kind == "request":
            _, b, blks, p, dn, t = op
            d.apply(BranchOpened(ts=t, branch=f"b{b}"))
            rid = f"r{reqs}"
            reqs += 1
            d.apply(RequestSubmitted(ts=t, request=rid, branch=f"b{b}", blocks=blks, version=reqs))
            d.apply(RouteDecided(ts=t, request=rid, prefill_node=p, decode_node=dn))
            d.apply(KvStored(ts=t, node=p, tier="L1", blocks=blks, request=rid))
        elif kind == "start":
            d.apply(RequestStarted(ts=op[3], request=f"r{op[1] % max(1, reqs)}", node=op[2], phase="prefill"))
        elif kind == "move":
            d.apply(KvMoved(ts=op[4], src_node=op[1], dst_node=op[2], blocks=op[3]))
        elif kind == "end":
            d.apply(BranchEnded(ts=op[2], branch=f"b{op[1]}"))
        elif kind == "switch":
            d.apply(RoleSwitched(ts=op[3], node=op[1], role=op[2]))
        elif kind == "remove":
            d.apply(NodeRemoved(ts=op[2], node=op[1]))
        elif kind == "register":
            d.apply(NodeRegistered(ts=op[2], node=op[1], role="prefill"))
        else:
            _, n, t, k, pins = op
            compare(d, n, t, k, frozenset(pins))
    for n in NODES:
        for t in ("L1", "L2"):
            compare(d, n, t, 5, frozenset())
    restored = DirectoryCore.from_snapshot(d.snapshot())
    for n in NODES:
        for t in ("L1", "L2"):
            compare(restored, n, t, 4, frozenset({3, 5}))
