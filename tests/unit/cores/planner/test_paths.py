"""The three paths of a window-end decision after warm-up, kept apart and
named in ``PlanEvaluated.reason``: place newcomers (only nodes without a role get one), repair a
0P/0D split (exactly one node moves), and the SE-gated switch with its cooldown.

The bug these pin: a node re-registering as ``collocated`` (an engine restart is enough) made
the next tick re-plan the whole cluster without the 2-SE test or the cooldown."""

from __future__ import annotations

import pytest

from events.catalog import NodeRegistered, NodeRemoved, PlanEvaluated, RoleSwitchOrdered, Tick
from services.cores.planner.arrow import ArrowPlanner
from services.cores.planner.base import GATED, INITIAL, NEWCOMERS, REPAIR, plan_path
from services.cores.planner.dynamo import DynamoPlanner
from services.cores.planner.evolving import EvolvingPlanner
from services.cores.planner.static import StaticPlanner
from services.drivers.bench.synthetic import Mix, Scenario, drive

DECODE_HEAVY = {"t_uc": 500, "t_c": 20_000, "t_out": 2000, "q": 64}
PREFILL_HEAVY = {"t_uc": 8000, "t_c": 2000, "t_out": 100, "q": 64}


class Restart:
    """Wraps a planner: at the first event at or after ``at``, ``node`` re-registers as
    ``collocated`` (what a worker does when its engine restarts with the default role)."""

    def __init__(self, planner, at: float, node: str) -> None:
        self.planner, self.at, self.node, self.done = planner, at, node, False

    def apply(self, ev):
        if not self.done and ev.ts >= self.at:
            self.done = True
            assert self.planner.apply(NodeRegistered(ts=ev.ts, node=self.node, role="collocated")) == []
        return self.planner.apply(ev)


def window_ends(trace) -> dict[float, tuple[PlanEvaluated, list[RoleSwitchOrdered]]]:
    out: dict[float, tuple[PlanEvaluated, list[RoleSwitchOrdered]]] = {}
    for e in trace.outputs:
        if isinstance(e, PlanEvaluated):
            out[round(e.ts, 1)] = (e, [])
        elif isinstance(e, RoleSwitchOrdered):
            out[round(e.ts, 1)][1].append(e)
    return out


def test_a_restart_inside_the_cooldown_places_only_the_restarted_node():
    """The reported bug: before the fix the tick at 480.9 re-planned the whole cluster (seven
    prefill nodes back to decode, 60 s after the last switch, cooldown 120 s)."""
    cfg = {"warmup_s": 300, "window_s": 60, "slices": 6, "cooldown_s": 120}
    sc = Scenario(mixes=[Mix(360, **DECODE_HEAVY), Mix(60, **PREFILL_HEAVY), Mix(240, **DECODE_HEAVY)])
    tr = drive(Restart(EvolvingPlanner(**cfg), at=470, node="n08"), sc)
    ends = window_ends(tr)
    plan, orders = ends[300.9]
    assert plan_path(plan.reason) == INITIAL and plan.chosen.prefill == 1 and len(orders) == 9
    plan, orders = ends[420.9]  # the gated switch to the prefill-heavy window
    assert plan_path(plan.reason) == GATED and plan.chosen.prefill == 8
    assert {e.node for e in orders} == {f"n0{i}" for i in range(1, 8)}
    # n08, the only decode node, restarts: 8P0D plus one node without a role
    plan, orders = ends[480.9]
    assert plan.current.prefill == 8 and plan.current.decode == 0
    assert plan_path(plan.reason) == NEWCOMERS and plan.reason.startswith("place newcomers n08")
    assert [(e.node, e.from_role, e.to_role) for e in orders] == [("n08", "collocated", "decode")]
    assert all(plan_path(e.reason) == NEWCOMERS for e in orders)
    # placing a newcomer starts no cooldown: the gated switch back comes 120 s after the last one
    plan, orders = ends[540.9]
    assert plan_path(plan.reason) == GATED and plan.reason.startswith("mean gain")
    assert len(orders) == 7 and {e.from_role for e in orders} == {"prefill"}


@pytest.mark.parametrize("node", ["n00", "n05"])  # the prefill node, a decode node
def test_after_warmup_at_1p8d_one_restarted_node_alone_gets_a_role(node):
    tr = drive(
        Restart(EvolvingPlanner(warmup_s=300), at=400, node=node), Scenario(mixes=[Mix(1000, **DECODE_HEAVY)])
    )
    ends = window_ends(tr)
    assert ends[300.9][0].chosen.prefill == 1  # warm-up ends at 1P8D
    plan, orders = ends[900.9]
    assert plan_path(plan.reason) == NEWCOMERS
    assert [(e.node, e.from_role) for e in orders] == [(node, "collocated")]
    reachable = {c.split.prefill for c in plan.candidates if c.veto != "would move an assigned node"}
    assert reachable == ({1} if node == "n00" else {1, 2})  # n00 was the only prefill node
    assert plan.chosen.prefill in reachable


@pytest.mark.parametrize("cls", [EvolvingPlanner, StaticPlanner, DynamoPlanner, ArrowPlanner])
def test_every_planner_places_a_restarted_node_without_moving_another(cls):
    planner = cls(warmup_s=10, window_s=60, slices=2)
    for i in range(9):
        planner.apply(NodeRegistered(ts=0.0, node=f"n{i}", role="collocated"))
    planner.apply(Tick(ts=11.0))
    before = {n: info.target for n, info in planner.st.nodes.items()}
    victim = next(n for n, r in sorted(before.items()) if r == "decode")
    planner.apply(NodeRegistered(ts=20.0, node=victim, role="collocated"))
    out = planner.apply(Tick(ts=200.0))
    plan = next(e for e in out if isinstance(e, PlanEvaluated))
    orders = [e for e in out if isinstance(e, RoleSwitchOrdered)]
    assert plan_path(plan.reason) == NEWCOMERS, plan.reason
    assert [e.node for e in orders] == [victim]
    after = {n: info.target for n, info in planner.st.nodes.items()}
    assert {n: r for n, r in after.items() if n != victim} == {n: r for n, r in before.items() if n != victim}


@pytest.mark.parametrize("cls", [EvolvingPlanner, StaticPlanner, DynamoPlanner, ArrowPlanner])
def test_a_split_left_without_prefill_is_repaired_by_moving_exactly_one_node(cls):
    extra = {} if cls is EvolvingPlanner else {"initial": "1P3D"}
    planner = cls(warmup_s=10, window_s=60, slices=2, cooldown_s=10_000, **extra)
    for i in range(4):
        planner.apply(NodeRegistered(ts=0.0, node=f"n{i}", role="collocated"))
    planner.apply(Tick(ts=11.0))  # no data: the evolving planner takes half, the others 1P3D
    prefill = sorted(n for n, info in planner.st.nodes.items() if info.target == "prefill")
    for n in prefill:
        planner.apply(NodeRemoved(ts=12.0, node=n))
    assert planner.current_split().prefill == 0 and planner.guard() == REPAIR
    out = planner.apply(Tick(ts=200.0))  # well inside the cooldown: a repair is not gated
    plan = next(e for e in out if isinstance(e, PlanEvaluated))
    orders = [e for e in out if isinstance(e, RoleSwitchOrdered)]
    assert plan_path(plan.reason) == REPAIR, plan.reason
    assert [(e.from_role, e.to_role) for e in orders] == [("decode", "prefill")]
    assert planner.current_split().prefill == 1 and plan.chosen == planner.current_split()
    assert planner.guard() == GATED


def test_plan_path_reads_the_reason():
    assert plan_path("initial split: max predicted throughput 2.7 req/s") == INITIAL
    assert plan_path("initial split without data: half of the nodes prefill") == INITIAL
    assert plan_path("place newcomers n08 (assigned nodes stay): max predicted throughput") == NEWCOMERS
    assert plan_path("repair 0P2D: n1 decode -> prefill (least loss)") == REPAIR
    for reason in (
        "mean gain 1.6 req/s > 2 SE (0.3)",
        "cooldown: last switch 60 s ago < 120 s",
        "static: never switches",
    ):
        assert plan_path(reason) == GATED
