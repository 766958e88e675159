"""``+pack``: the least-TTFT router's ``pack_slack`` as a stack part, so a run can put
long cold prefills behind other long work instead of one on every prefill node
(docs/experiments.md, "Head-of-line blocking behind cold prefills"). The packing rule itself is
pinned in tests/unit/cores/router/test_pack.py; here: the part reaches the router of a run, and
what it changes stays inside the rule's bound."""

from __future__ import annotations

import pytest

from replay.sim.simulation import SimConfig
from replay.sim.stacks import PACK_SLACK, get_stack
from tests.unit.replay.sim.test_sim import PROFILE, _cached


def test_the_part_sets_the_least_ttft_routers_pack_slack():
    cfg = SimConfig(nodes=4)
    for spec in ("evolving+pack", "evolving-static:2P2D+pack", "static:2P2D+least_ttft+pack"):
        st = get_stack(spec)
        assert st.router_args == {"pack_slack": PACK_SLACK} and st.name == spec
        router = st.make_cores(PROFILE, cfg)[2]
        assert router.pack_slack == PACK_SLACK, spec
    assert get_stack("evolving").make_cores(PROFILE, cfg)[2].pack_slack == 0.0  # not the default


@pytest.mark.parametrize("spec", ["dynamo+pack", "cache_aware+pack", "static:2P2D+pack"])
def test_the_part_needs_the_least_ttft_router(spec):
    with pytest.raises(KeyError, match="least-TTFT router keyword"):
        get_stack(spec)


def _decisions(run):
    return [e for e in run.log if type(e).__name__ == "RouteDecided" and not e.reroute and e.scores]


def test_packed_choices_stay_within_the_slack_of_the_best_score():
    """Without the part every placement takes the least predicted TTFT; with it some long
    prefills take a longer queue, never beyond ``best + slack x (best's own prefill time)``."""
    plain, packed = _decisions(_cached("evolving")), _decisions(_cached("evolving+pack"))
    assert plain and packed
    for d in plain:
        chosen = next(s for s in d.scores if s.node == d.prefill_node)
        assert chosen.score == min(s.score for s in d.scores), d.request
    moved = 0
    for d in packed:
        best = min(d.scores, key=lambda s: (s.score, s.node))
        chosen = next(s for s in d.scores if s.node == d.prefill_node)
        own = best.score - best.queue_s  # >= the best node's prefill time (fetch excess, dup cost)
        assert chosen.score <= best.score + PACK_SLACK * own + 1e-9, d.request
        if chosen.node != best.node:
            moved += 1
            assert chosen.queue_s > best.queue_s, d.request  # it joined longer work
    assert moved > 0  # the part changed placements in this run
