"""``pack_slack``: a long prefill joins other long work instead of the short queue (the
fixed-4P5D ablation: docs/router.md "Long requests and the short queue")."""

from __future__ import annotations

import pytest

from events.catalog import RouteDecided
from services.cores.costmodel import PRIOR_PREFILL
from services.cores.router.least_ttft import LeastTtftRouter
from services.drivers.bench import scenario as s

BT = 64


def feed(router, events):
    out = []
    for ev in events:
        out.extend(router.apply(ev))
    return out


def stream() -> list:
    """p00 has a 40K-token request queued (~1.3 s), p01 is idle; then a cold 100K-token request
    (~3.5 s of prefill), then a short one (1 block)."""
    evs = s.register(2, 1) + [s.branch("b", 0.0)]
    evs.append(s.submit("mid", "b", s.blocks(10_000, 625), 1.0))
    evs.append(s.submit("long", "b", s.blocks(100_000, 1_563), 2.0))
    evs.append(s.submit("short", "b", s.blocks(500_000, 1), 2.1))
    return evs


def routes(router) -> dict[str, RouteDecided]:
    return {e.request: e for e in feed(router, stream()) if isinstance(e, RouteDecided)}


def test_least_ttft_puts_the_long_request_on_the_idle_node_and_the_short_one_waits():
    rd = routes(LeastTtftRouter())
    assert rd["mid"].prefill_node == "p00"
    assert rd["long"].prefill_node == "p01"  # 3.5 s idle beats 1.3 + 3.5 s
    assert rd["short"].prefill_node == "p00"  # behind the 40K request
    assert rd["short"].predicted_ttft_s > 1.0


def test_pack_slack_puts_the_long_request_behind_long_work_and_keeps_the_short_queue_short():
    rd = routes(LeastTtftRouter(pack_slack=0.5))
    long_s = PRIOR_PREFILL.request_s(1_563 * BT, 0)
    mid_s = PRIOR_PREFILL.request_s(625 * BT, 0)
    assert mid_s < 0.5 * long_s  # within the tolerance
    assert rd["long"].prefill_node == "p00"
    assert rd["long"].predicted_ttft_s == pytest.approx(mid_s + long_s)
    assert rd["short"].prefill_node == "p01"
    assert rd["short"].predicted_ttft_s < 0.05
    # the long request's score list still shows the least-TTFT node (explainable in SQL)
    by_node = {sc.node: sc.score for sc in rd["long"].scores}
    assert by_node["p01"] < by_node["p00"] <= by_node["p01"] + 0.5 * long_s


def test_pack_slack_leaves_a_short_requests_choice_alone():
    """A short request's tolerance is a fraction of its own short prefill: it still takes the
    least predicted TTFT when the other queue is longer than that."""
    r = LeastTtftRouter(pack_slack=1.0)
    evs = s.register(2, 1) + [s.branch("b", 0.0), s.submit("mid", "b", s.blocks(10_000, 625), 1.0),
                               s.submit("short", "b", s.blocks(500_000, 4), 1.1)]
    rd = {e.request: e for e in feed(r, evs) if isinstance(e, RouteDecided)}
    assert (rd["mid"].prefill_node, rd["short"].prefill_node) == ("p00", "p01")


def test_pack_slack_must_be_a_finite_non_negative_number():
    with pytest.raises(ValueError, match="pack_slack"):
        LeastTtftRouter(pack_slack=-0.1)
    with pytest.raises(ValueError, match="pack_slack"):
        LeastTtftRouter(pack_slack=float("nan"))
