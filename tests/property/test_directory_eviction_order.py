"""The incrementally kept eviction order (``CopyOrder`` buckets by count class and last access,
block order within) equals its sorted definition after any interleaving of stores, reads,
touches, moves, count changes (routes, branch ends, role switches), evictions, node removals,
slot reuse and out-of-order timestamps: ``CountAwareEviction`` by ``(count > 0, last_access,
block)``, ``LruEviction`` by ``(last_access, block)``, pinned blocks left out, any prefix."""

from __future__ import annotations

import numpy as np
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
from services.cores.directory import CountAwareEviction, DirectoryCore, LruEviction, table
from tests.hyp import examples

NODES = ["p0", "p1", "d0"]
node = st.sampled_from(NODES)
tier = st.sampled_from(["L1", "L2"])
ts = st.sampled_from([0.0, 1.0, 1.0, 2.0, 3.5, 7.0])  # ties and timestamps going backwards
blocks = st.lists(st.integers(1, 24), min_size=1, max_size=8)
STORE = st.tuples(st.just("store"), node, tier, blocks, ts)
OP_LIST = (
    STORE,
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
OPS = st.one_of(*OP_LIST)
POLICIES = (CountAwareEviction(block_tokens=1), LruEviction(block_tokens=1))


def compare(d: DirectoryCore, n: str, t: str, k: int, pinned: frozenset) -> None:
    for p in POLICIES:
        want = p.sorted_order(d, n, t, pinned).tolist()
        assert p.order(d, n, t, pinned) == want, (p.name, n, t)
        assert p.choose(d, n, t, k, pinned) == want[:k], (p.name, n, t, k)
        counts = BlockCounts()  # the pool's pins (engine/kvpool.py): probed as uint64, same answer
        counts.add(sorted(pinned))
        assert p.choose(d, n, t, k, counts) == want[:k], (p.name, n, t, k)


def _apply_op(d: DirectoryCore, op: tuple, reqs: int) -> int:
    """Fold one directory operation of ``OP_LIST`` into ``d``; returns the requests submitted so far."""
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
        raise ValueError(f"not a directory operation: {op!r}")
    return reqs


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
        if op[0] == "check":
            _, n, t, k, pins = op
            compare(d, n, t, k, frozenset(pins))
        else:
            reqs = _apply_op(d, op, reqs)
    for n in NODES:
        for t in ("L1", "L2"):
            compare(d, n, t, 5, frozenset())
    restored = DirectoryCore.from_snapshot(d.snapshot())
    for n in NODES:
        for t in ("L1", "L2"):
            compare(restored, n, t, 4, frozenset({3, 5}))


PIN = st.tuples(st.just("pin"), node, st.integers(0, 3), st.lists(st.integers(1, 24), max_size=10))
UNPIN = st.tuples(st.just("unpin"), node, st.integers(0, 3))
PIN_OPS = st.one_of(  # stores, pins and unpins twice as likely: appends to a remembered bucket, releases
    *OP_LIST,
    STORE, PIN, PIN, UNPIN, UNPIN,
    st.tuples(st.just("evictpins"), node, tier, st.integers(0, 30), st.lists(st.integers(1, 24), max_size=4)),
)


@settings(max_examples=examples(500), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(PIN_OPS, min_size=1, max_size=80))
def test_remembered_buckets_under_changing_pins_equal_the_sorted_definition(ops):
    """The order read under one long-lived pin multiset per node, as a node's KV pool passes it
    (its buckets remembered between reads, the pins' release log replayed), equals the sorted
    definition after any interleaving of pins, unpins, ``also_pinned`` counted for one call,
    and the directory's own updates."""
    d = DirectoryCore()
    for n in NODES:
        d.apply(NodeRegistered(ts=0.0, node=n, role="decode" if n.startswith("d") else "prefill"))
    counts = {n: BlockCounts() for n in NODES}
    for c in counts.values():  # never empty (an empty pin set reads as none: nothing remembered)
        c.add([99])
    owners: dict[tuple[str, int], list[int]] = {}
    reqs = 0

    def check(n: str, t: str, k: int, extra: list[int]) -> None:
        c = counts[n]
        add = [b for b in dict.fromkeys(extra) if b not in c]
        c.add(add)  # what KvPool.make_room does with also_pinned
        try:
            pinned = frozenset(c)
            for p in POLICIES:
                want = p.sorted_order(d, n, t, pinned).tolist()
                assert p.choose(d, n, t, k, c) == want[:k], (p.name, n, t, k)
                assert p.order(d, n, t, c) == want, (p.name, n, t)
        finally:
            c.remove(add)

    for op in ops:
        kind = op[0]
        if kind == "pin":
            _, n, o, blks = op
            old = owners.get((n, o))
            counts[n].add(blks)
            if old is not None:
                counts[n].remove(old)
            owners[(n, o)] = blks
        elif kind == "unpin":
            old = owners.pop((op[1], op[2]), None)
            if old is not None:
                counts[op[1]].remove(old)
        elif kind in ("evictpins", "check"):
            check(op[1], op[2], op[3], op[4])
        else:
            reqs = _apply_op(d, op, reqs)
    for n in NODES:
        for t in ("L1", "L2"):
            check(n, t, 5, [])
            # another pin set (or none) for the same column: nothing remembered is reused
            for p in POLICIES:
                assert p.order(d, n, t, frozenset({3})) == p.sorted_order(d, n, t, frozenset({3})).tolist()
            check(n, t, 7, [2])


def test_a_block_unpinned_after_a_read_comes_back():
    d = DirectoryCore()
    d.apply(NodeRegistered(ts=0.0, node="p0", role="prefill"))
    d.apply(KvStored(ts=1.0, node="p0", tier="L1", blocks=[1, 2, 3]))
    c, p = BlockCounts(), CountAwareEviction(block_tokens=1)
    c.add([1, 2])
    assert p.choose(d, "p0", "L1", 3, c) == [3]
    c.remove([1, 2])
    c.add([9])  # not empty: the remembered bucket is read again, with 1 and 2 from the release log
    assert p.choose(d, "p0", "L1", 3, c) == [1, 2, 3]


def test_release_log_names_each_key_whose_count_falls_to_zero():
    c = BlockCounts()
    epoch, pos, keys = c.released_since(-1, 0)
    assert keys is None and pos == 0
    c.add([5, 5, 7, 9])
    c.remove([5, 7])  # 5 still counted once
    epoch2, pos2, keys = c.released_since(epoch, pos)
    assert epoch2 == epoch and keys.tolist() == [7] and pos2 == pos + 1
    c.remove([5, 9])
    c.add([7])
    c.remove([7])
    _, pos3, keys = c.released_since(epoch2, pos2)
    assert keys.tolist() == [5, 9, 7] and pos3 == pos2 + 3
    assert c.released_since(epoch2 + 1, pos3)[2] is None  # a position of another epoch: start afresh


VICTIMS = st.tuples(st.just("victims"), node, tier, st.integers(1, 12), st.booleans(),
                    st.lists(st.integers(0, 2), max_size=12), st.lists(st.integers(1, 30), max_size=3), ts)
# orders read and their victims evicted (and stores to evict), among the directory's own updates
VICTIM_OPS = st.one_of(*OP_LIST, STORE, STORE, VICTIMS, VICTIMS, VICTIMS)


def _copies(d: DirectoryCore) -> list:
    """Every copy of every node and tier: ``(node, tier, block, last access, count)``, sorted."""
    out = []
    for n in NODES:
        for t in ("L1", "L2"):
            b, last, refs = d.tier_arrays(n, t)
            out += [(n, t, *x) for x in zip(b.tolist(), last.tolist(), refs.tolist())]
    return sorted(out)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(VICTIM_OPS, min_size=1, max_size=60))
def test_victims_of_an_order_evict_as_any_blocks_do(ops):
    """A ``KvEvicted`` of the blocks an eviction order just gave takes their slots from the order
    (BlockTable.evict, ``picked_slots``): the victims kept in order with some left out (a pool's
    held / unpinned filter), blocks the order did not give added, other events between, slots
    freed since: the directory ends where one that never read an order ends, anomalies too."""
    d, twin = DirectoryCore(), DirectoryCore()
    for x in (d, twin):
        for n in NODES:
            x.apply(NodeRegistered(ts=0.0, node=n, role="decode" if n.startswith("d") else "prefill"))
    reqs = 0
    for op in ops:
        if op[0] == "victims":
            _, n, t, k, aware, keep, extra, t_ev = op
            chosen = (POLICIES[0] if aware else POLICIES[1]).choose(d, n, t, k, BlockCounts())
            # keep: 0 drops the block, 1 keeps it, 2 keeps it and puts an unknown one after it
            victims = []
            for i, b in enumerate(chosen):
                how = keep[i] if i < len(keep) else 1
                if how:
                    victims.append(b)
                if how == 2:
                    victims.append(10**6 + i)
            ev = KvEvicted(ts=t_ev, node=n, tier=t, blocks=victims + extra)
            assert d.apply(ev) == twin.apply(ev)
        elif op[0] == "check":  # an order read, no eviction of it: the next one reads another
            POLICIES[0].choose(d, op[1], op[2], op[3], frozenset(op[4]))
        else:
            _apply_op(d, op, reqs)
            reqs = _apply_op(twin, op, reqs)
    assert _copies(d) == _copies(twin)
    assert d.anomalies() == twin.anomalies()
    assert twin._t._picked == {}  # the twin never read an order: every eviction was probed


@settings(max_examples=examples(200), deadline=None)
@given(st.data())
def test_a_groups_first_k_blocks_are_its_sorted_first_k(data):
    """The walk sorts a group's blocks (distinct hashes) whole, or only its ``k`` smallest when
    the walk's limit cuts it: either way the head of a full sort's positions, at least ``k`` of
    them."""
    n = data.draw(st.sampled_from([1, 2, 5, 40, 300, 3000]))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    blocks = np.unique(rng.integers(0, 2**64, n + 8, dtype=np.uint64))[:n]
    rng.shuffle(blocks)
    k = data.draw(st.integers(0, len(blocks)))
    by = table._by_block(blocks, k)
    want = np.argsort(blocks)
    assert len(by) >= k and by.tolist() == want[:len(by)].tolist()  # the sorted order's head, at least k
