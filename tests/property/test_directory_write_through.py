"""One write-through ``KvStored`` folds exactly as the pair it replaces.

Producers before schema 1.1 sent ``KvStored`` L1 then ``KvStored`` L2 with the same ``ts``,
blocks, request and branch; now they send one ``KvStored(tier="L1", write_through=True)``.
After any interleaving of stores (with and without a request or a branch, on unknown nodes,
for unknown requests), evictions, routes, moves, branch ends, role switches and node removals,
the directory that folded the merged events equals the one that folded the pairs: its snapshot
byte for byte, the anomalies each step returned, every block's slot, the eviction order of
every copy column (both policies) and a lookup of every prompt."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.catalog import (
    BranchEnded,
    BranchOpened,
    Event,
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
from tests.hyp import examples

NODES = ["p0", "p1", "d0"]
node = st.sampled_from(NODES + ["x9"])  # x9 never registers: the store is an anomaly, the node added
tier = st.sampled_from(["L1", "L2"])
ts = st.sampled_from([0.0, 1.0, 1.0, 2.0, 3.5, 7.0])  # ties and timestamps going backwards
blocks = st.lists(st.integers(1, 24), min_size=0, max_size=8)
OPS = st.one_of(
    # write-through store: request index (None: no request; past the last request: unknown), branch
    st.tuples(st.just("through"), node, blocks, ts, st.none() | st.integers(0, 8), st.none() | st.integers(0, 3)),
    st.tuples(st.just("store"), node, tier, blocks, ts),
    st.tuples(st.just("evict"), node, tier, blocks, ts),
    st.tuples(st.just("request"), st.integers(0, 3), blocks, node, node, ts),
    st.tuples(st.just("start"), st.integers(0, 30), node, ts),
    st.tuples(st.just("move"), node, node, blocks, ts),
    st.tuples(st.just("end"), st.integers(0, 3), ts),
    st.tuples(st.just("switch"), node, st.sampled_from(["prefill", "decode"]), ts),
    st.tuples(st.just("remove"), node, ts),
    st.tuples(st.just("register"), node, ts),
)
POLICIES = (CountAwareEviction(block_tokens=1), LruEviction(block_tokens=1))


def _stream(ops) -> tuple[list[list[Event]], list[list[Event]]]:
    """The same history twice, step by step: with the pairs (what old logs hold) and merged."""
    pairs: list[list[Event]] = []
    merged: list[list[Event]] = []
    reqs = 0
    for op in ops:
        kind = op[0]
        if kind == "through":
            _, n, blks, t, ri, bi = op
            rid = None if ri is None else f"r{ri}"
            br = None if bi is None else f"b{bi}"
            pairs.append([KvStored(ts=t, node=n, tier="L1", blocks=blks, request=rid, branch=br),
                          KvStored(ts=t, node=n, tier="L2", blocks=list(blks), request=rid, branch=br)])
            merged.append([KvStored(ts=t, node=n, tier="L1", blocks=blks, request=rid, branch=br,
                                    write_through=True)])
            continue
        if kind == "store":
            step = [KvStored(ts=op[4], node=op[1], tier=op[2], blocks=op[3])]
        elif kind == "evict":
            step = [KvEvicted(ts=op[4], node=op[1], tier=op[2], blocks=op[3])]
        elif kind == "request":
            _, b, blks, p, dn, t = op
            rid = f"r{reqs}"
            reqs += 1
            step = [BranchOpened(ts=t, branch=f"b{b}"),
                    RequestSubmitted(ts=t, request=rid, branch=f"b{b}", blocks=blks, version=reqs),
                    RouteDecided(ts=t, request=rid, prefill_node=p, decode_node=dn)]
        elif kind == "start":
            step = [RequestStarted(ts=op[3], request=f"r{op[1] % max(1, reqs)}", node=op[2], phase="prefill")]
        elif kind == "move":
            step = [KvMoved(ts=op[4], src_node=op[1], dst_node=op[2], blocks=op[3])]
        elif kind == "end":
            step = [BranchEnded(ts=op[2], branch=f"b{op[1]}")]
        elif kind == "switch":
            step = [RoleSwitched(ts=op[3], node=op[1], role=op[2])]
        elif kind == "remove":
            step = [NodeRemoved(ts=op[2], node=op[1])]
        else:
            step = [NodeRegistered(ts=op[2], node=op[1], role="prefill")]
        pairs.append(step)
        merged.append(step)
    return pairs, merged


def _fold(steps: list[list[Event]]) -> tuple[DirectoryCore, list]:
    d = DirectoryCore()
    for n in NODES:
        d.apply(NodeRegistered(ts=0.0, node=n, role="decode" if n.startswith("d") else "prefill"))
    for n in NODES:  # track every column's eviction order from the start (its update paths run too)
        for t in ("L1", "L2"):
            POLICIES[0].order(d, n, t, frozenset())
    out = []
    for step in steps:
        out.append([a for ev in step for a in d.apply(ev)])
    return d, out


def _state(d: DirectoryCore, prompts: list[list[int]]) -> tuple:
    orders = tuple(p.order(d, n, t, frozenset()) for p in POLICIES for n in d.nodes() for t in ("L1", "L2"))
    slots = tuple(d._t.find(b) for b in range(1, 25))  # allocation order: same slot for every block
    looks = []
    for b in prompts:
        lk = d.lookup(b)
        looks.append((lk.pool_blocks, sorted(lk.per_node.items()), [lk.fetch_plan(n) for n in sorted(lk.per_node)]))
    return d.snapshot(), orders, slots, tuple(map(repr, looks)), d.anomalies()


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=1, max_size=50))
def test_a_write_through_store_folds_as_the_l1_then_l2_pair(ops):
    pairs, merged = _stream(ops)
    a, out_a = _fold(pairs)
    b, out_b = _fold(merged)
    assert out_a == out_b  # the anomalies, step by step
    prompts = [list(range(1, 25)), [3, 1, 4, 1, 5, 9, 2, 6]] + [op[2] for op in ops if op[0] == "request"]
    assert _state(a, prompts) == _state(b, prompts)


def test_the_merged_event_lands_in_both_tiers_with_the_holders_of_its_request():
    """A fixed case: the L2 copy exists, last access is the event's, the branch's prefill count
    sits on the node; and without ``write_through`` only L1 is written (the check can fail)."""
    d = DirectoryCore()
    d.apply(NodeRegistered(ts=0.0, node="p0", role="prefill"))
    d.apply(NodeRegistered(ts=0.0, node="d0", role="decode"))
    d.apply(BranchOpened(ts=0.0, branch="b"))
    d.apply(RequestSubmitted(ts=0.0, request="r", branch="b", blocks=[1, 2, 3]))
    d.apply(RouteDecided(ts=0.0, request="r", prefill_node="p0", decode_node="d0"))
    assert d.apply(KvStored(ts=2.5, node="p0", tier="L1", blocks=[1, 2, 3], request="r", write_through=True)) == []
    assert d.copies("p0", "L1") == d.copies("p0", "L2") == {1: 2.5, 2: 2.5, 3: 2.5}
    assert d.lookup([1, 2, 3]).per_node["p0"].local_blocks == 3
    single = DirectoryCore()
    single.apply(NodeRegistered(ts=0.0, node="p0", role="prefill"))
    single.apply(KvStored(ts=2.5, node="p0", tier="L1", blocks=[1, 2]))
    assert single.copies("p0", "L2") == {}
    # ignored with tier L2: the blocks land in L2 only
    single.apply(KvStored(ts=3.0, node="p0", tier="L2", blocks=[7], write_through=True))
    assert single.copies("p0", "L1") == {1: 2.5, 2: 2.5} and single.copies("p0", "L2") == {7: 3.0}
