"""A prefill node that registers a GPU tier and no host tier cannot take in fetched KV: the
asynchronous fetch lands in its own host memory first (METHOD.md §4.1, peer L2 -> own L2 -> GPU;
engine/backends/sim/node.py ``_receive``). The least-TTFT router prices such a node with its
own prefix only and plans no fetch to it. Before, it planned one, the fetch never landed and
the prefix was recomputed behind a prediction that took it as cached: ``bench dynamo
--host-kv-tokens 0`` (the mocker's tiers), 108 of 950 requests, P95 TTFT 5.74 s against the
real Dynamo's 3.79 (docs/experiments.md, "Offline in the pressure regime")."""

from __future__ import annotations

import msgspec
import pytest

from events.catalog import NodeRegistered, RouteDecided
from services.cores.router.least_ttft import LeastTtftRouter
from services.cores.router.state import ClusterState, StateSnapshot
from services.drivers.bench import scenario as s

BT = 64
GPU = 1_850_000


def _register(host_tokens: int | None) -> list:
    """Two prefill nodes and a decode node; ``host_tokens`` None: no tier declared."""
    kw = {} if host_tokens is None else {"l1_capacity_tokens": GPU, "l2_capacity_tokens": host_tokens}
    return [NodeRegistered(ts=0.0, node=n, role=r, **kw) for n, r in (("p00", "prefill"), ("p01", "prefill"),
                                                                      ("d00", "decode"))]


def _route(router: LeastTtftRouter, host_tokens: int | None, *, extra: int = 0) -> dict[str, RouteDecided]:
    """p00 holds a 1,500-block prefix (GPU only) and has a 625-block request queued; p01 is idle;
    then a request of that prefix + 10 new blocks. ``extra`` more idle prefill nodes (above
    ``full_scoring_max_nodes`` the pruned scoring runs)."""
    evs = _register(host_tokens)
    kw = {} if host_tokens is None else {"l1_capacity_tokens": GPU, "l2_capacity_tokens": host_tokens}
    evs += [NodeRegistered(ts=0.0, node=f"p{i:02d}", role="prefill", **kw) for i in range(2, 2 + extra)]
    evs += [s.branch("b", 0.0)] + s.store("p00", s.blocks(0, 1_500), 0.5, tiers=("L1",))
    evs.append(s.submit("mid", "b", s.blocks(10_000, 625), 1.0))
    evs.append(s.submit("r", "b", s.blocks(0, 1_500) + s.blocks(20_000, 10), 1.1))
    out = []
    for ev in evs:
        out.extend(router.apply(ev))
    return {e.request: e for e in out if isinstance(e, RouteDecided)}


@pytest.mark.parametrize("host_tokens", [None, 7_400_000])
def test_a_node_with_a_host_tier_or_undeclared_tiers_fetches_the_prefix(host_tokens):
    rd = _route(LeastTtftRouter(), host_tokens)
    assert rd["mid"].prefill_node == "p00"
    r = rd["r"]
    assert r.prefill_node == "p01" and r.t_c == 1_500 * BT  # fetching beats waiting behind "mid"
    assert sum(st.n_blocks for st in r.fetch_plan) == 1_500


@pytest.mark.parametrize("extra", [0, 20])
def test_with_no_host_tier_the_idle_node_is_priced_as_recompute_and_gets_no_fetch_plan(extra):
    rd = _route(LeastTtftRouter(), 0, extra=extra)
    r = rd["r"]
    assert r.prefill_node == "p00"  # waiting behind "mid" beats recomputing 1,500 blocks elsewhere
    assert (r.t_c, r.t_uc) == (1_500 * BT, 10 * BT) and r.fetch_plan == []
    by_node = {sc.node: sc for sc in r.scores}
    assert by_node["p00"].t_c == 1_500 * BT
    assert by_node["p01"].t_c == 0 and by_node["p01"].fetch_excess_s == 0.0
    assert by_node["p01"].score > by_node["p00"].score
    # the same decision as a router told there is no pool at all
    ref = _route(LeastTtftRouter(shared_pool=False), 0, extra=extra)["r"]
    assert (ref.prefill_node, ref.t_c, ref.t_uc, ref.predicted_ttft_s) == (
        r.prefill_node, r.t_c, r.t_uc, r.predicted_ttft_s)


def test_a_recomputing_node_still_wins_when_the_holder_is_far_behind():
    """No host tier does not pin a branch to its holder: behind a long prefill there, the idle
    node recomputes the short prefix (priced as such, no fetch)."""
    router = LeastTtftRouter()
    evs = _register(0) + [s.branch("b", 0.0)] + s.store("p00", s.blocks(0, 20), 0.5, tiers=("L1",))
    evs.append(s.submit("long", "b", s.blocks(10_000, 5_000), 1.0))  # both idle: p00 (the id)
    evs.append(s.submit("r", "b", s.blocks(0, 20) + s.blocks(50_000, 10), 2.0))
    rd = {e.request: e for ev in evs for e in router.apply(ev) if isinstance(e, RouteDecided)}
    assert rd["long"].prefill_node == "p00"
    r = rd["r"]
    assert r.prefill_node == "p01" and (r.t_c, r.t_uc, r.fetch_plan) == (0, 30 * BT, [])


def test_fetch_in_follows_registration_and_survives_a_snapshot():
    st = ClusterState()
    st.apply(NodeRegistered(ts=0.0, node="a", role="prefill", l1_capacity_tokens=GPU, l2_capacity_tokens=0))
    st.apply(NodeRegistered(ts=0.0, node="b", role="prefill", l1_capacity_tokens=GPU, l2_capacity_tokens=1))
    st.apply(NodeRegistered(ts=0.0, node="c", role="prefill"))
    assert [st.nodes[n].fetch_in for n in "abc"] == [False, True, True]
    st.apply(NodeRegistered(ts=1.0, node="a", role="prefill", l1_capacity_tokens=GPU, l2_capacity_tokens=GPU))
    st.apply(NodeRegistered(ts=1.0, node="b", role="prefill", l1_capacity_tokens=GPU, l2_capacity_tokens=0))
    assert [st.nodes[n].fetch_in for n in "ab"] == [True, False]
    snap = msgspec.msgpack.decode(msgspec.msgpack.encode(st.to_snapshot()), type=StateSnapshot)
    back = ClusterState.from_snapshot(snap)
    assert [back.nodes[n].fetch_in for n in "abc"] == [True, False, True]
    # a snapshot written before the field: every node takes fetches, as it did
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(st.to_snapshot()))
    for n in raw["nodes"]:
        del n["fetch_in"]
    old = ClusterState.from_snapshot(msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=StateSnapshot))
    assert all(ns.fetch_in for ns in old.nodes.values())
