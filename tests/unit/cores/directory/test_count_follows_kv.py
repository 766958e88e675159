"""A branch's count moves with its KV, not with the routing decision.

Before the fix, ``RouteDecided`` moved the branch's counts to the routed prefill and decode
nodes at once. While the request waited in the prefill queue (minutes under KV pressure), the
copies that really held the branch's context (the previous prefill and decode nodes) showed
count 0, so count-aware eviction dropped them *first*, ahead of real garbage, and the new nodes
did not hold them yet: the branch's only copies were the most evictable blocks of the cluster.
"""

from __future__ import annotations

from events.catalog import (
    BranchOpened,
    KvFetched,
    KvMoved,
    KvStored,
    NodeRegistered,
    RequestStarted,
    RequestSubmitted,
    RouteDecided,
)
from services.cores.directory import DirectoryCore
from services.cores.directory.eviction import CountAwareEviction, LruEviction

NODES = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
CTX = [1, 2, 3]
GARBAGE = 99


def served_once() -> DirectoryCore:
    """Branch ``a`` served once on p0 -> d0 (t = 1); then garbage (no branch) lands on p0 and d0
    more recently (t = 5): an ended sub-agent's context, say."""
    d = DirectoryCore()
    for node, role in NODES.items():
        d.apply(NodeRegistered(ts=0.0, node=node, role=role))
    d.apply(BranchOpened(ts=0, branch="a"))
    d.apply(RequestSubmitted(ts=1, request="r1", branch="a", blocks=CTX))
    d.apply(RouteDecided(ts=1, request="r1", prefill_node="p0", decode_node="d0"))
    for tier in ("L1", "L2"):
        d.apply(KvStored(ts=1, node="p0", tier=tier, blocks=CTX, request="r1"))
    d.apply(KvMoved(ts=1, src_node="p0", dst_node="d0", blocks=CTX, request="r1"))
    for node in ("p0", "d0"):
        d.apply(KvStored(ts=5, node=node, tier="L2", blocks=[GARBAGE]))
    d.apply(KvStored(ts=5, node="d0", tier="L1", blocks=[GARBAGE]))
    return d


def route_next_turn_elsewhere(d: DirectoryCore) -> None:
    d.apply(RequestSubmitted(ts=10, request="r2", branch="a", blocks=[*CTX, 4]))
    d.apply(RouteDecided(ts=10, request="r2", prefill_node="p1", decode_node="d1"))


def test_a_route_alone_moves_no_count():
    d = served_once()
    route_next_turn_elsewhere(d)
    # the request is queued on p1: its context still lives on p0 and d0 only
    assert [d.count(b, "p0") for b in CTX] == [1, 1, 1]
    assert [d.count(b, "d0") for b in CTX] == [1, 1, 1]
    assert d.branch("a")["prefill_holder"] == "p0" and d.branch("a")["decode_holder"] == "d0"


def test_count_aware_eviction_drops_garbage_before_a_queued_branchs_only_copies():
    d = served_once()
    route_next_turn_elsewhere(d)
    policy = CountAwareEviction(block_tokens=64)
    for node, tier in (("p0", "L2"), ("d0", "L2"), ("d0", "L1")):
        assert policy.choose(d, node, tier, 64) == [GARBAGE], (node, tier)
    # LRU takes the oldest copy, whatever references it (the baseline's behaviour)
    assert LruEviction(block_tokens=64).choose(d, "d0", "L1", 64) == [1]


def test_the_count_moves_when_the_kv_arrives():
    d = served_once()
    route_next_turn_elsewhere(d)
    d.apply(KvFetched(ts=11, request="r2", src_node="p0", dst_node="p1", blocks=CTX))  # P2P
    assert [d.count(b, "p1") for b in CTX] == [1, 1, 1]
    assert [d.count(b, "p0") for b in CTX] == [0, 0, 0]  # the source copy is now a duplicate
    assert [d.count(b, "d0") for b in CTX] == [1, 1, 1]  # decode: not moved yet
    d.apply(RequestStarted(ts=12, request="r2", node="p1", phase="prefill"))
    d.apply(KvStored(ts=13, node="p1", tier="L1", blocks=[4], request="r2"))
    d.apply(KvMoved(ts=14, src_node="p1", dst_node="d1", blocks=[*CTX, 4], request="r2"))  # P2D
    assert [d.count(b, "d1") for b in [*CTX, 4]] == [1, 1, 1, 1]
    assert [d.count(b, "d0") for b in CTX] == [0, 0, 0]
    assert (d.branch("a")["prefill_holder"], d.branch("a")["decode_holder"]) == ("p1", "d1")


def test_request_started_on_a_node_moves_that_phases_count_there():
    d = served_once()
    d.apply(KvStored(ts=6, node="p1", tier="L2", blocks=CTX))  # p1 already holds the context
    route_next_turn_elsewhere(d)
    assert d.count(1, "p1") == 0
    d.apply(RequestStarted(ts=12, request="r2", node="p1", phase="prefill"))  # no fetch needed
    assert d.count(1, "p1") == 1 and d.count(1, "p0") == 0
    d.apply(RequestStarted(ts=13, request="r2", node="d0", phase="decode"))  # kept its decode node
    assert d.branch("a")["decode_holder"] == "d0" and d.count(1, "d0") == 1


def test_a_branchs_first_route_attaches_its_counts_to_the_routed_nodes():
    d = served_once()
    d.apply(BranchOpened(ts=20, branch="b"))
    d.apply(RequestSubmitted(ts=20, request="q1", branch="b", blocks=[GARBAGE]))
    d.apply(RouteDecided(ts=20, request="q1", prefill_node="p0", decode_node="d0"))
    assert d.count(GARBAGE, "p0") == 1 and d.count(GARBAGE, "d0") == 1
