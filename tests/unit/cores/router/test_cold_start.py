"""Cold start: unknown branch, no blocks, no nodes: a decision (or a wait) and an anomaly count."""

from __future__ import annotations

import pytest

from events.catalog import AnomalyReported, RouteDecided
from services.adapters.plugins import load_router
from services.cores.costmodel import PRIOR_PREFILL
from services.drivers.bench import scenario as s

NAMES = ["evolving", "cache_aware", "sticky", "round_robin", "least_loaded", "dynamo_kv"]


@pytest.mark.parametrize("name", NAMES)
def test_unknown_branch_and_no_blocks_still_get_a_decision(name):
    r = load_router(name)()
    for ev in s.register(2, 1):
        r.apply(ev)
    out = r.apply(s.submit("x", "never-opened", [], 1.0, extra_tokens=40))
    kinds = [o.kind for o in out if isinstance(o, AnomalyReported)]
    rds = [o for o in out if isinstance(o, RouteDecided)]
    assert kinds == ["unknown_branch", "no_blocks"]
    assert r.anomalies == {"unknown_branch": 1, "no_blocks": 1}
    assert len(rds) == 1
    rd = rds[0]
    assert (rd.prefill_node, rd.decode_node, rd.t_c, rd.t_uc, rd.fetch_plan) == ("p00", "d00", 0, 40, [])
    assert rd.predicted_ttft_s == pytest.approx(PRIOR_PREFILL.request_s(40, 0))
    assert all(o.component == f"router.{name}" and o.ref == "x" for o in out if isinstance(o, AnomalyReported))


def test_known_branch_with_blocks_raises_no_anomaly():
    r = load_router("evolving")()
    out = [o for ev in s.register(1, 1) + [s.branch("b", 0.0), s.submit("x", "b", s.blocks(1, 2), 1.0)]
           for o in r.apply(ev)]
    assert [type(o).__name__ for o in out] == ["RouteDecided"]
    assert r.anomalies == {}


def test_no_nodes_then_nodes_join():
    r = load_router("evolving")()
    out = r.apply(s.branch("b", 0.0)) + r.apply(s.submit("x", "b", s.blocks(1, 2), 1.0))
    assert [o.kind for o in out] == ["no_prefill_node"]
    assert r.anomalies == {"no_prefill_node": 1}
    # a decode node alone cannot take it
    assert r.apply(s.register(0, 1, ts=2.0)[0]) == []
    out = r.apply(s.register(1, 0, ts=3.0)[0])
    assert [(o.request, o.prefill_node, o.decode_node, o.ts, o.reroute) for o in out] == [("x", "p00", "d00", 3.0, False)]


def test_no_decode_node_decodes_on_the_prefill_node_and_counts_it():
    r = load_router("round_robin")()
    out = [o for ev in s.register(1, 0) + [s.branch("b", 0.0), s.submit("x", "b", s.blocks(1, 2), 1.0)]
           for o in r.apply(ev)]
    rd = next(o for o in out if isinstance(o, RouteDecided))
    assert (rd.prefill_node, rd.decode_node) == ("p00", "p00")
    assert r.anomalies == {"no_decode_node": 1}


def test_block_size_mismatch_is_reported_and_still_decided():
    r = load_router("evolving")(block_tokens=16)
    out = [o for ev in s.register(1, 1) + [s.branch("b", 0.0), s.submit("x", "b", s.blocks(1, 2), 1.0)]
           for o in r.apply(ev)]
    assert [type(o).__name__ for o in out] == ["AnomalyReported", "RouteDecided"]
    assert r.anomalies == {"block_tokens_mismatch": 1}
