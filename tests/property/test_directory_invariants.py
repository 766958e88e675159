"""Hypothesis: random interleavings of fork / sub-agent / continuation / compaction / end /
move / switch / evict (plus out-of-order input) keep the directory's invariants.

A plain reference model tracks each branch's context, excluded blocks and per-phase holder
with the rules of docs/directory.md; after every step the count of every copy is recomputed
from scratch (active branches whose counted context holds the block and that hold the copy's
node in some phase, on copies that exist) and compared with the core.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.catalog import (
    BranchEnded,
    BranchOpened,
    ContextCompacted,
    KvEvicted,
    KvMoved,
    KvStored,
    NodeRegistered,
    RequestSubmitted,
    RoleSwitched,
    RouteDecided,
)
from services.cores.directory import DirectoryCore
from tests.hyp import examples

NODES = ["p0", "p1", "d0", "d1", "c0"]
ROLES0 = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode", "c0": "collocated"}
PHASES = ("prefill", "decode")
UNIVERSE = range(1, 13)


class Model:
    def __init__(self) -> None:
        self.branches: dict[str, dict] = {}
        self.ended: set[str] = set()
        self.role = dict(ROLES0)
        self.held: set[tuple[int, str, str]] = set()
        self.routes: dict[str, tuple[str, str, str]] = {}  # request -> (branch, p, d)

    def counted(self, b: dict) -> set[int]:
        return set(b["ctx"]) - b["excluded"]

    def expected(self, block: int, node: str) -> int:
        if not any((block, node, t) in self.held for t in ("L1", "L2")):
            return 0
        return sum(1 for b in self.branches.values()
                   if block in self.counted(b) and node in b["holders"].values())

    def get(self, branch: str, create: bool) -> dict | None:
        if branch in self.branches:
            return self.branches[branch]
        if branch in self.ended or not create:
            return None
        self.branches[branch] = {"ctx": [], "excluded": set(), "holders": {}, "version": 0}
        return self.branches[branch]


def step(d: DirectoryCore, m: Model, op: tuple, ts: float) -> None:
    kind = op[0]
    names = sorted(m.branches) * 4 + sorted(m.ended) + ["ghost"]  # mostly active branches
    pick = lambda i: names[i % len(names)]
    if kind == "open":
        _, i, parent_i, mode = op
        name = f"b{i}"
        parent = pick(parent_i) if mode != "root" else None
        d.apply(BranchOpened(ts=ts, branch=name, parent=parent, mode=mode))
        if name in m.branches or name in m.ended:
            return
        b = {"ctx": [], "excluded": set(), "holders": {}, "version": 0}
        m.branches[name] = b
        par = m.branches.get(parent) if parent else None
        if par is not None and mode == "subagent":
            b["excluded"] = set(par["ctx"])
        elif par is not None and mode == "fork":
            b.update(ctx=list(par["ctx"]), excluded=set(par["excluded"]), holders=dict(par["holders"]))
    elif kind == "request":
        _, bi, append, new_blocks, bump, p, dn, rid = op
        name = pick(bi)
        b = m.branches.get(name)
        old = b["ctx"] if b else []
        blocks = list(dict.fromkeys(old + new_blocks)) if append else list(dict.fromkeys(new_blocks))
        version = (b["version"] if b else 0) + bump
        req = f"q{rid}"
        d.apply(RequestSubmitted(ts=ts, request=req, branch=name, version=version, blocks=blocks))
        d.apply(RouteDecided(ts=ts, request=req, prefill_node=p, decode_node=dn))
        d.apply(KvStored(ts=ts, node=p, tier="L1", blocks=blocks, request=req))
        d.apply(KvMoved(ts=ts, src_node=p, dst_node=dn, blocks=blocks, request=req))
        m.held |= {(x, p, "L1") for x in blocks} | {(x, dn, "L1") for x in blocks}
        b = m.get(name, create=True)
        if b is None:
            return
        if version >= b["version"]:
            b["version"], b["ctx"] = version, blocks
        b["holders"] = {"prefill": p, "decode": dn}  # route, then the P2D move: both keep
    elif kind == "compact":
        _, bi, blocks, bump = op
        name = pick(bi)
        b = m.branches.get(name)
        version = (b["version"] if b else 0) + bump
        d.apply(ContextCompacted(ts=ts, branch=name, version=version, blocks=blocks))
        if b is not None and (version > b["version"] or (version == b["version"] and not b["ctx"])):
            b["version"], b["ctx"] = version, list(blocks)
    elif kind == "end":
        name = pick(op[1])
        d.apply(BranchEnded(ts=ts, branch=name))
        if name in m.branches:
            del m.branches[name]
            m.ended.add(name)
    elif kind == "move":
        _, bi, src, dst, sp, dp = op
        name = pick(bi)
        b = m.branches.get(name)
        blocks = sorted(m.counted(b)) if b else [1]
        d.apply(KvMoved(ts=ts, src_node=src, dst_node=dst, blocks=blocks, src_phase=sp, dst_phase=dp,
                        dst_tier="L2", branch=name))
        m.held |= {(x, dst, "L2") for x in blocks}
        if b is not None:
            if sp != dp:
                b["holders"][sp] = src
            b["holders"][dp] = dst
    elif kind == "switch":
        _, node, role = op
        d.apply(RoleSwitched(ts=ts, node=node, role=role))
        old = m.role[node]
        if role == "prefill" and old in ("decode", "collocated"):
            phases = PHASES if old == "decode" else ("decode",)
            for b in m.branches.values():
                for ph in phases:
                    if b["holders"].get(ph) == node:
                        del b["holders"][ph]
        m.role[node] = role
    elif kind == "evict":
        _, node, tier, blocks = op
        d.apply(KvEvicted(ts=ts, node=node, tier=tier, blocks=blocks))
        m.held -= {(x, node, tier) for x in blocks}


node = st.sampled_from(NODES)
blocks = st.lists(st.sampled_from(list(UNIVERSE)), max_size=6)
OPS = st.one_of(
    st.tuples(st.just("open"), st.integers(0, 8), st.integers(0, 20), st.sampled_from(["root", "fork", "subagent"])),
    st.tuples(st.just("request"), st.integers(0, 20), st.booleans(), blocks, st.sampled_from([0, 0, 1, -1]),
              node, node, st.integers(0, 5)),
    st.tuples(st.just("compact"), st.integers(0, 20), blocks, st.sampled_from([0, 1, 2, -1])),
    st.tuples(st.just("end"), st.integers(0, 20)),
    st.tuples(st.just("move"), st.integers(0, 20), node, node, st.sampled_from(PHASES), st.sampled_from(PHASES)),
    st.tuples(st.just("switch"), node, st.sampled_from(["prefill", "decode", "collocated"])),
    st.tuples(st.just("evict"), node, st.sampled_from(["L1", "L2"]), blocks),
)


def check(d: DirectoryCore, m: Model) -> None:
    for n in NODES:
        assert all(c > 0 for c in d.counts_on(n).values()), "counts are never negative (or stored as 0)"
        for x in UNIVERSE:
            assert d.count(x, n) == m.expected(x, n), (x, n)
    assert d.active_branches() == sorted(m.branches)
    for name, b in m.branches.items():
        view = d.branch(name)
        # at most one counted copy per phase, and it is the one the rules say
        assert (view["prefill_holder"], view["decode_holder"]) == (
            b["holders"].get("prefill"), b["holders"].get("decode"))
        assert view["counted"] == sorted(m.counted(b))
    held = {(x, n, t) for x in UNIVERSE for n, t in d.holders(x)}
    assert held == m.held


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OPS, min_size=4, max_size=50))
def test_counts_equal_a_recomputation_from_scratch(ops):
    d, m = DirectoryCore(), Model()
    for n, r in ROLES0.items():
        d.apply(NodeRegistered(ts=0.0, node=n, role=r))
    for i, op in enumerate(ops):
        step(d, m, op, float(i + 1))
        check(d, m)
    restored = DirectoryCore.from_snapshot(d.snapshot())
    assert restored.snapshot() == d.snapshot()
    check(restored, m)
