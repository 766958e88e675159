"""The planner's predicted P95 TTFT against what the simulator measures at a static split.
Before, the prediction averaged the slices' service *rates* and treated
agents as open Poisson arrivals with a 600 s overload horizon: on Putnam-like at 256 agents it
said 0.27 s for 1P8D where 14.5 s was measured (and 369 s once the queue was near saturation).

A short Putnam-like run on 3 nodes with a slow-prefill profile (so one prefill node is nearly
saturated and two are not), the planner folding the run's log as a shadow, and the window
after the warm-up evaluated: the prediction for the split that ran is compared with the P95
TTFT of the requests submitted in that window."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from engine.profiles import load_profile
from events.catalog import FirstToken, PlanEvaluated, RequestSubmitted, RoleSwitchOrdered, Tick
from replay.sim.simulation import SimConfig, Simulation
from replay.sim.stacks import get_stack
from replay.traces.workloads import generate
from services.cores.planner.evolving import EvolvingPlanner

BASE = load_profile("gb300-glm52")
SLOW_PREFILL = replace(BASE, c1=BASE.c1 * 4, c2=BASE.c2 * 4)
WARM, DUR = 300.0, 300.0


def predicted_and_measured(split: str) -> tuple[dict[int, float], float]:
    sessions = generate("putnam", seed=1, agents=300, steps=(4, 8), output_median=1500.0)
    cfg = SimConfig(nodes=3, duration_s=DUR, warmup_s=WARM, seed=0, agents=150, directory_core=False)
    res = Simulation(SLOW_PREFILL, get_stack(f"static:{split}"), sessions, cfg).run()
    submitted = {e.request: e.ts for e in res.log if type(e) is RequestSubmitted}
    ttft = [e.ts - submitted[e.request] for e in res.log
            if type(e) is FirstToken and submitted.get(e.request, -1.0) >= WARM]
    planner = EvolvingPlanner(warmup_s=WARM, window_s=DUR, slices=5)
    plans = []
    for e in [*res.log, Tick(ts=WARM + DUR + 0.5, src="test")]:
        for o in planner.apply(e):
            plans += [o] if isinstance(o, PlanEvaluated) else []
            if isinstance(o, RoleSwitchOrdered):  # a shadow: its orders are never carried out
                planner.st.nodes[o.node].ordered = ""
                planner.st.last_switch_at = None
    last = plans[-1]
    assert last.window_start == WARM and last.current.prefill == int(split[0])
    return {c.split.prefill: c.predicted_ttft_p95_s for c in last.candidates}, float(np.percentile(ttft, 95))


@pytest.fixture(scope="module")
def runs():
    return {split: predicted_and_measured(split) for split in ("1P2D", "2P1D")}


def test_near_saturation_the_predicted_p95_ttft_is_within_2x_of_the_measured(runs):
    pred, measured = runs["1P2D"]
    assert measured > 5.0  # the single prefill node queues: the case the old prediction missed
    assert measured / 2 <= pred[1] <= measured * 2


def test_with_spare_prefill_capacity_the_prediction_stays_near_the_measured(runs):
    pred, measured = runs["2P1D"]
    assert measured < 3.0
    assert measured / 2 <= pred[2] <= measured * 2


def test_each_run_predicts_the_other_split_within_2x(runs):
    """The split that did not run: the capacity correction measured at one split carries over."""
    (p1, m1), (p2, m2) = runs["1P2D"], runs["2P1D"]
    assert m2 / 2 <= p1[2] <= m2 * 2
    assert m1 / 2 <= p2[1] <= m1 * 2


def test_the_prediction_orders_the_splits_as_measured(runs):
    (p1, m1), (p2, m2) = runs["1P2D"], runs["2P1D"]
    assert m1 > 3 * m2 and p1[1] > 3 * p2[2]
