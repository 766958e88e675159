"""KV capacity and pressure and the planner's start (part 6) in the simulator:
the KV demand metric on a hand-built log, capacity overrides, the pressure profile, and
``--start`` for the evolving stack."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.profiles import available_profiles, load_profile
from events.catalog import (
    BranchEnded,
    BranchOpened,
    ContextCompacted,
    NodeRegistered,
    PlanEvaluated,
    RequestSubmitted,
    RoleSwitched,
)
from replay.sim.cli import parse_tokens
from replay.sim.figures import _fold, compute_metrics
from replay.sim.inputs import SimSpec, run_profile
from replay.sim.simulation import SimConfig, Simulation
from replay.sim.stacks import get_stack
from replay.traces.workloads import generate
from tests.hyp import examples


def test_kv_demand_counts_distinct_blocks_of_active_branches_over_time():
    bt = 64
    log = [
        NodeRegistered(ts=0.0, node="n0", role="prefill", l1_capacity_tokens=1000, l2_capacity_tokens=4000),
        NodeRegistered(ts=0.0, node="n1", role="decode", l1_capacity_tokens=1000, l2_capacity_tokens=4000),
        BranchOpened(ts=0.0, branch="a"),
        RequestSubmitted(ts=0.0, request="a/0", branch="a", blocks=list(range(1, 11)), prompt_tokens=10 * bt),
        # a fork reuses a's ten blocks: they count once
        BranchOpened(ts=10.0, branch="b", parent="a", mode="fork"),
        RequestSubmitted(ts=10.0, request="b/0", branch="b", blocks=list(range(1, 16)), prompt_tokens=15 * bt),
        # a compacts to two new blocks; b still holds 1..15
        ContextCompacted(ts=20.0, branch="a", version=1, blocks=[20, 21]),
        BranchEnded(ts=30.0, branch="b"),
    ]
    m = compute_metrics(log, warmup_s=5.0, end_s=40.0)
    # 10 blocks on [0, 10), 15 on [10, 20), 17 on [20, 30), 2 on [30, 40]
    assert m.kv_demand_peak_tokens == 17 * bt
    assert m.kv_demand_mean_tokens == pytest.approx(bt * (10 * 5 + 15 * 10 + 17 * 10 + 2 * 10) / 35)
    assert m.kv_gpu_capacity_tokens == 2000 and m.kv_host_capacity_tokens == 8000
    assert m.kv_demand_peak_gpu == pytest.approx(17 * bt / 2000)
    assert m.kv_demand_peak_host == pytest.approx(17 * bt / 8000)
    # a window after the peak sees only what was held then
    late = compute_metrics(log, warmup_s=31.0, end_s=40.0)
    assert late.kv_demand_peak_tokens == 2 * bt and late.kv_demand_mean_tokens == pytest.approx(2 * bt)


def test_token_counts_and_capacity_flags():
    assert parse_tokens("5M") == 5_000_000 and parse_tokens("800K") == 800_000
    assert parse_tokens("1.73M") == 1_730_000 and parse_tokens("20_000_000") == 20_000_000
    for bad in ("lots", "-5M", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_tokens(bad)
    prof = run_profile(SimSpec(profile=None, workload="cc", kv_gpu_tokens=1_000_000, kv_host_tokens=None))
    assert prof.l1_capacity_tokens == 1_000_000 and prof.l2_capacity_tokens == load_profile("gb300-glm52").l2_capacity_tokens


def test_the_pressure_profile_is_the_glm_profile_with_smaller_kv():
    assert "gb300-glm52-pressure" in available_profiles()
    base, pressure = load_profile("gb300-glm52"), load_profile("gb300-glm52-pressure")
    assert pressure.l1_capacity_tokens < base.l1_capacity_tokens
    # re-derived from the regime map (the profile's header and docs/simulator.md,
    # "Regimes"): 86% of the GPU tier with METHOD's host = 4 x GPU [M §4.1]; host = GPU thrashed
    assert pressure.l2_capacity_tokens == 4 * pressure.l1_capacity_tokens
    # everything but the capacities (and the name) is the base profile's
    assert replace(pressure, name=base.name, l1_capacity_tokens=base.l1_capacity_tokens,
                   l2_capacity_tokens=base.l2_capacity_tokens) == base


def test_evolving_with_start_serves_that_split_from_t0_and_gates_the_warmup_end():
    prof = replace(load_profile("gb300-glm52"), l1_capacity_tokens=400_000, l2_capacity_tokens=1_600_000)
    cfg = SimConfig(nodes=4, duration_s=60.0, warmup_s=180.0, seed=3, agents=12)
    res = Simulation(prof, get_stack("evolving", start="3P1D"), generate("cc", seed=1, agents=24), cfg).run()
    roles = [e.role for e in res.log if type(e) is NodeRegistered]
    assert roles == ["prefill"] * 3 + ["decode"]
    plan = next(e for e in res.log if type(e) is PlanEvaluated)
    assert plan.ts >= 180.0 and plan.current.prefill == 3 and plan.current.decode == 1
    assert plan.reason.startswith("initial split") and "reference 3P1D" in plan.reason
    if plan.chosen.prefill != 3:  # a move away from the start split passed the 2-SE test
        c = next(c for c in plan.candidates if c.split == plan.chosen)
        assert c.mean_gain > 2 * c.se
    else:  # kept: no node was ordered anywhere
        assert not [e for e in res.log if type(e) is RoleSwitched and e.ts <= plan.ts + 5 and e.duration_s > 0]
    # no node ever ran collocated
    assert all(e.role != "collocated" for e in res.log if type(e) is RoleSwitched)


_CTX_OPS = st.lists(st.tuples(st.sampled_from(["submit", "extend", "compact", "end", "open"]), st.integers(0, 3),
                              st.lists(st.integers(0, 25), max_size=6)), max_size=30)


@settings(max_examples=examples(150))
@given(ops=_CTX_OPS)
@example(ops=[("submit", 0, [1, 2]), ("extend", 0, [1, 3]), ("end", 0, []), ("submit", 1, [5])])  # a repeat in a tail
@example(ops=[("submit", 0, [1, 2]), ("submit", 0, [2]), ("extend", 0, [4]), ("submit", 1, [2, 9])])
def test_kv_demand_and_ideal_reuse_equal_their_definitions(ops):
    """The figures' fast paths (a continuation adds only its tail; the seen run is found in
    chunks) give what the definitions give: demand = distinct blocks of the live branches'
    contexts at each instant, ideal reuse = the prompt's longest prefix submitted before."""
    bt, log, ctx, seen, ts = 64, [], {}, set(), 0.0
    peak = area = 0
    ideal = []
    for op, k, blocks in ops:
        ts += 1.0
        b = f"b{k}"
        if op == "open":
            if b not in ctx:
                log.append(BranchOpened(ts=ts, branch=b))
                ctx[b] = []
        elif op == "end":
            if b in ctx:
                log.append(BranchEnded(ts=ts, branch=b))
                del ctx[b]
        elif op == "compact":
            log.append(ContextCompacted(ts=ts, branch=b, version=1, blocks=list(blocks)))
            ctx[b] = list(blocks)
        else:
            new = (ctx.get(b, []) + list(blocks)) if op == "extend" else list(blocks)
            n = 0
            while n < len(new) and new[n] in seen:
                n += 1
            ideal.append(min(n * bt, max(0, len(new) * bt - 1)))
            seen.update(new)
            log.append(RequestSubmitted(ts=ts, request=f"r{len(ideal)}", branch=b, blocks=new,
                                        prompt_tokens=len(new) * bt))
            ctx[b] = new
        now = len({x for c in ctx.values() for x in c}) * bt
        peak, area = max(peak, now), area + now  # held for 1 s, until the next op
    m = compute_metrics(log, warmup_s=0.0, end_s=ts + 1.0)
    assert m.kv_demand_peak_tokens == peak
    assert m.kv_demand_mean_tokens * (ts + 1.0) == pytest.approx(area)
    prompts = sum(len(e.blocks) * bt for e in log if isinstance(e, RequestSubmitted))
    if prompts:
        f = _fold(log, 0.0, ts + 1.0)
        assert [s[2] for s in f.sub.values()] == ideal
