"""Lookup (prefixes per node and tier, pool prefix, fetch plan) and eviction order."""

from __future__ import annotations

import pytest

from events.catalog import (
    BranchOpened,
    ContextCompacted,
    FetchStep,
    FirstToken,
    KvStored,
    NodeRegistered,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RouteDecided,
)
from services.cores.directory import CountAwareEviction, DirectoryCore, LruEviction


def nodes(*ids) -> DirectoryCore:
    d = DirectoryCore()
    for n in ids:
        d.apply(NodeRegistered(ts=0.0, node=n, role="prefill"))
    return d


def store(d, node, tier, blocks, ts=0.0):
    d.apply(KvStored(ts=ts, node=node, tier=tier, blocks=list(blocks)))


def test_prefixes_per_node_and_tier_and_pool():
    d = nodes("a", "b", "c")
    store(d, "a", "L1", [1, 2, 3])
    store(d, "a", "L2", [1, 2, 3, 4, 5])
    store(d, "b", "L2", [1, 2, 3, 4, 5, 6, 7])
    store(d, "c", "L1", [1, 2, 9])  # 9 is not in the request: c's prefix ends at 2
    look = d.lookup([1, 2, 3, 4, 5, 6, 7, 8])
    got = {n: (m.l1_blocks, m.local_blocks, m.l2_blocks) for n, m in look.per_node.items()}
    assert got == {"a": (3, 5, 5), "b": (0, 7, 7), "c": (2, 2, 0)}
    assert look.pool_blocks == 7
    assert look.best() == ("b", 7)
    assert look.tokens("a", prompt_tokens=8 * 64 + 10, block_tokens=64) == (7 * 64, 64 + 10)
    assert look.tokens("a", prompt_tokens=8 * 64 + 10, block_tokens=64, fetch=False) == (5 * 64, 3 * 64 + 10)


def test_lookup_stops_at_a_gap_and_counts_nothing_missing():
    d = nodes("a")
    store(d, "a", "L1", [1, 2, 4, 5])  # parent 3 evicted before its children
    look = d.lookup([1, 2, 3, 4, 5])
    assert (look.pool_blocks, look.per_node["a"].local_blocks) == (2, 2)
    assert d.lookup([]).pool_blocks == 0
    assert d.lookup([77]).per_node["a"].local_blocks == 0


def test_fetch_plan_prefers_host_copies_longest_runs_and_smallest_ids():
    d = nodes("a", "b", "c", "n")
    store(d, "n", "L1", [1, 2])
    store(d, "a", "L2", [1, 2, 3, 4])
    store(d, "b", "L2", [1, 2, 3, 4])  # ties with a on [2, 4): a wins (smaller id)
    store(d, "c", "L2", [1, 2, 3, 4, 5, 6])  # longest from 2: c covers [2, 6)
    store(d, "c", "L1", [7])
    store(d, "a", "L1", [1, 2, 3, 4, 5, 6, 7, 8])  # GPU copy only where no host copy exists
    look = d.lookup(list(range(1, 10)))
    assert look.pool_blocks == 8
    assert look.fetch_plan("n") == [
        FetchStep(src_node="c", first_block=2, n_blocks=4, tier="L2"),
        FetchStep(src_node="a", first_block=6, n_blocks=2, tier="L1"),
    ]
    assert look.per_node["c"].local_blocks == 7  # c's own GPU copy of block 7 extends its prefix
    assert look.fetch_plan("c") == [FetchStep(src_node="a", first_block=7, n_blocks=1, tier="L1")]
    assert look.fetch_plan("a") == []


def test_fetch_plan_skips_what_the_node_itself_holds_past_its_prefix():
    d = nodes("a", "n")
    store(d, "a", "L2", [1, 2, 3])
    store(d, "n", "L1", [1, 3, 4])
    look = d.lookup([1, 2, 3, 4])
    assert look.pool_blocks == 4 and look.per_node["n"].local_blocks == 1
    assert look.fetch_plan("n") == [FetchStep(src_node="a", first_block=1, n_blocks=2, tier="L2")]


# ----------------------------------------------------------------------------- eviction
def test_zero_count_blocks_go_first_in_lru_order():
    d = nodes("p")
    d.apply(BranchOpened(ts=0, branch="x"))
    d.apply(RequestSubmitted(ts=0, request="r", branch="x", blocks=[10, 11]))
    d.apply(RouteDecided(ts=0, request="r", prefill_node="p", decode_node="p"))
    store(d, "p", "L2", [10, 11], ts=1.0)  # counted, oldest
    store(d, "p", "L2", [30], ts=5.0)
    store(d, "p", "L2", [20], ts=3.0)
    store(d, "p", "L2", [21, 22], ts=4.0)  # same time: ties on the block hash
    ca = CountAwareEviction(block_tokens=64)
    assert ca.order(d, "p", "L2") == [20, 21, 22, 30, 10, 11]
    assert ca.choose(d, "p", "L2", tokens_to_free=65) == [20, 21]  # ceil(65 / 64) blocks
    assert ca.choose(d, "p", "L2", tokens_to_free=0) == []
    assert ca.choose(d, "p", "L2", tokens_to_free=10**6) == [20, 21, 22, 30, 10, 11]
    assert ca.choose(d, "p", "L2", 64 * 3, pinned=frozenset({20, 22})) == [21, 30, 10]
    assert LruEviction().order(d, "p", "L2") == [10, 11, 20, 21, 22, 30]
    assert ca.order(d, "p", "L1") == []


def test_tool_wait_keeps_its_kv_while_fresh_compacted_history_goes():
    """Fig. 2c: a branch waits 359 s on a tool; another compacted 12 s ago. At t = 359 the
    waiting branch's KV is the oldest but still referenced; the compacted history is not."""
    d = nodes("p")
    for br in ("wait", "comp"):
        d.apply(BranchOpened(ts=0, branch=br))
    wait_blocks, old_history, summary = [1, 2, 3, 4], [50, 51, 52, 53], [60]
    d.apply(RequestSubmitted(ts=0, request="w1", branch="wait", blocks=wait_blocks))
    d.apply(RouteDecided(ts=0, request="w1", prefill_node="p", decode_node="p"))
    store(d, "p", "L2", wait_blocks, ts=0.0)
    d.apply(RequestFinished(ts=1, request="w1", node="p"))  # then the tool runs for 359 s
    d.apply(RequestSubmitted(ts=340, request="c1", branch="comp", blocks=old_history))
    d.apply(RouteDecided(ts=340, request="c1", prefill_node="p", decode_node="p"))
    store(d, "p", "L2", old_history, ts=340.0)
    d.apply(RequestFinished(ts=345, request="c1", node="p"))
    d.apply(ContextCompacted(ts=347, branch="comp", version=1, blocks=summary))
    store(d, "p", "L2", summary, ts=347.0)
    free = 4 * 64
    assert CountAwareEviction().choose(d, "p", "L2", free) == old_history
    assert LruEviction().choose(d, "p", "L2", free) == wait_blocks
    assert d.lookup(wait_blocks + [5]).per_node["p"].local_blocks == 4  # resume at 359 s reuses all


def test_pinned_blocks_follow_routed_unfinished_requests():
    d = DirectoryCore()
    d.apply(NodeRegistered(ts=0, node="p", role="prefill"))
    d.apply(NodeRegistered(ts=0, node="q", role="decode"))
    d.apply(BranchOpened(ts=0, branch="x"))
    d.apply(RequestSubmitted(ts=0, request="r", branch="x", blocks=[1, 2]))
    assert d.pinned("p") == frozenset()
    d.apply(RouteDecided(ts=0, request="r", prefill_node="p", decode_node="q"))
    assert d.pinned("p") == d.pinned("q") == frozenset({1, 2})
    store(d, "p", "L1", [1, 2, 3], ts=1.0)
    assert CountAwareEviction().choose(d, "p", "L1", 10**6, pinned=d.pinned("p")) == [3]
    d.apply(RequestStarted(ts=2, request="r", node="p", phase="prefill"))
    assert d.last_access(1, "p", "L1") == 2.0 and d.last_access(3, "p", "L1") == 1.0
    d.apply(FirstToken(ts=3, request="r", node="q"))
    assert d.pinned("p") == frozenset() and d.pinned("q") == frozenset({1, 2})
    d.apply(RequestFinished(ts=4, request="r", node="q"))
    assert d.pinned("q") == frozenset()


@pytest.mark.parametrize("policy", [CountAwareEviction(), LruEviction()])
def test_policies_share_one_interface(policy):
    d = nodes("p")
    store(d, "p", "L1", [3, 1, 2], ts=1.0)
    assert policy.choose(d, "p", "L1", 64) == [1]
    assert policy.name in ("count_aware", "lru")


def test_many_nodes_span_several_mask_words():
    ids = [f"n{i:02d}" for i in range(70)]  # 140 copy bits: three 64-bit words
    d = nodes(*ids)
    store(d, "n69", "L2", [1, 2, 3, 4])
    store(d, "n33", "L1", [1, 2])
    store(d, "n00", "L2", [1])
    look = d.lookup([1, 2, 3, 4, 5])
    assert look.pool_blocks == 4
    assert (look.per_node["n69"].l2_blocks, look.per_node["n69"].l1_blocks) == (4, 0)
    assert look.per_node["n33"] == look.per_node["n33"].__class__(l1_blocks=2, local_blocks=2, l2_blocks=0)
    assert look.per_node["n00"].local_blocks == 1 and look.per_node["n50"].local_blocks == 0
    assert look.fetch_plan("n33") == [FetchStep(src_node="n69", first_block=2, n_blocks=2, tier="L2")]
    assert d.holders(1) == [("n00", "L2"), ("n33", "L1"), ("n69", "L2")]
    assert LruEviction().choose(d, "n69", "L2", 64) == [1]


def test_lookup_of_a_hash_outside_64_bits_ends_the_prefix_there():
    d = nodes("a")
    blocks = list(range(1, 40))
    store(d, "a", "L1", blocks)
    assert d.lookup(blocks[:30] + [-5] + blocks[30:]).pool_blocks == 30
    assert d.lookup(blocks[:3] + [2**64]).per_node["a"].local_blocks == 3
