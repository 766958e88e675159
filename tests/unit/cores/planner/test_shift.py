"""The shift path (issue 41 part 1): a change-point test at slice ends opens a decision between
window ends; the 2-SE rule, the SLO guard and the cooldown still decide."""

from __future__ import annotations

import math

import msgspec
import pytest

from events.catalog import PlanEvaluated, RoleSwitchOrdered
from services.cores.planner.base import SHIFT, plan_path
from services.cores.planner.evolving import EvolvingPlanner
from services.cores.planner.shift import change_point, passed, strongest
from services.drivers.bench.synthetic import Mix, Scenario, drive

SLO_WARM = {"t_uc": 4000, "t_c": 10_000, "t_out": 200, "q": 64, "arrivals_rps": 8}
SLO_DECODE_GROWS = {"t_uc": 4000, "t_c": 10_000, "t_out": 1000, "q": 64, "arrivals_rps": 8}
BALANCED = {"t_uc": 3000, "t_c": 20_000, "t_out": 400, "q": 64}


@pytest.mark.parametrize("older,recent,se,shifted", [
    ([1.0, 1.0, 1.0], [1.0, 1.0], 0.0, False),  # no change
    ([0.0, 1.0, 0.0, 1.0], [3.0, 3.0, 3.0], math.sqrt(1 / 3 / 4), True),  # rise 2.5 > 2 * 0.289
    ([0.0, 2.0, 0.0, 2.0], [2.0, 1.0, 3.0], math.sqrt(1 / 3 + 4 / 3 / 4), False),  # 1.0 < 2 * 0.816
    ([3.0, 3.0], [0.0, 0.0], 0.0, False),  # a fall is no shift toward the signal
])
def test_change_point_is_welch_two_se(older, recent, se, shifted):
    t = change_point("x", older, recent)
    assert t.se == pytest.approx(se) and t.n_older == len(older) and t.n_recent == len(recent)
    assert passed(t) == shifted


def test_change_point_needs_two_slices_a_side_and_strongest_takes_most_se():
    assert change_point("x", [1.0], [2.0, 3.0]) is None and change_point("x", [1.0, 2.0], [3.0]) is None
    a = change_point("a", [0.0, 1.0], [3.0, 4.0])  # rise 3, se 1: 3 SE
    b = change_point("b", [0.0, 1.0], [5.0, 6.0])  # rise 5, se 1: 5 SE
    c = change_point("c", [0.0, 1.0], [0.5, 1.5])  # rise 0.5: does not pass
    assert strongest([a, c, b]).signal == "b" and strongest([c]) is None


def _plans(trace) -> list[PlanEvaluated]:
    return [e for e in trace.outputs if isinstance(e, PlanEvaluated)]


def test_the_slo_guard_holds_on_the_shift_path():
    """The decode work grows at 900 s: the shift path opens decisions, but 1P (the paper's
    throughput-best, whose prefill queue grows without bound) stays vetoed there too."""
    tr = drive(EvolvingPlanner(warmup_s=300, ttft_objective=False),
               Scenario(mixes=[Mix(900, **SLO_WARM), Mix(700, **SLO_DECODE_GROWS)]))
    shifted = [p for p in _plans(tr) if p.shift is not msgspec.UNSET]
    assert shifted and all(plan_path(p.reason) == SHIFT for p in shifted)
    assert all(p.ts < 1500 for p in shifted[:1])  # before the window end that used to decide
    for p in shifted:
        one = {c.split.prefill: c for c in p.candidates}[1]
        assert not one.passed and (p.chosen is None or p.chosen.prefill != 1)
    orders = [e for e in tr.outputs if isinstance(e, RoleSwitchOrdered) and e.ts > 302]
    assert orders and all(e.to_role == "decode" for e in orders)  # toward decode, not to 1P


def test_no_shift_no_event_and_cooldown_applies():
    tr = drive(EvolvingPlanner(warmup_s=300), Scenario(mixes=[Mix(2100, **BALANCED)]))
    assert all(p.shift is msgspec.UNSET for p in _plans(tr))  # a steady mix opens nothing
    # prefill-heavy from 1500 s to 1900 s: the shift path follows it there at 1680.9 and back,
    # but the way back waits for the cooldown (600 s here) at every slice end that sees the shift
    heavy = dict(SLO_WARM, t_uc=12000, t_out=100)
    sc = Scenario(mixes=[Mix(1500, **SLO_WARM), Mix(400, **heavy), Mix(900, **SLO_WARM)])
    tr = drive(EvolvingPlanner(warmup_s=300, cooldown_s=600), sc)
    orders = [e for e in tr.outputs if isinstance(e, RoleSwitchOrdered) and e.ts > 302]
    assert sorted({round(e.ts, 1) for e in orders}) == [1680.9, 2280.9]
    assert {e.to_role for e in orders if e.ts < 2000} == {"prefill"}
    assert {e.to_role for e in orders if e.ts > 2000} == {"decode"}
    cooled = [p for p in _plans(tr) if plan_path(p.reason) == SHIFT and "cooldown" in p.reason]
    assert [round(p.ts, 1) for p in cooled] == [2040.9, 2160.9, 2220.9]
    assert all(p.chosen is None and passed(p.shift) for p in cooled)


def test_warm_up_slices_are_not_compared_with_the_split_that_follows():
    """The mix changes at the warm-up end (300 s): the slices before it ran collocated and are
    no reference, so no shift is published until two slices after the warm-up end are older
    than the recent three (600.9 s); the window end at 900.9 s still decides."""
    decode_heavy = {"t_uc": 500, "t_c": 20_000, "t_out": 2000, "q": 64}
    prefill_heavy = {"t_uc": 8000, "t_c": 2000, "t_out": 100, "q": 64}
    tr = drive(EvolvingPlanner(warmup_s=300),
               Scenario(mixes=[Mix(300, **decode_heavy), Mix(1000, **prefill_heavy)]))
    early = [p for p in _plans(tr) if p.shift is not msgspec.UNSET and p.ts < 600]
    assert early == []
    # the same planner without the exclusion (warm-up end forgotten) sees a shift at once
    p = EvolvingPlanner(warmup_s=300)
    seen = []
    for e in tr.inputs:
        out = p.apply(e)
        if p.st.frozen and "shift_from_k" in p.st.extra:
            del p.st.extra["shift_from_k"]
        seen += [x for x in out if isinstance(x, PlanEvaluated) and x.shift is not msgspec.UNSET]
    assert seen and seen[0].ts < 600
