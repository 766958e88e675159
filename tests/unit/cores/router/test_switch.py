"""Split changes: queued requests of a switching (or removed) node are re-routed, running ones
finish in place, nothing is lost or routed twice."""

from __future__ import annotations

import pytest

from events.catalog import (
    NodeRegistered,
    NodeRemoved,
    RequestStarted,
    RoleSwitched,
    RoleSwitchOrdered,
    RouteDecided,
)
from services.cores.router.least_ttft import LeastTtftRouter
from services.cores.router.load_balancing import RoundRobinRouter
from services.cores.router.state import PREFILLING, QUEUED
from services.drivers.bench import scenario as s


def feed(router, events):
    out = []
    for ev in events:
        out.extend(router.apply(ev))
    return out


def routes(out):
    return [e for e in out if isinstance(e, RouteDecided)]


@pytest.mark.parametrize("cls", [LeastTtftRouter, RoundRobinRouter])
def test_switch_reroutes_queued_never_running(cls):
    r = cls()
    feed(r, s.register(3, 2) + [s.branch("b", 0.0)])
    first = routes(feed(r, [s.submit(f"r{i}", "b", s.blocks(1_000 * i, 20), 1.0) for i in range(9)]))
    on_p00 = [d.request for d in first if d.prefill_node == "p00"]
    assert len(on_p00) == 3
    running = on_p00[0]
    feed(r, [RequestStarted(ts=1.1, request=running, node="p00", phase="prefill")])
    out = routes(feed(r, [RoleSwitchOrdered(ts=2.0, node="p00", from_role="prefill", to_role="decode")]))
    assert [d.request for d in out] == on_p00[1:]  # queue order, the running one stays
    assert all(d.reroute and d.prefill_node in ("p01", "p02") for d in out)
    assert all(d.ts == 2.0 and not d.shadow and d.policy == r.name for d in out)
    st = r.state
    assert st.nodes["p00"].prefill_queue == []
    assert st.nodes["p00"].prefill_running == [running]
    assert st.requests[running].phase == PREFILLING and st.requests[running].prefill_node == "p00"
    # every request is in exactly one queue or running list
    placed = [rid for n in st.nodes.values() for rid in n.prefill_queue + n.prefill_running]
    assert sorted(placed) == sorted(f"r{i}" for i in range(9))
    # no new request goes to the switching node, in either phase, until it switched
    nxt = routes(feed(r, [s.submit("late", "b", s.blocks(99_000, 5), 2.5)]))[0]
    assert nxt.prefill_node != "p00" and nxt.decode_node != "p00"
    feed(r, [RoleSwitched(ts=3.0, node="p00", role="decode")])
    assert "p00" in st.eligible("decode") and "p00" not in st.eligible("prefill")


def test_decode_node_switch_moves_only_decode_of_not_started_requests():
    r = LeastTtftRouter()
    feed(r, s.register(1, 2) + [s.branch("b", 0.0)])
    out = routes(feed(r, [s.submit(f"r{i}", "b", s.blocks(1_000 * i, 5), 1.0) for i in range(4)]))
    assert [d.decode_node for d in out] == ["d00", "d01", "d00", "d01"]
    feed(r, [RequestStarted(ts=1.5, request="r0", node="p00", phase="prefill")])
    moved = routes(feed(r, [RoleSwitchOrdered(ts=2.0, node="d00", from_role="decode", to_role="prefill")]))
    assert [(d.request, d.prefill_node, d.decode_node, d.reroute) for d in moved] == [("r2", "p00", "d01", True)]
    assert r.state.requests["r0"].decode_node == "d00"  # prefill started: stays
    assert r.state.nodes["p00"].prefill_queue == ["r1", "r2", "r3"]  # prefill untouched


def test_removed_node_queue_is_rerouted_and_forgotten():
    r = LeastTtftRouter()
    feed(r, s.register(2, 1) + [s.branch("b", 0.0)])
    out = routes(feed(r, [s.submit(f"r{i}", "b", s.blocks(1_000 * i, 5), 1.0) for i in range(4)]))
    on_p01 = [d.request for d in out if d.prefill_node == "p01"]
    moved = routes(feed(r, [NodeRemoved(ts=2.0, node="p01")]))
    assert [d.request for d in moved] == on_p01
    assert all(d.prefill_node == "p00" and d.reroute for d in moved)
    assert "p01" not in r.state.nodes
    assert sorted(r.state.nodes["p00"].prefill_queue) == [f"r{i}" for i in range(4)]


def test_last_prefill_node_switching_leaves_requests_waiting_then_routes_them():
    r = LeastTtftRouter()
    feed(r, s.register(1, 1) + [s.branch("b", 0.0)])
    feed(r, [s.submit("a", "b", s.blocks(1, 5), 1.0)])
    out = feed(r, [RoleSwitchOrdered(ts=2.0, node="p00", from_role="prefill", to_role="decode")])
    assert [e.kind for e in out] == ["no_prefill_node"]
    assert r.state.unrouted == ["a"] and r.state.requests["a"].phase == "pending"
    out = feed(r, [s.submit("b2", "b", s.blocks(50, 5), 2.5)])
    assert [getattr(e, "kind", None) for e in out] == ["no_prefill_node"]
    late = routes(feed(r, s.register(2, 0, ts=3.0)[1:]))
    assert [(d.request, d.prefill_node, d.reroute) for d in late] == [("a", "p01", True), ("b2", "p01", False)]
    assert r.state.unrouted == []
    assert r.state.requests["a"].phase == QUEUED


def test_restart_in_another_role_reroutes_like_an_ordered_switch():
    r = LeastTtftRouter()
    feed(r, s.register(2, 1) + [s.branch("b", 0.0)])
    out = routes(feed(r, [s.submit(f"r{i}", "b", s.blocks(1_000 * i, 5), 1.0) for i in range(4)]))
    on_p01 = [d.request for d in out if d.prefill_node == "p01"]
    moved = routes(feed(r, [NodeRegistered(ts=2.0, node="p01", role="decode")]))
    assert [d.request for d in moved] == on_p01 and all(d.prefill_node == "p00" for d in moved)
    queue = list(r.state.nodes["p00"].prefill_queue)
    assert queue == ["r0", "r2", "r1", "r3"]
    # a switch nobody ordered still takes the queue off the node: no prefill node is left
    out = feed(r, [RoleSwitched(ts=3.0, node="p00", role="decode")])
    assert routes(out) == [] and [o.kind for o in out] == ["no_prefill_node"] * 4
    assert r.state.unrouted == queue


@pytest.mark.parametrize("mechanism, takes_prefill", [("in_place", True), ("restart", False),
                                                      ("in_place_drop_kv", False)])
def test_in_place_switch_to_prefill_takes_prefills_at_once(mechanism, takes_prefill):
    """METHOD §4.1: an in-place switch only changes which requests the router sends, so a decode
    node switching in place to prefill is a prefill candidate from the order on (its running
    decodes finish there); a restart takes nothing new until it is back."""
    r = LeastTtftRouter()
    feed(r, s.register(1, 2) + [s.branch("b", 0.0)])
    # load the only prefill node, so an eligible idle d00 is the least-TTFT choice
    feed(r, [s.submit(f"r{i}", "b", s.blocks(10_000 * (i + 1), 200), 1.0) for i in range(3)])
    feed(r, [RoleSwitchOrdered(ts=2.0, node="d00", from_role="decode", to_role="prefill", mechanism=mechanism)])
    assert ("prefill" in r.state.nodes["d00"].phases()) is takes_prefill
    assert "decode" not in r.state.nodes["d00"].phases()
    nxt = routes(feed(r, [s.submit("late", "b", s.blocks(99_000, 5), 2.5)]))[0]
    assert (nxt.prefill_node == "d00") is takes_prefill
    assert nxt.decode_node == "d01"
    feed(r, [RoleSwitched(ts=3.0, node="d00", role="prefill")])
    assert r.state.nodes["d00"].phases() == frozenset({"prefill"})


@pytest.mark.parametrize("cls", [LeastTtftRouter, RoundRobinRouter])
def test_a_removed_nodes_running_prefills_are_rerouted_and_prefills_bound_for_it_move_their_decode(cls):
    # seen under chaos: an engine killed mid-prefill left its running requests undecided for good
    r = cls()
    feed(r, s.register(2, 2) + [s.branch("b", 0.0)])
    first = routes(feed(r, [s.submit(f"r{i}", "b", s.blocks(1_000 * i, 20), 1.0) for i in range(4)]))
    by = {d.request: d for d in first}
    on_p00 = [q for q, d in by.items() if d.prefill_node == "p00"]
    elsewhere = [q for q, d in by.items() if d.prefill_node != "p00"]
    feed(r, [RequestStarted(ts=1.1, request=q, node=by[q].prefill_node, phase="prefill") for q in by])
    out = routes(feed(r, [NodeRemoved(ts=2.0, node="p00", reason="restarted")]))
    assert sorted(d.request for d in out) == sorted(on_p00)  # prefilled again, nothing else moved
    assert all(d.reroute and d.prefill_node != "p00" and d.ts == 2.0 for d in out)
    assert r.state.requests[on_p00[0]].phase == QUEUED
    # the decode node of a running prefill elsewhere goes: only its decode moves
    victim = by[elsewhere[0]].decode_node
    moved = routes(feed(r, [NodeRemoved(ts=3.0, node=victim)]))
    bound = [q for q in elsewhere if by[q].decode_node == victim]
    assert bound and sorted(d.request for d in moved if d.request in bound) == sorted(bound)
    assert all(d.reroute and d.decode_node != victim for d in moved)
    assert all(d.prefill_node == by[d.request].prefill_node for d in moved if d.request in bound)
    assert not routes(feed(r, [NodeRemoved(ts=4.0, node=victim)]))  # a second removal moves nothing
