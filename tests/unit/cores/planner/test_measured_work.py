"""The window's per-request prefill work is what the engine found cached at prefill start, not
the router's plan: reuse lost while a request queued (its KV evicted, a fetch that found no
room) is prefill work the planner must see (the KV-pressure deviation)."""

from __future__ import annotations

import pytest

from events.catalog import RequestFinished, RequestStarted, RouteDecided
from services.cores.planner.evolving import EvolvingPlanner
from services.cores.planner.window import SliceStats


def route(r: str, ts: float, t_uc: int, t_c: int, **kw) -> RouteDecided:
    return RouteDecided(ts=ts, request=r, prefill_node="p0", decode_node="d0", t_uc=t_uc, t_c=t_c, **kw)


def started(r: str, ts: float, cached: int, phase: str = "prefill") -> RequestStarted:
    return RequestStarted(ts=ts, request=r, node="p0", phase=phase, cached_tokens=cached)


def fresh(pairs) -> SliceStats:
    s = SliceStats()
    for t_uc, t_c in pairs:
        s.on_route(t_uc, t_c)
    return s


def test_work_of_a_request_is_corrected_to_what_its_prefill_found():
    p = EvolvingPlanner()
    p.apply(route("a", 1.0, t_uc=1_000, t_c=9_000))
    p.apply(route("b", 2.0, t_uc=500, t_c=0))
    p.apply(started("a", 20.0, cached=2_000))  # 7,000 planned cached tokens were lost in the queue
    p.apply(started("b", 21.0, cached=0))  # as planned
    s = p.st.slices[0]
    want = fresh([(8_000, 2_000), (500, 0)])
    for w in (19.0, 19.0):  # each waited 19 s from its route to its prefill start (issue 41)
        want.on_wait(w)
    for f in SliceStats.__struct_fields__:
        assert getattr(s, f) == pytest.approx(getattr(want, f)), f
    assert s.waited == 2 and s.sum_wait_s == pytest.approx(38.0)
    assert p.st.routed_work == {}


def test_decode_starts_shadow_and_reroutes_change_nothing_and_finished_requests_are_forgotten():
    p = EvolvingPlanner()
    p.apply(route("a", 1.0, t_uc=1_000, t_c=9_000))
    p.apply(route("a", 1.5, t_uc=10_000, t_c=0, shadow=True))
    p.apply(route("a", 2.0, t_uc=10_000, t_c=0, reroute=True))
    p.apply(started("a", 3.0, cached=0, phase="decode"))
    before = fresh([(1_000, 9_000)])
    assert p.st.slices[0].sum_t_c == before.sum_t_c and p.st.slices[0].sum_A == before.sum_A
    p.apply(route("x", 4.0, t_uc=100, t_c=0))
    p.apply(RequestFinished(ts=5.0, request="x", node="p0", error="engine"))
    assert set(p.st.routed_work) == {"a"}


def test_cached_tokens_beyond_the_prompt_are_clamped():
    p = EvolvingPlanner()
    p.apply(route("a", 1.0, t_uc=100, t_c=900))
    p.apply(started("a", 2.0, cached=5_000))
    assert p.st.slices[0].sum_t_uc == 0 and p.st.slices[0].sum_t_c == 1_000


def test_a_late_start_after_its_window_closed_is_dropped_and_the_snapshot_round_trips():
    p = EvolvingPlanner()
    p.apply(route("a", 1.0, t_uc=100, t_c=900))
    q = EvolvingPlanner.from_snapshot(p.snapshot())
    assert q.st.routed_work == {"a": [0, 100, 900, 1000]}  # the route time in ms (issue 41)
    p._close_window(p.cfg.slices)
    assert p.st.routed_work == {}
    p.apply(started("a", 700.0, cached=0))  # no slice to correct, no error
