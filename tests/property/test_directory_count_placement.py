"""Hypothesis: where counts sit when routes are not (yet) followed by KV, and what
count-aware eviction does with them.

Random interleavings of branch opens, submissions (each with its ``RouteDecided``), fetches,
prefill/decode starts, stores, P->D moves, evictions and branch ends, where a route is often
*not* followed by any KV event (the request is still queued) or is followed only partly.
A plain model applies the rules of docs/directory.md (a route attaches only a phase without a
holder; ``KvFetched`` moves the prefill count; ``RequestStarted`` moves its phase's count;
``KvStored`` with a request attaches the phases routed to the node; ``KvMoved`` P->D keeps the
prefill count and moves the decode count). After every step:

1. every copy's count equals the definition recomputed from scratch: the active branches whose
   counted context holds the block and that hold the copy's node in some phase, where a copy
   exists;
2. a ``RouteDecided`` never lowers a copy's count (routing moves no KV, so it un-counts nothing);
3. count-aware eviction never chooses a copy with a positive count while a copy with count 0
   on the same node and tier is evictable (not pinned), and chooses exactly the first blocks
   of the order ``(count > 0, last access, block)``.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.catalog import (
    BranchEnded,
    BranchOpened,
    KvEvicted,
    KvFetched,
    KvMoved,
    KvStored,
    NodeRegistered,
    RequestStarted,
    RequestSubmitted,
    RouteDecided,
)
from services.cores.directory import DirectoryCore
from services.cores.directory.eviction import CountAwareEviction
from tests.hyp import examples

ROLES = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode", "c0": "collocated"}
NODES = sorted(ROLES)
PREFILL_NODES = ["c0", "p0", "p1"]
DECODE_NODES = ["c0", "d0", "d1"]
UNIVERSE = range(1, 11)
TIERS = ("L1", "L2")


class Model:
    def __init__(self) -> None:
        self.branches: dict[str, dict] = {}  # name -> {"ctx", "holders": {phase: node}, "version"}
        self.ended: set[str] = set()
        self.requests: dict[str, tuple[str, list[int], str, str]] = {}  # rid -> branch, blocks, p, d
        self.held: set[tuple[int, str, str]] = set()

    def expected(self, block: int, node: str) -> int:
        if not any((block, node, t) in self.held for t in TIERS):
            return 0
        return sum(1 for b in self.branches.values()
                   if block in b["ctx"] and node in b["holders"].values())

    def counts(self) -> dict[tuple[int, str], int]:
        return {(x, n): self.expected(x, n) for x in UNIVERSE for n in NODES}

    def holder(self, rid: str, phase: str, node: str) -> None:
        b = self.branches.get(self.requests[rid][0])
        if b is not None:
            b["holders"][phase] = node


def all_counts(d: DirectoryCore) -> dict[tuple[int, str], int]:
    return {(x, n): d.count(x, n) for x in UNIVERSE for n in NODES}


def step(d: DirectoryCore, m: Model, op: tuple, ts: float) -> None:
    """Apply ``op`` to both; a route is checked on the spot (invariant 2)."""
    kind = op[0]
    reqs = sorted(m.requests)
    names = sorted(m.branches) or ["none"]
    if kind == "open":
        name = f"b{op[1]}"
        d.apply(BranchOpened(ts=ts, branch=name))
        if name not in m.branches and name not in m.ended:
            m.branches[name] = {"ctx": [], "holders": {}, "version": 0}
        return
    if kind == "submit":
        _, bi, new, append, p, dn = op
        name = names[bi % len(names)]
        b = m.branches.get(name)
        if b is None:
            return
        blocks = list(dict.fromkeys(b["ctx"] + new)) if append else list(dict.fromkeys(new))
        rid = f"r{len(m.requests)}"
        if not (append and blocks[: len(b["ctx"])] == b["ctx"]):
            b["version"] += 1  # a rewrite (compaction) carried by the request
        version = b["version"]
        d.apply(RequestSubmitted(ts=ts, request=rid, branch=name, version=version, blocks=blocks))
        b["ctx"] = blocks
        m.requests[rid] = (name, blocks, p, dn)
        before = all_counts(d)
        d.apply(RouteDecided(ts=ts, request=rid, prefill_node=p, decode_node=dn))
        after = all_counts(d)
        assert all(after[key] >= c for key, c in before.items()), "2. a route un-counted a copy"
        for phase, node in (("prefill", p), ("decode", dn)):
            b["holders"].setdefault(phase, node)  # only a phase without a holder attaches
        return
    if not reqs and kind in ("fetch", "start", "store", "p2d"):
        return
    if kind == "fetch":
        _, ri, src, k = op
        rid = reqs[ri % len(reqs)]
        _, blocks, p, _ = m.requests[rid]
        part = blocks[:k]
        d.apply(KvFetched(ts=ts, request=rid, src_node=src, dst_node=p, blocks=part))
        m.held |= {(x, p, t) for x in part for t in TIERS}
        m.holder(rid, "prefill", p)
    elif kind == "start":
        _, ri, phase = op
        rid = reqs[ri % len(reqs)]
        _, _, p, dn = m.requests[rid]
        node = p if phase == "prefill" else dn
        d.apply(RequestStarted(ts=ts, request=rid, node=node, phase=phase))
        m.holder(rid, phase, node)
    elif kind == "store":
        _, ri, at_decode, tier, k = op
        rid = reqs[ri % len(reqs)]
        _, blocks, p, dn = m.requests[rid]
        node = dn if at_decode else p
        part = blocks[len(blocks) - k:] if k else []
        d.apply(KvStored(ts=ts, node=node, tier=tier, blocks=part, request=rid))
        m.held |= {(x, node, tier) for x in part}
        for phase, routed in (("prefill", p), ("decode", dn)):
            if routed == node:
                m.holder(rid, phase, node)
    elif kind == "p2d":
        _, ri = op
        rid = reqs[ri % len(reqs)]
        _, blocks, p, dn = m.requests[rid]
        d.apply(KvMoved(ts=ts, src_node=p, dst_node=dn, blocks=blocks, request=rid))
        m.held |= {(x, dn, "L1") for x in blocks}
        m.holder(rid, "prefill", p)
        m.holder(rid, "decode", dn)
    elif kind == "end":
        name = names[op[1] % len(names)]
        if name in m.branches:
            d.apply(BranchEnded(ts=ts, branch=name))
            del m.branches[name]
            m.ended.add(name)
    elif kind == "evict":
        _, node, tier, blocks = op
        have = [x for x in dict.fromkeys(blocks) if (x, node, tier) in m.held]
        d.apply(KvEvicted(ts=ts, node=node, tier=tier, blocks=have))
        m.held -= {(x, node, tier) for x in have}


blocks = st.lists(st.sampled_from(list(UNIVERSE)), min_size=1, max_size=4)
OPS = st.one_of(
    st.tuples(st.just("open"), st.integers(0, 5)),
    st.tuples(st.just("submit"), st.integers(0, 9), blocks, st.booleans(),
              st.sampled_from(PREFILL_NODES), st.sampled_from(DECODE_NODES)),
    st.tuples(st.just("fetch"), st.integers(0, 30), st.sampled_from(NODES), st.integers(0, 6)),
    st.tuples(st.just("start"), st.integers(0, 30), st.sampled_from(["prefill", "decode"])),
    st.tuples(st.just("store"), st.integers(0, 30), st.booleans(), st.sampled_from(TIERS), st.integers(0, 6)),
    st.tuples(st.just("p2d"), st.integers(0, 30)),
    st.tuples(st.just("end"), st.integers(0, 9)),
    st.tuples(st.just("evict"), st.sampled_from(NODES), st.sampled_from(TIERS), blocks),
)


def check_eviction(d: DirectoryCore, pinned_pick: list[int], k: int) -> None:
    policy = CountAwareEviction(block_tokens=64)
    for n in NODES:
        pinned = frozenset(pinned_pick)
        for t in TIERS:
            blocks, last, count = d.tier_arrays(n, t)
            rows = sorted((int(c > 0), float(a), int(b)) for b, a, c in zip(blocks, last, count)
                          if int(b) not in pinned)
            chosen = policy.choose(d, n, t, k * 64, pinned)
            assert chosen == [b for _, _, b in rows[:k]], (n, t)
            zero_left = {b for c, _, b in rows if c == 0} - set(chosen)
            assert not (zero_left and any(d.count(b, n) > 0 for b in chosen)), (
                f"{n}/{t}: a counted copy chosen while zero-count copies {sorted(zero_left)} are evictable")


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=3, max_size=60), pinned=st.lists(st.sampled_from(list(UNIVERSE)), max_size=3),
       k=st.integers(1, 6))
def test_counts_follow_the_kv_and_count_aware_eviction_respects_them(ops, pinned, k):
    d, m = DirectoryCore(), Model()
    for n, r in ROLES.items():
        d.apply(NodeRegistered(ts=0.0, node=n, role=r))
    for i, op in enumerate(ops):
        step(d, m, op, float(i + 1))  # 2. is checked inside, around each route
        assert all_counts(d) == m.counts(), op  # 1. the definition, recomputed from scratch
        for name, b in m.branches.items():
            view = d.branch(name)
            assert (view["prefill_holder"], view["decode_holder"]) == (
                b["holders"].get("prefill"), b["holders"].get("decode"))
        check_eviction(d, pinned, k)  # 3.
    restored = DirectoryCore.from_snapshot(d.snapshot())
    assert all_counts(restored) == m.counts()
