"""The decision at the end of the warm-up: SE-gated against a reference split
as METHOD.md §4.3 describes (a candidate replaces the reference only when its mean gain over it
exceeds twice its standard error), whether the nodes warmed up collocated or started at a split."""

from __future__ import annotations

from events.catalog import NodeRegistered, PlanEvaluated, RoleSwitchOrdered, Tick
from services.cores.planner.base import INITIAL, plan_path
from services.cores.planner.evolving import EvolvingPlanner
from services.drivers.bench.synthetic import Mix, Scenario, drive

DECODE_HEAVY = {"t_uc": 500, "t_c": 20_000, "t_out": 2000, "q": 64}


def warmup_end(trace, at: float = 300.9) -> tuple[PlanEvaluated, list[RoleSwitchOrdered]]:
    plan = next(e for e in trace.outputs if isinstance(e, PlanEvaluated) and round(e.ts, 1) == at)
    orders = [e for e in trace.outputs if isinstance(e, RoleSwitchOrdered) and round(e.ts, 1) == at]
    return plan, orders


class StartAt:
    """Wraps a planner: every node registers with the role of a start split (``--start``)
    instead of ``collocated``."""

    def __init__(self, planner, prefill: int) -> None:
        self.planner, self.prefill = planner, prefill

    def apply(self, ev):
        if isinstance(ev, NodeRegistered) and ev.role == "collocated":
            idx = int(ev.node[1:])
            role = "prefill" if idx < self.prefill else "decode"
            ev = NodeRegistered(ts=ev.ts, src=ev.src, node=ev.node, role=role, gpus=ev.gpus,
                                l1_capacity_tokens=ev.l1_capacity_tokens, l2_capacity_tokens=ev.l2_capacity_tokens,
                                prefill_token_budget=ev.prefill_token_budget,
                                max_running_requests=ev.max_running_requests, t_fwd=ev.t_fwd)
        return self.planner.apply(ev)


def chosen_candidate(plan: PlanEvaluated):
    return next(c for c in plan.candidates if c.split == plan.chosen)


def test_collocated_warmup_switches_away_from_the_reference_only_past_2_se():
    tr = drive(EvolvingPlanner(warmup_s=300), Scenario(mixes=[Mix(400, **DECODE_HEAVY)]))
    plan, orders = warmup_end(tr)
    assert plan_path(plan.reason) == INITIAL and plan.reason.endswith("over reference 4P5D")
    # gains are measured against the reference 4P5D (half of 9 nodes), not against zero
    ref = next(c for c in plan.candidates if c.split.prefill == 4)
    assert ref.mean_gain == 0.0 and not ref.passed
    c = chosen_candidate(plan)
    assert plan.chosen.prefill == 1 and c.passed and c.mean_gain > 2 * c.se > 0
    # every collocated node gets a role
    assert len(orders) == 9 and all(o.from_role == "collocated" for o in orders)
    assert all(plan_path(o.reason) == INITIAL for o in orders)


def test_the_reference_is_kept_when_no_candidate_passes():
    """With the best split as the reference no candidate's gain over it passes 2 SE: the
    reference is kept, and still every collocated node gets its role."""
    tr = drive(EvolvingPlanner(warmup_s=300, initial="1P8D"), Scenario(mixes=[Mix(400, **DECODE_HEAVY)]))
    plan, orders = warmup_end(tr)
    assert plan.reason.startswith("initial split: reference 1P8D kept: no candidate's mean gain exceeds 2 SE")
    assert plan.chosen.prefill == 1 and not any(c.passed for c in plan.candidates)
    assert sorted((o.node, o.to_role) for o in orders) == [("n00", "prefill")] + [
        (f"n0{i}", "decode") for i in range(1, 9)]


def test_a_start_split_is_the_reference_and_only_moved_nodes_get_orders():
    """Nodes that started at 6P3D (``--start``): the decision is gated against 6P3D; moving
    to 1P8D passes, and only the five prefill nodes that move get an order."""
    tr = drive(StartAt(EvolvingPlanner(warmup_s=300), prefill=6), Scenario(mixes=[Mix(400, **DECODE_HEAVY)]))
    plan, orders = warmup_end(tr)
    assert plan.current.prefill == 6 and plan.reason.endswith("over reference 6P3D")
    c = chosen_candidate(plan)
    assert plan.chosen.prefill == 1 and c.mean_gain > 2 * c.se
    assert len(orders) == 5 and {o.from_role for o in orders} == {"prefill"} and {o.to_role for o in orders} == {
        "decode"}


def test_without_two_slices_of_data_the_reference_is_taken():
    """No SE without two non-empty slices: the reference split, every node ordered."""
    p = EvolvingPlanner(warmup_s=300)
    for i in range(4):
        assert p.apply(NodeRegistered(ts=0.0, node=f"n{i}", role="collocated")) == []
    out = p.apply(Tick(ts=301.0))
    plan = next(e for e in out if isinstance(e, PlanEvaluated))
    assert plan.reason.startswith("initial split without data: reference 2P2D") and plan.chosen.prefill == 2
    assert plan_path(plan.reason) == INITIAL
    assert len([e for e in out if isinstance(e, RoleSwitchOrdered)]) == 4


# A 3-node mix where 2P1D predicts a throughput 3% below the reference 1P2D's (no gain, so no
# candidate passes 2 SE) and a P95 TTFT 0.8 s lower.
TIE = {"t_uc": 10_000, "t_c": 20_000, "t_out": 400, "arrivals_rps": 1.0, "q": 16}


def test_collocated_warmup_takes_the_lower_ttft_split_at_equal_throughput():
    """No candidate passes 2 SE over the reference 1P2D, but 2P1D is within the throughput
    tolerance of it and predicts a P95 TTFT lower by more than ``ttft_min_improvement_s``:
    the nodes warmed up collocated, every one takes a role whichever split is chosen, so the
    TTFT objective takes 2P1D (before, the never-served reference was kept)."""
    planner = EvolvingPlanner(warmup_s=300, initial="1P2D", ttft_min_improvement_s=0.5)
    plan, orders = warmup_end(drive(planner, Scenario(n_nodes=3, mixes=[Mix(400, **TIE)])))
    ref, two = (next(c for c in plan.candidates if c.split.prefill == p) for p in (1, 2))
    assert not any(c.passed for c in plan.candidates)
    assert two.throughput >= 0.95 * ref.throughput and two.throughput < ref.throughput
    assert two.predicted_ttft_p95_s <= ref.predicted_ttft_p95_s - 0.5
    assert plan.chosen.prefill == 2 and plan_path(plan.reason) == INITIAL
    assert "no candidate's mean gain exceeds 2 SE; ttft objective: 2P within 5%" in plan.reason
    assert plan.reason.endswith("over reference 1P2D")
    assert sorted((o.node, o.to_role) for o in orders) == [("n00", "prefill"), ("n01", "prefill"), ("n02", "decode")]


def test_the_ttft_tie_break_needs_the_improvement_and_a_reference_never_served():
    """The same mix: with ``ttft_min_improvement_s`` above the 0.8 s difference, with the TTFT
    objective off, or with the nodes already serving 1P2D (``--start``: the reference is the
    split served, held until a candidate passes 2 SE), 1P2D is kept."""
    for planner in (EvolvingPlanner(warmup_s=300, initial="1P2D", ttft_min_improvement_s=1.0),
                    EvolvingPlanner(warmup_s=300, initial="1P2D", ttft_min_improvement_s=0.5, ttft_objective=False),
                    StartAt(EvolvingPlanner(warmup_s=300, ttft_min_improvement_s=0.5), prefill=1)):
        plan, _ = warmup_end(drive(planner, Scenario(n_nodes=3, mixes=[Mix(400, **TIE)])))
        assert plan.chosen.prefill == 1, plan.reason
        assert "reference 1P2D kept: no candidate's mean gain exceeds 2 SE" in plan.reason
        assert "ttft objective" not in plan.reason
