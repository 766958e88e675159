"""Each baseline's rule, with exact expected choices."""

from __future__ import annotations

import pytest

from events.catalog import RouteDecided
from services.cores.router.cache_aware import CacheAwareRouter, StickyRouter
from services.cores.router.dynamo import DynamoKvRouter
from services.cores.router.load_balancing import LeastLoadedRouter, RoundRobinRouter
from services.drivers.bench import scenario as s

BT = 64


def run(router, events):
    return [o for ev in events for o in router.apply(ev) if isinstance(o, RouteDecided)]


def test_round_robin_cycles_prefill_and_decode():
    out = run(RoundRobinRouter(), s.register(3, 2) + [s.branch("b", 0.0)]
              + [s.submit(f"r{i}", "b", s.blocks(100 * i, 2), 1.0) for i in range(5)])
    assert [(d.prefill_node, d.decode_node) for d in out] == [
        ("p00", "d00"), ("p01", "d01"), ("p02", "d00"), ("p00", "d01"), ("p01", "d00")]
    assert [sc.score for sc in out[1].scores] == [2.0, 0.0, 1.0]


def test_least_loaded_counts_queued_and_running():
    r = LeastLoadedRouter()
    out = run(r, s.register(2, 1) + [s.branch("b", 0.0)]
              + [s.submit(f"r{i}", "b", s.blocks(100 * i, 2), 1.0) for i in range(3)])
    assert [d.prefill_node for d in out] == ["p00", "p01", "p00"]
    out = run(r, s.lifecycle("r1", "p01", "d00", 2.0)[:2] + [s.submit("r3", "b", s.blocks(900, 2), 3.0)])
    assert [d.prefill_node for d in out] == ["p01"]  # p01 finished its prefill


def test_sticky_same_branch_same_node_forks_follow_parent():
    r = StickyRouter()
    evs = s.register(3, 1) + [s.branch("a", 0.0), s.branch("b", 0.0)]
    evs += [s.submit("a1", "a", s.blocks(1, 2), 1.0), s.submit("b1", "b", s.blocks(50, 2), 1.0)]
    evs += [s.submit(f"a{i}", "a", s.blocks(1, 2 + i), 1.0 + i) for i in range(2, 5)]
    evs += [s.branch("af", 5.0, parent="a", mode="fork"), s.branch("as", 5.0, parent="a", mode="subagent")]
    evs += [s.submit("af1", "af", s.blocks(1, 3), 6.0), s.submit("as1", "as", s.blocks(700, 3), 6.0)]
    out = run(r, evs)
    got = {d.request: d.prefill_node for d in out}
    assert got == {"a1": "p00", "b1": "p01", "a2": "p00", "a3": "p00", "a4": "p00", "af1": "p00", "as1": "p02"}


def test_cache_aware_thresholds():
    # balanced, match above 0.3: the holder in the approximate tree
    r = CacheAwareRouter()
    pre = s.blocks(1, 10)
    out = run(r, s.register(3, 1) + [s.branch("b", 0.0)]
              + [s.submit("r0", "b", pre, 1.0), s.submit("r1", "b", pre + s.blocks(500, 2), 1.1)])
    assert [d.prefill_node for d in out] == ["p00", "p00"]
    assert [sc.score for sc in out[1].scores] == [10.0 * BT, 0.0, 0.0]
    # match 10 of 40 blocks = 0.25 <= 0.3: the smallest tree (p01, empty; ties on id)
    out = run(r, [s.submit("r2", "b", pre + s.blocks(900, 30), 1.2)])
    assert out[0].prefill_node == "p01"
    # imbalanced (diff > abs and max > rel * min): least load, regardless of the match
    r2 = CacheAwareRouter(balance_abs_threshold=2, balance_rel_threshold=1.5)
    evs = s.register(2, 1) + [s.branch("b", 0.0)]
    evs += [s.submit(f"h{i}", "b", pre + s.blocks(1_000 * (i + 1), 1), 1.0) for i in range(5)]
    out = run(r2, evs)
    # loads before each: (0,0) empty tree -> p00; (1,0) match -> p00; (2,0) diff 2 not > 2 -> p00;
    # (3,0) imbalanced -> p01; (3,1) diff 2 -> balanced again, match -> p00
    assert [d.prefill_node for d in out] == ["p00", "p00", "p00", "p01", "p00"]


def test_cache_aware_evicts_lru_blocks_on_its_interval():
    r = CacheAwareRouter(max_tree_tokens=4 * BT, eviction_interval_s=10.0)
    run(r, s.register(1, 1) + [s.branch("b", 0.0), s.submit("r0", "b", s.blocks(1, 3), 1.0),
                                s.submit("r1", "b", s.blocks(100, 3), 2.0)])
    assert r.trees.sizes[0] == 6
    run(r, [s.branch("c", 10.5)])
    # the older request's blocks go first, its leaves before their parents
    assert r.trees.blocks_of(0) == [1, 100, 101, 102]
    assert r.next_eviction == 20.0


def test_dynamo_cost_exact():
    r = DynamoKvRouter()
    evs = s.register(2, 1) + [s.branch("b", 0.0)] + s.store("p01", s.blocks(1, 8), 0.5)
    evs += [s.submit("r0", "b", s.blocks(5_000, 4), 1.0)]  # cold: both cost 4, tie -> p00
    out = run(r, evs)
    assert out[0].prefill_node == "p00"
    assert {sc.node: sc.score for sc in out[0].scores} == {"p00": 4.0, "p01": 4.0}
    out = run(r, [s.submit("r1", "b", s.blocks(1, 8) + s.blocks(9_000, 2), 2.0)])
    # prefill nodes carry no decode term (Dynamo's prefill router: router_track_active_blocks = false)
    # p00: outstanding t_uc 256 tokens (4 blocks) + 10 new blocks; p01: 0 outstanding + 2 new (8 cached)
    assert {sc.node: sc.score for sc in out[0].scores} == {"p00": 4 + 10, "p01": 2}
    assert (out[0].prefill_node, out[0].t_c, out[0].t_uc) == ("p01", 8 * BT, 2 * BT)
    heavy = DynamoKvRouter(overlap_score_weight=0.5)
    out = run(heavy, evs + [s.submit("r1", "b", s.blocks(1, 8) + s.blocks(9_000, 2), 2.0)])
    assert {sc.node: sc.score for sc in out[1].scores} == {"p00": 7.0, "p01": 1.0}


def test_dynamo_prefill_nodes_ignore_active_blocks():
    """A prefill worker busy with a mostly cached request still wins the next turn of that
    prefix: only uncached work loads a Dynamo prefill worker (the old cost added every
    outstanding request's blocks and sent the turn away from its prefix)."""
    r = DynamoKvRouter()
    pre = s.blocks(1, 8)
    evs = s.register(2, 1) + [s.branch("b", 0.0), s.branch("c", 0.0)] + s.store("p00", pre, 0.5)
    evs += [s.submit("r0", "b", pre + s.blocks(100, 2), 1.0), s.submit("r1", "c", pre + s.blocks(200, 2), 1.1)]
    out = run(r, evs)
    assert [d.prefill_node for d in out] == ["p00", "p00"]
    # r1 on p00: r0's 2 uncached blocks + its own 10 - 8 cached = 4; on p01: 10 cold blocks
    assert {sc.node: sc.score for sc in out[1].scores} == {"p00": 4.0, "p01": 10.0}


def test_dynamo_host_prefix_credited_at_host_cache_hit_weight():
    r = DynamoKvRouter()
    evs = s.register(2, 1) + [s.branch("b", 0.0)] + s.store("p01", s.blocks(1, 8), 0.5, tiers=("L2",))
    out = run(r, evs + [s.submit("r0", "b", s.blocks(1, 8) + s.blocks(900, 2), 1.0)])
    # p01 holds the 8-block prefix in host memory only: credit 0.75 * 8 blocks
    assert {sc.node: sc.score for sc in out[0].scores} == {"p00": 10.0, "p01": 10 - 0.75 * 8}
    assert (out[0].prefill_node, out[0].t_c) == ("p01", 8 * BT)


def test_dynamo_collocated_counts_decoding_requests():
    """Aggregated Dynamo tracks a request's blocks until it finishes, decode included."""
    r = DynamoKvRouter()
    out = run(r, s.register(0, 0, collocated=2) + [s.branch("b", 0.0), s.submit("r0", "b", s.blocks(1, 6), 1.0)])
    assert out[0].prefill_node == "c00"
    out = run(r, s.lifecycle("r0", "c00", "c00", 1.0)[:3] + [s.submit("r1", "b", s.blocks(500, 4), 2.0)])
    # c00: 4 new + r0's 6 blocks decoding there + own 4; c01: 4 + 4
    assert {sc.node: sc.score for sc in out[0].scores} == {"c00": 14.0, "c01": 8.0}
    assert out[0].prefill_node == "c01"


def test_dynamo_decode_fewest_active_blocks():
    """Dynamo's decode router (no overlap, no prefill tokens): the decode node holding the
    fewest blocks of unfinished requests, not round robin."""
    r = DynamoKvRouter()
    evs = s.register(1, 2) + [s.branch("b", 0.0)]
    evs += [s.submit("r0", "b", s.blocks(1, 10), 1.0), s.submit("r1", "b", s.blocks(100, 2), 1.1),
            s.submit("r2", "b", s.blocks(200, 2), 1.2)]
    out = run(r, evs)
    assert [d.decode_node for d in out] == ["d00", "d01", "d01"]


@pytest.mark.parametrize("cls", [CacheAwareRouter, DynamoKvRouter, LeastLoadedRouter, RoundRobinRouter,
                                 StickyRouter])
def test_baselines_never_fetch(cls):
    r = cls()
    out = run(r, s.register(2, 1) + [s.branch("b", 0.0)] + s.store("p01", s.blocks(1, 8), 0.5)
              + [s.submit(f"r{i}", "b", s.blocks(1, 8) + s.blocks(100 * i, 2), 1.0) for i in range(4)])
    assert all(d.fetch_plan == [] for d in out)
    assert all(d.t_c == (8 * BT if d.prefill_node == "p01" else 0) for d in out)


def test_cache_aware_first_event_at_wall_clock_time_does_not_spin():
    """Under `evolving up` event times are wall-clock seconds (~1.8e9): the eviction clock jumps
    there in one step (it used to count 3e7 intervals of 60 s one by one, deciding nothing)."""
    from events.catalog import Tick
    from services.cores.router.cache_aware import CacheAwareRouter

    class Interval(float):
        reads = 0

        def __float__(self):
            Interval.reads += 1
            return float.__float__(self)

    r = CacheAwareRouter()
    r.eviction_interval_s = Interval(60.0)
    r.apply(Tick(ts=1.8e9))
    assert Interval.reads <= 2  # one step, not one per interval
    assert 1.8e9 < r.next_eviction <= 1.8e9 + 60.0
