"""Baseline planners: static, Dynamo-style, Arrow-style (METHOD.md §2.2, §5)."""

from __future__ import annotations

import itertools

import pytest

from events.catalog import (
    FirstToken,
    IterationDone,
    NodeRegistered,
    PlanEvaluated,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RoleSwitched,
    RoleSwitchOrdered,
    RouteDecided,
    Tick,
)
from services.cores.planner.arrow import ArrowPlanner
from services.cores.planner.configured import parse_split, scale_split
from services.cores.planner.dynamo import DynamoPlanner
from services.cores.planner.static import StaticPlanner
from services.cores.planner.window import SliceStats
from services.drivers.bench.synthetic import TRUE_PREFILL, Mix, Scenario, drive

# high reuse: each request appends 300 new tokens to a 60K-token context that is cached
HIGH_REUSE = {"t_uc": 300, "t_c": 60_000, "t_out": 400, "q": 64}


def final_prefill(trace) -> int:
    role: dict[str, str] = {}
    for e in trace.outputs:
        if isinstance(e, RoleSwitchOrdered):
            role[e.node] = e.to_role
    return sum(r == "prefill" for r in role.values())


@pytest.mark.parametrize(
    "text,n,expected", [("6P3D", 9, 6), ("6P3D", 64, 43), ("4P5D", 768, 341), ("8P1D", 2, 1), ("1P8D", 3, 1)]
)
def test_scale_split(text, n, expected):
    assert scale_split(text, n) == expected
    assert parse_split(" 6p3d ") == (6, 3)


def test_static_orders_its_split_once_and_never_switches():
    tr = drive(StaticPlanner(warmup_s=300, initial="6P3D"), Scenario(mixes=[Mix(1500, **HIGH_REUSE)]))
    orders = [e for e in tr.outputs if isinstance(e, RoleSwitchOrdered)]
    assert len(orders) == 9 and all(e.ts == pytest.approx(300.9) for e in orders)
    assert final_prefill(tr) == 6
    assert all(e.mechanism == "in_place" for e in orders)


def test_arrow_counts_cached_prefix_as_new_work():
    arrow = ArrowPlanner(warmup_s=300, initial="6P3D")
    drive(arrow, Scenario(mixes=[Mix(900, **HIGH_REUSE)]))
    # predicted prefill time of one high-reuse request vs what eq. 1 (the true model) charges
    s = SliceStats()
    s.on_submit(HIGH_REUSE["t_uc"] + HIGH_REUSE["t_c"], 400)
    predicted = arrow.predicted_prefill_s(s)
    true = TRUE_PREFILL.request_cost_s(HIGH_REUSE["t_uc"], HIGH_REUSE["t_c"], token_budget=16384)
    assert predicted > 20 * true


# --------------------------------------------------------------------------- hand-built load
class Cluster:
    """Feeds a planner a 9-node cluster at its configured split and lets a test set the
    per-node load the planner's rules read: queued prompts on prefill nodes (RouteDecided
    without RequestStarted), decode KV (FirstToken .. RequestFinished), decode iterations."""

    def __init__(self, planner, n: int = 9, l1: int = 1_000_000) -> None:
        self.p, self.t, self.k, self.out = planner, 0.0, 0, []
        for i in range(n):
            self.feed(NodeRegistered(ts=0.0, node=f"n{i}", role="collocated", l1_capacity_tokens=l1))
        self.tick(planner.cfg.warmup_s + 1)
        self.ack()

    def feed(self, ev):
        outs = self.p.apply(ev)
        self.out += outs
        return outs

    def ack(self) -> None:
        """Every ordered switch is done (RoleSwitched)."""
        for name, info in sorted(self.p.st.nodes.items()):
            if info.ordered:
                self.feed(RoleSwitched(ts=self.t, node=name, role=info.ordered, duration_s=1.0))

    def tick(self, to: float) -> list:
        outs = []
        while self.t < to:
            self.t = round(self.t + 1.0, 6)
            outs += self.feed(Tick(ts=self.t))
        return outs

    def role(self, role: str) -> list[str]:
        return [n for n, i in sorted(self.p.st.nodes.items()) if i.target == role]

    def queue(self, node: str, prompt: int, t_uc: int, count: int = 1) -> None:
        for _ in range(count):
            self.k += 1
            r = f"q{self.k}"
            self.feed(
                RequestSubmitted(ts=self.t, request=r, branch="b", prompt_tokens=prompt, max_tokens=100)
            )
            self.feed(
                RouteDecided(
                    ts=self.t,
                    request=r,
                    prefill_node=node,
                    decode_node=self.role("decode")[0],
                    t_uc=t_uc,
                    t_c=prompt - t_uc,
                )
            )

    def decode_kv(self, node: str, tokens: int) -> str:
        self.k += 1
        r = f"d{self.k}"
        self.feed(RequestSubmitted(ts=self.t, request=r, branch="b", prompt_tokens=tokens, max_tokens=0))
        self.feed(
            RouteDecided(
                ts=self.t,
                request=r,
                prefill_node=self.role("prefill")[0],
                decode_node=node,
                t_uc=tokens,
                t_c=0,
            )
        )
        self.feed(RequestStarted(ts=self.t, request=r, node=self.role("prefill")[0], phase="prefill"))
        self.feed(FirstToken(ts=self.t, request=r, node=self.role("prefill")[0]))
        return r

    def decode_iterations(self, node: str, duration_s: float, batch: int = 8, accepted: int = 16) -> None:
        self.feed(
            IterationDone(
                ts=self.t,
                node=node,
                phase="decode",
                duration_s=duration_s,
                batch=batch,
                accepted_tokens=accepted,
                iterations=10,
            )
        )

    def orders(self, outs) -> list[RoleSwitchOrdered]:
        return [e for e in outs if isinstance(e, RoleSwitchOrdered)]

    def plans(self, outs) -> list[PlanEvaluated]:
        return [e for e in outs if isinstance(e, PlanEvaluated)]


def dynamo(**kw) -> Cluster:
    return Cluster(DynamoPlanner(warmup_s=10, initial="6P3D", **kw))


def test_dynamo_decides_every_adjustment_interval_and_holds_within_thresholds():
    c = dynamo()
    assert len(c.role("prefill")) == 6
    for d in c.role("decode"):
        c.decode_kv(d, 800_000)  # 0.8: between scale-down 0.6 and scale-up 1.0
    c.queue("n0", prompt=150_000, t_uc=50_000)  # 0.25 of the context: between 0.1 and 1.0
    outs = c.tick(c.t + 60)
    plans = c.plans(outs)
    assert [round(b.ts - a.ts, 6) for a, b in itertools.pairwise(plans)] == [5.0] * (len(plans) - 1)
    assert len(plans) >= 11 and not c.orders(outs)
    assert all(p.reason.startswith("no scale-up") for p in plans)


def test_dynamo_moves_a_prefill_node_to_decode_when_decode_kv_is_full_and_prefill_idle():
    c = dynamo()
    c.decode_kv(c.role("decode")[0], 1_100_000)  # ANY decode node over 100% (queued KV included)
    outs = c.tick(c.t + 5)
    orders = c.orders(outs)
    assert [(e.from_role, e.to_role, e.mechanism) for e in orders] == [("prefill", "decode", "restart")]
    assert "decode +1, prefill -1" in orders[0].reason
    # the restart is in progress: Dynamo observes only, however long it takes
    outs = c.tick(c.t + 100)
    assert not c.orders(outs)
    assert all(p.reason.startswith("switch in progress") for p in c.plans(outs))
    c.ack()
    outs = c.tick(c.t + 5)  # the signals still cross: one more node
    assert [(e.from_role, e.to_role) for e in c.orders(outs)] == [("prefill", "decode")]


def test_dynamo_moves_a_decode_node_to_prefill_on_a_long_queue_when_decode_kv_is_low():
    c = dynamo()
    c.queue("n1", prompt=120_000, t_uc=100_000, count=2)  # 200K new tokens = the context length
    outs = c.tick(c.t + 5)
    assert [(e.from_role, e.to_role) for e in c.orders(outs)] == [("decode", "prefill")]


def test_dynamo_needs_a_donor_a_scale_up_alone_is_held_by_the_full_budget():
    c = dynamo()
    for d in c.role("decode"):
        c.decode_kv(d, 700_000)  # decode holds (0.6 <= util <= 1.0): no node to give
    c.queue("n1", prompt=120_000, t_uc=100_000, count=2)
    outs = c.tick(c.t + 30)
    assert not c.orders(outs)
    assert all(p.reason.startswith("held by the full GPU budget") for p in c.plans(outs))


def test_dynamo_counts_new_tokens_so_a_cached_prefix_does_not_fill_its_queue():
    c = dynamo()
    c.queue("n1", prompt=120_000, t_uc=2_000, count=50)  # 6M prompt tokens but 100K new ones
    assert not c.orders(c.tick(c.t + 30))


def test_dynamo_latency_target_uses_its_lower_thresholds():
    signals = {"kv": 500_000}  # 0.5: over the latency target's 0.4, under the throughput target's 1.0
    for target, expected in (("throughput", []), ("latency", [("prefill", "decode")])):
        c = dynamo(optimization_target=target)
        c.decode_kv(c.role("decode")[0], signals["kv"])
        assert [(e.from_role, e.to_role) for e in c.orders(c.tick(c.t + 5))] == expected, target


def test_dynamo_keeps_min_endpoint_nodes_per_phase():
    c = Cluster(DynamoPlanner(warmup_s=10, initial="1P8D"))
    c.decode_kv(c.role("decode")[0], 1_200_000)
    outs = c.tick(c.t + 20)
    assert not c.orders(outs)  # the last prefill node never leaves (min_endpoint 1)


def test_dynamo_finished_requests_release_their_decode_kv():
    c = dynamo()
    r = c.decode_kv(c.role("decode")[0], 1_100_000)
    c.feed(RequestFinished(ts=c.t, request=r, node=c.role("decode")[0], output_tokens=0))
    assert not c.orders(c.tick(c.t + 10))


def arrow(**kw) -> Cluster:
    return Cluster(ArrowPlanner(warmup_s=10, initial="6P3D", **kw))


def test_arrow_flips_a_decode_node_to_prefill_when_predicted_ttft_exceeds_its_slo():
    c = arrow()
    # every prefill node holds cached-prefix-heavy prompts: few new tokens, but Arrow costs the
    # whole input length
    for p in c.role("prefill"):
        c.queue(p, prompt=100_000, t_uc=500, count=2)
    outs = c.tick(c.t + 10)
    orders = c.orders(outs)
    assert [(e.from_role, e.to_role, e.mechanism) for e in orders] == [
        ("decode", "prefill", "in_place_drop_kv")
    ]
    assert orders[0].reason.startswith("one node decode -> prefill; ttft over slo")


def test_arrow_holds_within_its_slos():
    c = arrow()
    c.queue(c.role("prefill")[0], prompt=2_000, t_uc=2_000)
    for d in c.role("decode"):
        c.decode_iterations(d, duration_s=0.03, batch=8, accepted=16)  # 15 ms per token
    outs = c.tick(c.t + 60)
    assert not c.orders(outs) and all(p.reason.startswith("within slo") for p in c.plans(outs))


def test_arrow_flips_a_prefill_node_to_decode_when_tpot_exceeds_its_slo():
    c = arrow()
    c.queue(c.role("prefill")[0], prompt=2_000, t_uc=2_000)
    c.tick(c.t + 10)  # one interval to see a prompt
    for d in c.role("decode"):
        c.decode_iterations(d, duration_s=0.12, batch=8, accepted=16)  # 60 ms per token > 50 ms
    outs = c.tick(c.t + 10)
    assert [(e.from_role, e.to_role) for e in c.orders(outs)] == [("prefill", "decode")]


@pytest.mark.parametrize("cls,expected_prefill", [(StaticPlanner, 7), (DynamoPlanner, 6)])
def test_a_node_joining_after_warmup_is_assigned(cls, expected_prefill):
    from events.catalog import NodeRegistered, Tick

    planner = cls(warmup_s=10, initial="6P3D")
    for i in range(9):
        planner.apply(NodeRegistered(ts=0.0, node=f"n{i}", role="collocated"))
    planner.apply(Tick(ts=11.0))
    assert planner.current_split().prefill == 6
    planner.apply(NodeRegistered(ts=20.0, node="n9", role="collocated"))
    out = planner.apply(Tick(ts=700.0))  # past the next interval end of either planner
    orders = [e for e in out if isinstance(e, RoleSwitchOrdered)]
    assert "n9" in [e.node for e in orders]
    if cls is DynamoPlanner:
        assert [(e.node, e.to_role) for e in orders] == [("n9", "decode")]
    assert (
        planner.current_split().prefill == expected_prefill
        and planner.current_split().decode == 10 - expected_prefill
    )
