"""Candidate pruning of the least-TTFT router: on random cluster states (many nodes,
random queues, running batches, KV holders in both tiers, per-node fitted models and token
budgets, fetch parameters), the pruned decision equals full scoring's: same prefill node,
``t_c``/``t_uc``, predicted TTFT, fetch plan, decode node, and every score it lists is the one
full scoring computes for that node."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.catalog import ModelFitted, NodeRegistered, RequestStarted, RouteDecided
from services.cores.router.least_ttft import LeastTtftRouter
from services.drivers.bench import scenario as s
from tests.hyp import examples

coef = st.tuples(st.floats(1e-3, 5e-2), st.floats(1e-6, 1e-4), st.floats(0.0, 1e-9), st.floats(0.0, 1e-6))


@st.composite
def cluster(draw):
    n_pre = draw(st.integers(1, 40))
    n_dec = draw(st.integers(1, 4))
    budgets = st.sampled_from([2048, 8192, 16384])
    evs = [NodeRegistered(ts=0.0, node=s.prefill_id(i), role="prefill", prefill_token_budget=draw(budgets))
           for i in range(n_pre)]
    evs += [NodeRegistered(ts=0.0, node=s.decode_id(i), role="decode") for i in range(n_dec)]
    # a few distinct fitted models shared by groups of nodes, the rest on the prior
    models = draw(st.lists(coef, min_size=0, max_size=3))
    for i in range(n_pre):
        k = draw(st.integers(-1, len(models) - 1))
        if k >= 0:
            evs.append(ModelFitted(ts=0.0, node=s.prefill_id(i), phase="prefill", coefficients=list(models[k]),
                                   samples=10))
    agents = draw(st.integers(1, 5))
    evs += [s.branch(f"a{a}", 0.0) for a in range(agents)]
    contexts = [s.blocks((a + 1) << 20, draw(st.integers(1, 60))) for a in range(agents)]
    # KV: prefixes of the contexts on random nodes and tiers (some nodes hold several)
    for _ in range(draw(st.integers(0, 12))):
        a = draw(st.integers(0, agents - 1))
        k = draw(st.integers(1, len(contexts[a])))
        node = s.prefill_id(draw(st.integers(0, n_pre - 1)))
        tiers = draw(st.sampled_from([("L1",), ("L2",), ("L1", "L2")]))
        evs += s.store(node, contexts[a][:k], 0.0, tiers)
    # queues and running batches: requests placed by someone else ("history")
    ts = 0.0
    for i in range(draw(st.integers(0, 60))):
        ts += draw(st.floats(0.0, 0.05))
        a = draw(st.integers(0, agents - 1))
        p = s.prefill_id(draw(st.integers(0, n_pre - 1)))
        evs.append(s.submit(f"h{i}", f"a{a}", contexts[a] + s.blocks(1 << 40 | i << 10, draw(st.integers(0, 40))), ts))
        t_c = draw(st.integers(0, 4)) * 64
        evs.append(s.routed(f"h{i}", p, s.decode_id(i % n_dec), ts, t_c=t_c,
                            t_uc=draw(st.integers(1, 20_000)), branch=f"a{a}"))
        if draw(st.booleans()):
            evs.append(RequestStarted(ts=ts, request=f"h{i}", node=p, phase="prefill"))
    probe_agent = draw(st.integers(0, agents - 1))
    probe = contexts[probe_agent] + s.blocks(1 << 50, draw(st.integers(0, 30)))
    now = ts + draw(st.floats(0.0, 2.0))
    params = {
        "fetch_latency_s": draw(st.sampled_from([0.0, 0.002, 0.5])),
        "fetch_s_per_token": draw(st.sampled_from([0.0, 4e-7, 1e-4])),
        "dup_cost_s_per_token": draw(st.sampled_from([0.0, 2e-7, 1e-3])),
        "pack_slack": draw(st.sampled_from([0.0, 0.0, 0.5, 3.0])),
    }
    return evs, f"a{probe_agent}", probe, now, params


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cluster())
def test_pruned_decision_equals_full_scoring(case):
    evs, branch, probe, now, params = case
    # shadow routers: the history's decisions are acting, their own are only emitted, so both
    # see the same state and the probe's decision is the one compared
    pruned = LeastTtftRouter(full_scoring_max_nodes=0, shadow=True, **params)
    full = LeastTtftRouter(full_scoring_max_nodes=10**9, shadow=True, **params)
    decided = []
    for router in (pruned, full):
        for ev in evs:
            router.apply(ev)
        out = router.apply(s.submit("probe", branch, probe, now))
        decided.append(next(o for o in out if isinstance(o, RouteDecided)))
    a, b = decided
    assert (a.prefill_node, a.decode_node, a.t_c, a.t_uc, a.predicted_ttft_s, a.fetch_plan) == (
        b.prefill_node, b.decode_node, b.t_c, b.t_uc, b.predicted_ttft_s, b.fetch_plan)
    full_scores = {x.node: x for x in b.scores}
    assert len(b.scores) == len(full.state.eligible("prefill"))
    assert a.scores and all(full_scores[x.node] == x for x in a.scores)
    assert a.prefill_node in {x.node for x in a.scores}
