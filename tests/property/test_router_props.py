"""Router invariants under random streams (hypothesis): nothing lost, nothing routed twice,
never a decision to a node that does not take the phase, re-routes only of queued requests,
the queue prediction is the sum of its parts, and the same events give the same bytes."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.catalog import (
    FirstToken,
    NodeRegistered,
    NodeRemoved,
    RequestFinished,
    RequestStarted,
    RoleSwitched,
    RoleSwitchOrdered,
    RouteDecided,
)
from services.adapters.plugins import load_router
from services.cores.router.state import DECODING, PENDING, PREFILLING, QUEUED
from services.drivers.bench import scenario as s
from tests.hyp import examples

NODES = ["p00", "p01", "p02", "d00", "d01", "c00"]
ROLES = ["prefill", "decode", "collocated"]

op = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 3), st.integers(0, 6), st.integers(0, 3)),
    st.tuples(st.just("start"), st.integers(0, 50)),
    st.tuples(st.just("first"), st.integers(0, 50)),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("switch"), st.integers(0, 5), st.sampled_from(ROLES)),
    st.tuples(st.just("switched"), st.integers(0, 5)),
    st.tuples(st.just("remove"), st.integers(0, 5)),
    st.tuples(st.just("register"), st.integers(0, 5), st.sampled_from(ROLES)),
    st.tuples(st.just("store"), st.integers(0, 5), st.integers(0, 3), st.integers(1, 6)),
)


def _pick(ids: list[str], k: int) -> str | None:
    return ids[k % len(ids)] if ids else None


def drive(router, ops):
    """Interpret ops against the router's own state; return (events fed, outputs per event)."""
    evs = s.register(2, 1) + [NodeRegistered(ts=0.0, node="c00", role="collocated")]
    evs += [s.branch(f"b{i}", 0.0) for i in range(3)]  # b3 stays unknown
    fed, outs = [], []
    pending_switch: dict[str, str] = {}
    n = 0
    ts = 0.0

    def feed(ev):
        fed.append(ev)
        outs.append(router.apply(ev))

    for ev in evs:
        feed(ev)
    for o in ops:
        ts += 0.01
        st_ = router.state
        kind = o[0]
        if kind == "submit":
            _, b, pre, new = o
            blocks = s.blocks(1_000 * (b + 1), pre) + s.blocks(100_000 + 10 * n, new)
            feed(s.submit(f"r{n}", f"b{b}", blocks, ts))
            n += 1
        elif kind in ("start", "first", "finish"):
            want = {"start": QUEUED, "first": PREFILLING, "finish": DECODING}[kind]
            rid = _pick(sorted(r for r, x in st_.requests.items() if x.phase == want), o[1])
            if rid is None:
                continue
            r = st_.requests[rid]
            if kind == "start":
                if r.prefill_node not in st_.nodes:
                    continue
                feed(RequestStarted(ts=ts, request=rid, node=r.prefill_node, phase="prefill"))
            elif kind == "first":
                feed(FirstToken(ts=ts, request=rid, node=r.prefill_node))
            else:
                feed(RequestFinished(ts=ts, request=rid, node=r.decode_node or "d00"))
        elif kind == "switch":
            node = NODES[o[1]]
            if node in st_.nodes and node not in pending_switch and st_.nodes[node].role != o[2]:
                pending_switch[node] = o[2]
                feed(RoleSwitchOrdered(ts=ts, node=node, from_role=st_.nodes[node].role, to_role=o[2]))
        elif kind == "switched":
            node = NODES[o[1]]
            if node in pending_switch and node in st_.nodes:
                feed(RoleSwitched(ts=ts, node=node, role=pending_switch.pop(node)))
        elif kind == "remove":
            node = NODES[o[1]]
            if node in st_.nodes:
                pending_switch.pop(node, None)
                feed(NodeRemoved(ts=ts, node=node))
        elif kind == "register":
            node = NODES[o[1]]
            if node not in st_.nodes:
                feed(NodeRegistered(ts=ts, node=node, role=o[2]))
        elif kind == "store":
            node = NODES[o[1]]
            if node in st_.nodes:
                for ev in s.store(node, s.blocks(1_000 * (o[2] + 1), o[3]), ts):
                    feed(ev)
    return fed, outs


def check(router, fed, outs):
    submitted = [e.request for e in fed if type(e).__name__ == "RequestSubmitted"]
    first = {}
    # replay phases to check each decision against what the node took at that moment
    for ev, out in zip(fed, outs):
        for o in out:
            if not isinstance(o, RouteDecided):
                continue
            assert not o.shadow and o.policy == router.name
            if o.reroute:
                assert o.request in first, "a re-route of a request never routed"
            else:
                assert o.request not in first, f"{o.request} routed twice"
                first[o.request] = o
    st_ = router.state
    # every live request is in exactly one place
    for rid in submitted:
        r = st_.requests.get(rid)
        if r is None:
            continue  # finished
        places = [n for n, ns in st_.nodes.items() if rid in ns.prefill_queue]
        running = [n for n, ns in st_.nodes.items() if rid in ns.prefill_running]
        if r.phase == QUEUED:
            assert places == [r.prefill_node] and not running and rid not in st_.unrouted
            assert "prefill" in st_.nodes[r.prefill_node].phases(), "queued on a node that stopped prefill"
        elif r.phase == PENDING:
            assert not places and not running
            assert rid in st_.unrouted or not st_.eligible("prefill") or rid not in first
        elif r.phase == PREFILLING:
            assert not places and running in ([r.prefill_node], [])
        else:
            assert not places and not running
    assert len(set(st_.unrouted)) == len(st_.unrouted)
    for ns in st_.nodes.values():
        assert len(set(ns.prefill_queue)) == len(ns.prefill_queue)
        total = sum(st_.requests[rid].service_s for rid in ns.prefill_queue)
        assert ns.queue_s == pytest.approx(total, rel=1e-9, abs=1e-9)
        assert ns.decode_tokens == sum(st_.requests[rid].max_tokens for rid in ns.decode_assigned)
    # every submitted request got a first decision unless no prefill node could take it
    for rid in submitted:
        if rid not in first:
            assert router.anomalies.get("no_prefill_node", 0) > 0


def check_targets(fed, outs, make):
    """Replayed on a fresh router: same bytes, and each decision's nodes take that phase then."""
    again = make()
    for ev, out in zip(fed, outs):
        got = again.apply(ev)
        assert [msgspec.msgpack.encode(o) for o in got] == [msgspec.msgpack.encode(o) for o in out]
        prefill_ok = set(again.state.eligible("prefill"))
        decode_ok = set(again.state.eligible("decode"))
        for o in out:
            if isinstance(o, RouteDecided):
                assert o.prefill_node in prefill_ok, f"{o.request} to {o.prefill_node}, not taking prefill"
                assert o.decode_node in decode_ok or o.decode_node == o.prefill_node


ROUTERS = ["evolving", "cache_aware", "sticky", "round_robin", "least_loaded", "dynamo_kv"]


@pytest.mark.parametrize("name", ROUTERS)
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=5, max_size=60))
def test_router_invariants(name, ops):
    make = load_router(name)
    router = make()
    fed, outs = drive(router, ops)
    check(router, fed, outs)
    check_targets(fed, outs, make)


@settings(max_examples=examples(30), deadline=None)
@given(ops=st.lists(op, min_size=5, max_size=60), cut=st.integers(0, 100))
def test_snapshot_restore_is_transparent(ops, cut):
    make = load_router("evolving")
    a = make()
    fed, outs = drive(a, ops)
    k = min(cut, len(fed))
    b = make()
    for ev in fed[:k]:
        b.apply(ev)
    c = make.from_snapshot(b.snapshot())
    assert c.snapshot() == b.snapshot()
    tail = [msgspec.msgpack.encode(o) for ev in fed[k:] for o in c.apply(ev)]
    assert tail == [msgspec.msgpack.encode(o) for out in outs[k:] for o in out]
    assert c.snapshot() == a.snapshot()
