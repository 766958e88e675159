"""The router's wait under the ``short_first`` queue order (queue_order.py): exact sums on a
hand-built cluster, the fold that feeds it, and the choice it changes."""

from __future__ import annotations

import pytest

from events.catalog import RouteDecided
from services.cores.costmodel import PRIOR_PREFILL
from services.cores.router.least_ttft import LeastTtftRouter
from services.cores.router.queue_order import short_first_wait_s
from services.cores.router.state import PREFILLING, QUEUED, ClusterState, NodeState, RequestState
from services.drivers.bench import scenario as s

AGING, LONG_S, SHARE = 1.0, 5.0, 0.5


def cluster(running: list[tuple[str, float, float, float]], queued: list[tuple[str, float, float]]) -> ClusterState:
    """One prefill node p00: ``running`` (id, service_s, queued_ts, started_ts), ``queued`` (id,
    service_s, queued_ts) in queue order."""
    st = ClusterState()
    ns = st.nodes["p00"] = NodeState(node="p00", role="prefill")
    for rid, svc, q, started in running:
        st.requests[rid] = RequestState(request=rid, phase=PREFILLING, prefill_node="p00", service_s=svc,
                                        queued_ts=q, started_ts=started)
        ns.prefill_running.append(rid)
    for rid, svc, q in queued:
        st.requests[rid] = RequestState(request=rid, phase=QUEUED, prefill_node="p00", service_s=svc, queued_ts=q)
        ns.prefill_queue.append(rid)
    return st


def wait(st: ClusterState, now: float, own: float, share: float = SHARE) -> float:
    return short_first_wait_s(st, "p00", now, own, AGING, LONG_S, share)


@pytest.mark.parametrize(("running", "queued", "now", "own", "expected"), [
    ([], [], 10.0, 1.0, 0.0),  # idle
    ([], [("a", 0.5, 10.0), ("b", 2.0, 10.0)], 10.0, 1.0, 0.5),  # only the shorter one is ahead
    ([], [("a", 0.5, 10.0), ("b", 2.0, 10.0)], 10.0, 3.0, 2.5),  # both shorter: FCFS's sum
    ([], [("b", 2.0, 9.0)], 10.0, 1.0, 2.0),  # b waited 1 s: key 1.0 <= 1.0, aged ahead
    ([], [("b", 2.0, 9.5)], 10.0, 1.0, 0.0),  # key 1.5 > 1.0: behind
    # a running request's remaining service counts: 3.0 - (10 - 8) = 1.0
    ([("r", 3.0, 8.0, 8.0)], [], 10.0, 2.0, 1.0),
    # a long running prefill (50 s left) takes at most half of the node while a short one waits:
    # it adds the short work ahead plus the request's own service, not its 50 s
    ([("L", 60.0, 0.0, 10.0)], [("a", 0.5, 20.0)], 20.0, 1.0, 0.5 + 1.5),
    # ... and no more than it has left (5.5 s, against 4 + 4 + 4.5 s of short work)
    ([("L", 60.0, 0.0, 0.0)], [("a", 4.0, 54.5), ("b", 4.0, 54.5)], 54.5, 4.5, 8.0 + 5.5),
    # a long request waits for the short work and the long work aged ahead of it, not the rest
    ([], [("a", 0.5, 10.0), ("L1", 20.0, 0.0), ("L2", 30.0, 10.0)], 10.0, 12.0, 0.5 + 20.0),
])
def test_short_first_wait_is_the_work_ahead(running, queued, now, own, expected):
    assert wait(cluster(running, queued), now, own) == pytest.approx(expected)


@pytest.mark.parametrize(("running", "queued", "now", "own", "expected"), [
    # L (5.5 s, queued at 0) is long for 0.5 s more: half of a's 0.5 s and the request's 1 s
    # covers it, then it is short and aged ahead of the request (5 - 12 <= 1): its last 5 s
    # run whole (the old rule: 0.5 + min(5.5, 1.5) = 2.0)
    ([], [("a", 0.5, 12.0), ("L", 5.5, 0.0)], 12.0, 1.0, 0.5 + 5.0 + 0.5),
    # the same L queued now has not aged: short at 5 s against the request's 1 s, it stays behind
    ([], [("a", 0.5, 12.0), ("L", 5.5, 12.0)], 12.0, 1.0, 0.5 + 1.5),
    # a running L with 5.2 s left (started 8.5 s ago): 0.2 s long, then its 5 s whole
    ([("L", 13.7, 0.0, 0.0)], [], 8.5, 0.6, 5.0 + 0.2),
    # two long ones in the engine's order (keys -6.5, -3): L2's 0.5 s above fits the 1.5 s
    # share and its tail runs whole; L1's 4 s above does not, it keeps its share
    ([], [("a", 0.5, 12.0), ("L1", 9.0, 0.0), ("L2", 5.5, 0.0)], 12.0, 1.0, 0.5 + 5.0 + 1.5),
    # a long request that ends its long part too late to matter keeps the old bound
    ([], [("a", 0.5, 12.0), ("L", 7.0, 0.0)], 12.0, 1.0, 0.5 + 1.5),
])
def test_a_long_request_short_and_aged_ahead_before_the_request_is_done_runs_its_last_long_s_whole(
        running, queued, now, own, expected):
    assert wait(cluster(running, queued), now, own) == pytest.approx(expected)


def test_the_tail_moves_a_choice():
    """p00 runs a 300K-token cold prefill (13.7 s at the prior) since 0, p01 another since 3 s,
    with a 2K-token request queued. At 8.5 s a 19K-token request (0.61 s) arrives: p00's
    prefill is long for 0.24 s more, which the request's share covers, and has aged ahead: its
    last 5 s run whole before the request there, so p01 (whose prefill is long for 3.2 s
    more) is the shorter wait. The old rule charged p00 only the long share (0.61 s) against
    p01's x and share of x + own (0.63 s) and chose p00."""
    r = LeastTtftRouter(prefill_order="short_first", order_aging=AGING, order_long_s=LONG_S, order_long_share=SHARE)
    assert feed(r, s.register(2, 1) + [s.branch("b", 0.0), s.submit("L0", "b", s.blocks(1, 4_700), 0.0)])[0] \
        .prefill_node == "p00"
    assert feed(r, [s.submit("L1", "b", s.blocks(10_000, 4_700), 0.0)])[0].prefill_node == "p01"
    feed(r, s.lifecycle("L0", "p00", "d00", 0.0)[:1] + s.lifecycle("L1", "p01", "d00", 3.0)[:1])
    feed(r, [s.submit("x", "b", s.blocks(20_000, 30), 8.4), s.routed("x", "p01", "d00", 8.4)])
    assert r.state.nodes["p01"].prefill_queue == ["x"]
    (w,) = feed(r, [s.submit("w", "b", s.blocks(30_000, 300), 8.5)])
    long_s = PRIOR_PREFILL.request_s(4_700 * 64, 0)
    own = PRIOR_PREFILL.request_s(300 * 64, 0)
    x = r.state.requests["x"].service_s  # as its RouteDecided priced it (t_uc 0: the fixed cost)
    by_node = {sc.node: sc for sc in w.scores}
    assert by_node["p00"].queue_s == pytest.approx(long_s - 8.5)  # the 0.24 s shared, then 5 s whole
    assert by_node["p01"].queue_s == pytest.approx(x + (x + own))  # x, and L1's share of x + own
    assert own < x + (x + own) < long_s - 8.5  # the old rule's p00 (own) beat p01
    assert w.prefill_node == "p01"


def test_a_long_share_of_one_is_fcfs_for_the_long_work():
    st = cluster([("L", 60.0, 0.0, 10.0)], [("a", 0.5, 20.0)])
    assert wait(st, 20.0, 1.0, share=1.0) == pytest.approx(0.5 + 50.0)


def test_the_fold_records_when_a_request_was_queued_and_started():
    r = LeastTtftRouter()
    feed(r, s.register(1, 1) + [s.branch("b", 0.0), s.submit("a", "b", s.blocks(1, 10), 1.0)])
    assert r.state.requests["a"].queued_ts == 1.0
    feed(r, s.lifecycle("a", "p00", "d00", 2.5)[:1])
    assert r.state.requests["a"].started_ts == 2.5


def feed(router, events):
    out = []
    for ev in events:
        out.extend(router.apply(ev))
    return [e for e in out if isinstance(e, RouteDecided)]


def test_short_first_sends_a_short_request_to_the_node_busy_with_a_long_prefill():
    """p00 runs a 300K-token cold prefill (13.7 s at the prior), four 19K-token requests arrive,
    then a 1K-token one. FCFS pricing sees p00 blocked for the long prefill's whole service and
    queues every later request on p01; under short_first they run between its chunks."""
    chosen = {}
    for order in ("fcfs", "short_first"):
        r = LeastTtftRouter(prefill_order=order, order_aging=AGING, order_long_s=LONG_S, order_long_share=SHARE)
        out = feed(r, s.register(2, 1) + [s.branch("b", 0.0), s.submit("long", "b", s.blocks(1, 4_700), 1.0)])
        assert out[0].prefill_node == "p00"
        feed(r, s.lifecycle("long", "p00", "d00", 1.5)[:1])
        out = feed(r, [s.submit(f"m{i}", "b", s.blocks(10_000 + 1_000 * i, 300), 2.0 + 0.1 * i) for i in range(4)])
        out += feed(r, [s.submit("w", "b", s.blocks(90_000, 16), 3.0)])
        chosen[order] = {rd.request: rd for rd in out}
        state = r.state
    assert [chosen["fcfs"][m].prefill_node for m in ("m0", "m1", "m2", "m3", "w")] == ["p01"] * 5
    # short_first: m1 on p00 (its 0.6 s plus an equal long share beat waiting for m0), w too
    assert [chosen["short_first"][m].prefill_node for m in ("m0", "m1", "m2", "m3", "w")] == \
        ["p01", "p00", "p01", "p01", "p00"]
    m1 = PRIOR_PREFILL.request_s(300 * 64, 0)
    own = PRIOR_PREFILL.request_s(16 * 64, 0)
    assert state.requests["m1"].service_s == pytest.approx(m1)
    w = chosen["short_first"]["w"]
    by_node = {sc.node: sc for sc in w.scores}
    # m1 (aged ahead) and the long one's share of m1 + w, not its 12 s left
    assert by_node["p00"].queue_s == pytest.approx(m1 + (m1 + own))
    assert w.predicted_ttft_s == pytest.approx(m1 + (m1 + own) + own)
    assert w.predicted_ttft_s < chosen["fcfs"]["w"].predicted_ttft_s


def test_an_unknown_order_is_refused():
    with pytest.raises(ValueError, match="prefill_order"):
        LeastTtftRouter(prefill_order="lifo")


def test_a_stack_prices_its_routers_queue_in_the_order_its_engines_serve():
    """The router of a stack whose prefill nodes serve ``short_first`` gets that order and the
    engine's constants; ``+fcfs`` (and every baseline, whose engines serve FCFS) keeps eq. 7."""
    from engine.backends.sim import prefill_order as po
    from replay.sim.simulation import SimConfig
    from replay.sim.stacks import get_stack
    from tests.unit.replay.sim.test_sim import PROFILE

    cfg = SimConfig(nodes=4)
    router = get_stack("evolving").make_cores(PROFILE, cfg)[2]
    assert (router.prefill_order, router.order_aging, router.order_long_s, router.order_long_share) == \
        ("short_first", po.AGING, po.LONG_S, po.LONG_SHARE)
    assert get_stack("evolving+fcfs").make_cores(PROFILE, cfg)[2].prefill_order == "fcfs"
    assert get_stack("static:2P2D+least_ttft").make_cores(PROFILE, cfg)[2].prefill_order == "fcfs"
    assert not hasattr(get_stack("dynamo").make_cores(PROFILE, cfg)[2], "prefill_order")
