"""Eq. 5 bounded by a closed loop's arrivals (evaluate.closed_loop_bound): a split's throughput
is at most what the agents bring at it, so a faster decode counts as the shorter cycle it gives,
not as the rate the measured decode population would complete at."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.cores.costmodel import prefill_A
from services.cores.planner.evaluate import (
    MIN_OUTSIDE_DECODE,
    NodeArrays,
    WorkArrays,
    closed_loop_bound,
    theta,
)
from services.cores.planner.evolving import EvolvingPlanner
from services.cores.planner.window import Work
from services.drivers.bench import scenario as s


def works(q, lam, cycle) -> WorkArrays:
    return WorkArrays.of([
        Work(t_uc=2_600, t_c=60_000, A=prefill_A(2_600, 60_000), t_rst=0, t_out=300, t_acc=2.0, t_fwd=2.0, q=qi,
             arrivals_rps=li, prompt=62_600, cycle_s=ci)
        for qi, li, ci in zip(q, lam, cycle, strict=True)
    ])


def test_calib_126s_faster_decode_is_worth_the_cycle_it_shortens():
    """The 1,620 s shift decision of calib-126 (docs/planner.md): per slice the decode
    population, arrivals and branch cycle measured, and eq. 5's decode side at 3 and 6 decode
    nodes. Unbounded, 3P6D gained 1.98 req/s on a loop whose 126 agents bring ~7; bounded, the
    same decode speed is worth ~0.4 s of an 18-19 s cycle."""
    w = works([17.8, 16.5, 15.3], [6.6, 6.7, 7.2], [18.3, 19.4, 18.4])
    sum_d = np.array([[7.03, 7.16, 7.40], [9.03, 9.14, 9.38]])
    X = closed_loop_bound(w, sum_d)
    n = w.arrivals_rps * w.cycle_s
    assert X[0] == pytest.approx(n / (w.cycle_s - w.q / w.arrivals_rps + w.q / sum_d[0]))
    unbounded = (sum_d[1] - sum_d[0]).mean()
    bounded = (np.minimum(sum_d[1], X[1]) - np.minimum(sum_d[0], X[0])).mean()
    assert unbounded == pytest.approx(1.98, abs=0.01)
    assert 0.1 < bounded < 0.25
    assert (X < sum_d).all()  # the loop, not the decode side, binds both splits


@given(
    lam=st.floats(0.1, 50.0), cycle=st.floats(1.0, 600.0), frac=st.floats(0.0, 0.99),
    speed=st.lists(st.floats(0.1, 10.0), min_size=2, max_size=6),
)
def test_the_bound_is_the_arrivals_at_the_split_served_and_grows_with_decode_speed_up_to_the_cycle(
        lam, cycle, frac, speed):
    q = lam * cycle * frac  # time in decode: frac of the cycle (Little)
    if q <= 0.0:
        return
    w = works([q], [lam], [cycle])
    sum_d = np.array(sorted(speed))[:, None] * lam
    X = closed_loop_bound(w, sum_d)[:, 0]
    served = closed_loop_bound(w, np.array([[lam]]))[0, 0]
    if frac <= 1.0 - MIN_OUTSIDE_DECODE:
        assert served == pytest.approx(lam)  # the decode rate measured: the arrivals measured
    assert (np.diff(X) >= -1e-12).all()  # a faster decode never brings less
    outside = max(cycle - q / lam, MIN_OUTSIDE_DECODE * cycle)
    assert (X <= lam * cycle / outside * (1.0 + 1e-12)).all()  # at most the agents' cycle without decode


def test_open_arrivals_keep_eq_5():
    n = 4
    nodes = NodeArrays(coef_p=np.tile([0.01, 3e-5, 1e-10, 0.0], (n, 1)), fill=np.full(n, 16384.0),
                       coef_d=np.tile([0.012, 0.015, 3e-4], (n, 1)), cap=np.full(n, 256.0),
                       kv_tokens=np.zeros(n), k=8, E=256)
    open_w = works([20.0, 18.0], [2.0, 1.8], [0.0, 0.0])  # no branch cycle measured
    closed_w = works([20.0, 18.0], [2.0, 1.8], [18.0, 19.0])  # agents that bring less than eq. 5
    eq5, sum_p, sum_d = theta(nodes, open_w)
    assert (theta(nodes, open_w, closed_loop=True)[0] == eq5).all()
    assert (eq5 == np.minimum(sum_p, sum_d)).all()
    bounded, _, sum_d_c = theta(nodes, closed_w, closed_loop=True)
    assert (bounded == np.minimum(theta(nodes, closed_w)[0], closed_loop_bound(closed_w, sum_d_c))).all()
    assert (bounded < theta(nodes, closed_w)[0]).any()


def test_the_planner_bounds_only_when_every_node_serves_a_role():
    p = EvolvingPlanner()
    for ev in s.register(2, 1):
        p.apply(ev)
    assert p.closed_loop()
    q = EvolvingPlanner()
    for ev in s.register(2, 1, collocated=1):
        q.apply(ev)
    assert not q.closed_loop()  # a collocated warm-up measured no decode side to replace
    off = EvolvingPlanner(closed_loop_bound=False)
    for ev in s.register(2, 1):
        off.apply(ev)
    assert not off.closed_loop()
