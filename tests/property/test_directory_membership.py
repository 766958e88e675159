"""Hypothesis: nodes removed and registered again, over and over, between KV facts, routes,
starts and finishes, never trip the directory's assertions, and the invariants of
tests/property/test_directory_invariants.py (every count equal to a recomputation from
scratch, counts never negative, holders and copies as the rules say) hold after every step.

Liveness that heals: the liveness watcher may remove a node that is only
late; its worker then registers again, re-publishes its KV (``KvStored`` without a request),
and goes on publishing what it had in flight, so the directory sees removals, re-registrations,
repeated removals and KV of a removed node in any order. The reference model adds the rules
of membership (docs/directory.md): a ``NodeRemoved`` of a live node detaches every count on
it and drops its copies; a repeated one changes nothing; ``NodeRegistered`` brings it back
with no copies (and, in another role, the counts a switch to that role resets); KV of a
removed node revives it. ``RequestStarted`` and routes naming a removed node are ignored.

The first case here is the sequence the worker's own view asserted on at shutdown (two
requests started on one node, then a ``KvStored`` of one of them: the table allocated a
second slot for blocks already counted, and the removal's decrement found 0).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.catalog import (
    KvStored,
    NodeRegistered,
    NodeRemoved,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RouteDecided,
)
from services.cores.directory import DirectoryCore
from tests.hyp import examples
from tests.property.test_directory_invariants import NODES, OPS, PHASES, ROLES0, UNIVERSE, Model, check, step

SMALL = [1000 + i for i in range(3)]
LARGE = [2000 + i for i in range(40)]  # beyond the table's short-list path


def test_started_requests_then_a_store_then_removal_keeps_one_slot_per_block():
    for blocks in (SMALL, LARGE):
        d = DirectoryCore()
        d.apply(NodeRegistered(ts=0.0, node="n1", role="prefill"))
        other = [b + 500 for b in blocks]
        d.apply(RequestSubmitted(ts=0.0, request="r1", branch="b1", blocks=other))
        d.apply(RequestSubmitted(ts=0.0, request="r2", branch="b2", blocks=blocks))
        d.apply(RequestStarted(ts=1.0, request="r1", node="n1", phase="prefill"))
        d.apply(RequestStarted(ts=1.0, request="r2", node="n1", phase="prefill"))
        d.apply(KvStored(ts=1.0, node="n1", tier="L2", blocks=blocks, request="r2"))
        assert d.count(blocks[0], "n1") == 1
        d.apply(NodeRemoved(ts=2.0, node="n1", reason="heartbeat timeout"))
        d.apply(NodeRemoved(ts=3.0, node="n1", reason="shutdown"))  # a repeated removal: an anomaly only
        assert d.nodes() == {}
        d.apply(NodeRegistered(ts=4.0, node="n1", role="prefill"))
        d.apply(KvStored(ts=4.0, node="n1", tier="L2", blocks=blocks))
        assert d.nodes() == {"n1": "prefill"} and d.count(blocks[0], "n1") == 0
        assert d.blocks_on("n1", "L2") == sorted(blocks)


class MemberModel(Model):
    """:class:`Model` plus which nodes are live and the requests routed and started."""

    def __init__(self) -> None:
        super().__init__()
        self.alive = set(NODES)

    def detach(self, node: str, phases=PHASES) -> None:
        for b in self.branches.values():
            for ph in phases:
                if b["holders"].get(ph) == node:
                    del b["holders"][ph]


def member_step(d: DirectoryCore, m: MemberModel, op: tuple, ts: float) -> None:
    kind = op[0]
    if kind == "remove":
        node = op[1]
        d.apply(NodeRemoved(ts=ts, node=node, reason="heartbeat timeout"))
        if node in m.alive:
            m.detach(node)
            m.held = {h for h in m.held if h[1] != node}
            m.alive.discard(node)
    elif kind == "register":
        _, node, role = op
        d.apply(NodeRegistered(ts=ts, node=node, role=role))
        old = m.role[node]
        if role == "prefill" and old in ("decode", "collocated"):
            m.detach(node, PHASES if old == "decode" else ("decode",))
        m.role[node] = role
        m.alive.add(node)
    elif kind == "restore":  # the re-registered worker's KV, with no request or branch
        _, node, tier, blocks = op
        d.apply(KvStored(ts=ts, node=node, tier=tier, blocks=blocks))
        m.held |= {(x, node, tier) for x in blocks}
        m.alive.add(node)  # KV of a removed node revives it
    elif kind == "startstore":  # started without a route, then its KV stored: the worker's order
        _, bi, append, new_blocks, node = op
        if node not in m.alive:
            return
        names = sorted(m.branches) * 4 + sorted(m.ended) + ["ghost"]
        name = names[bi % len(names)]
        b = m.branches.get(name)
        old = b["ctx"] if b else []
        blks = list(dict.fromkeys(old + new_blocks)) if append else list(dict.fromkeys(new_blocks))
        version = b["version"] if b else 0
        req = f"t{ts:g}"
        d.apply(RequestSubmitted(ts=ts, request=req, branch=name, version=version, blocks=blks))
        d.apply(RequestStarted(ts=ts, request=req, node=node, phase="prefill"))
        d.apply(KvStored(ts=ts, node=node, tier="L1", blocks=blks, request=req))
        m.held |= {(x, node, "L1") for x in blks}
        b = m.get(name, create=True)
        if b is None:
            return
        if version >= b["version"]:
            b["version"], b["ctx"] = version, blks
        b["holders"]["prefill"] = node
        if m.role[node] == "decode":  # an unrouted store counts in the node's role's phase
            b["holders"]["decode"] = node
    elif kind == "start":
        _, bi, node, phase = op
        names = sorted(m.branches)
        if not names:
            return
        name = names[bi % len(names)]
        b = m.branches[name]
        req = f"s{ts:g}"
        d.apply(RequestSubmitted(ts=ts, request=req, branch=name, version=b["version"], blocks=list(b["ctx"])))
        if node in m.alive:
            d.apply(RouteDecided(ts=ts, request=req, prefill_node=node, decode_node=node))
            for ph in PHASES:  # a phase with no holder attaches to the routed node
                b["holders"].setdefault(ph, node)
        d.apply(RequestStarted(ts=ts, request=req, node=node, phase=phase))
        if node in m.alive:
            b["holders"][phase] = node
        d.apply(RequestFinished(ts=ts, request=req, node=node))
    else:
        if kind in ("request", "move", "evict", "switch"):
            names = [n for n in op[1:] if isinstance(n, str) and n in NODES]
            if any(n not in m.alive for n in names):
                return  # the base model's rules assume live nodes; removed ones are driven above
        step(d, m, op, ts)


node = st.sampled_from(NODES)
blocks = st.lists(st.sampled_from(list(UNIVERSE)), max_size=6)
MEMBER_OPS = st.one_of(
    OPS,
    st.tuples(st.just("remove"), node),
    st.tuples(st.just("remove"), node),
    st.tuples(st.just("register"), node, st.sampled_from(["prefill", "decode", "collocated"])),
    st.tuples(st.just("restore"), node, st.sampled_from(["L1", "L2"]), blocks),
    st.tuples(st.just("start"), st.integers(0, 20), node, st.sampled_from(PHASES)),
    st.tuples(st.just("startstore"), st.integers(0, 20), st.booleans(), blocks, node),
)


def check_members(d: DirectoryCore, m: MemberModel) -> None:
    check(d, m)
    assert set(d.nodes()) == m.alive
    for n in NODES:
        assert all(c >= 0 for c in d.counts_on(n).values())


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(MEMBER_OPS, min_size=4, max_size=60))
def test_repeated_removal_and_reregistration_keep_the_invariants(ops):
    d, m = DirectoryCore(), MemberModel()
    for n, r in ROLES0.items():
        d.apply(NodeRegistered(ts=0.0, node=n, role=r))
    for i, op in enumerate(ops):
        member_step(d, m, op, float(i + 1))
        check_members(d, m)
    restored = DirectoryCore.from_snapshot(d.snapshot())
    assert restored.snapshot() == d.snapshot()
    check_members(restored, m)
