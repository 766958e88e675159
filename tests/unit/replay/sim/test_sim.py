"""The cluster simulator: determinism, conservation, capacities, and that the planner learns
the profile's coefficients in the warm-up (it never reads them)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import msgspec
import numpy as np
import pytest

from engine.profiles import load_profile
from events.catalog import (
    IterationDone,
    KvEvicted,
    KvFetched,
    KvMoved,
    KvStored,
    ModelFitted,
    RequestFinished,
    RequestSubmitted,
    RoleSwitched,
)
from events.subjects import subject_for
from replay.sim.figures import METRIC_TYPES, MetricsFold, compute_metrics
from replay.sim.simulation import SessionSource, SimConfig, Simulation, _salt_blocks
from replay.sim.stacks import get_stack
from replay.traces.workloads import generate
from services.adapters.eventlog import DuckDbEventLog

PROFILE = load_profile("gb300-glm52")
# Small capacities so eviction, fetches and the pool all happen in a short run.
SMALL = replace(PROFILE, l1_capacity_tokens=400_000, l2_capacity_tokens=1_600_000)


_CACHE: dict = {}


def _run(stack="evolving", seed=3, profile=SMALL, agents=16, nodes=4, warmup=200.0, duration=120.0):
    sessions = generate("cc", seed=1, agents=agents * 2)
    cfg = SimConfig(nodes=nodes, duration_s=duration, warmup_s=warmup, seed=seed, agents=agents)
    return Simulation(profile, get_stack(stack), sessions, cfg).run()


def _cached(stack):
    if stack not in _CACHE:
        _CACHE[stack] = _run(stack)
    return _CACHE[stack]


@pytest.fixture(scope="module")
def evolving_run():
    return _run()


def _encode(log):
    return [msgspec.json.encode(e) for e in log]


def test_same_trace_stack_and_seed_give_identical_event_logs(evolving_run):
    again = _run()
    assert len(again.log) == len(evolving_run.log)
    assert _encode(again.log) == _encode(evolving_run.log)


def test_another_seed_gives_another_log(evolving_run):
    other = _run(seed=4)
    assert _encode(other.log) != _encode(evolving_run.log)


@pytest.mark.parametrize("stack", ["evolving", "dynamo", "arrow", "static:2P2D", "memory-pool"])
def test_conservation_and_capacities(stack, evolving_run):
    res = evolving_run if stack == "evolving" else _cached(stack)
    submitted = [e.request for e in res.log if isinstance(e, RequestSubmitted)]
    finished = [e.request for e in res.log if isinstance(e, RequestFinished)]
    assert len(finished) == len(set(finished)), "a request finished twice"
    assert set(finished) | set(res.unfinished) == set(submitted)
    assert not set(finished) & set(res.unfinished)
    assert res.finished > 50
    # fold the KV facts: nothing read from a node that lacks it, never over capacity
    held = defaultdict(set)
    cap = {"L1": SMALL.l1_capacity_tokens // 64, "L2": SMALL.l2_capacity_tokens // 64}
    fetched = 0
    for e in res.log:
        t = type(e)
        if t is KvStored:
            for tier in e.tiers():  # a write-through store: L1 and L2
                held[e.node, tier].update(e.blocks)
        elif t is KvEvicted:
            assert set(e.blocks) <= held[e.node, e.tier], "evicted a block the node does not hold"
            held[e.node, e.tier].difference_update(e.blocks)
        elif t is KvMoved:
            src = held[e.src_node, "L1"] | held[e.src_node, "L2"]
            assert set(e.blocks) <= src, "moved KV from a node that does not hold it"
            held[e.dst_node, e.dst_tier].update(e.blocks)
        elif t is KvFetched:
            fetched += 1
            assert set(e.blocks) <= held[e.src_node, "L2"] | held[e.src_node, "L1"], "fetched from a non-holder"
            held[e.dst_node, "L1"].update(e.blocks)
            held[e.dst_node, "L2"].update(e.blocks)
        if t in (KvStored, KvMoved, KvFetched):
            for (node, tier), blocks in held.items():
                assert len(blocks) <= cap[tier], f"{node} {tier} over capacity"
    for n in res.nodes:  # the nodes' own stores agree with the log
        assert n.l1 == held[n.id, "L1"] and n.l2 == held[n.id, "L2"]
    assert res.anomalies.get("unknown_block", 0) == 0
    if stack == "evolving":
        assert fetched > 0  # the shared pool was used
    if stack == "dynamo":
        assert fetched == 0  # node-local cache only


def test_restart_switches_drop_kv_and_in_place_keeps_it(evolving_run):
    acks = [e for e in evolving_run.log if isinstance(e, RoleSwitched) and e.duration_s > 0]
    assert acks and not any(a.kv_dropped for a in acks)  # warm-up end: collocated -> P/D in place
    dyn = [e for e in _cached("dynamo").log if isinstance(e, RoleSwitched) and e.duration_s > 0]
    assert all(a.kv_dropped for a in dyn)


def test_planner_learns_the_profile_within_7_percent(evolving_run):
    """Fitted models against the profile's noise-free ground truth, on the warm-up's own
    iterations (the planner saw only IterationDone events)."""
    res, p = evolving_run, SMALL
    warm = res.config.warmup_s
    fits = {}
    for e in res.log:
        if isinstance(e, ModelFitted) and e.ts <= warm:
            fits[e.node, e.phase] = e.coefficients
    assert fits, "no model fitted in the warm-up"
    errs = {"prefill": [], "decode": []}
    for e in res.log:
        if not isinstance(e, IterationDone) or e.ts > warm or (e.node, e.phase) not in fits:
            continue
        c = fits[e.node, e.phase]
        if e.phase == "prefill":
            pred = c[0] + c[1] * e.sum_t_uc + c[2] * e.sum_A + c[3] * e.sum_t_rst
            true = p.prefill_iteration_s(e.sum_t_uc, e.sum_A, e.sum_t_rst)
        else:
            pred = c[0] + c[1] * p.phi(e.batch) + c[2] * e.batch
            true = p.decode_iteration_s(e.batch)
        errs[e.phase].append(abs(pred - true) / true)
    for phase, xs in errs.items():
        assert len(xs) > 20, phase
        assert float(np.mean(xs)) < 0.07, f"{phase}: mean error {np.mean(xs):.3f}"


def test_metrics_of_a_run(evolving_run):
    cfg = evolving_run.config
    m = compute_metrics(evolving_run.log, cfg.warmup_s, cfg.end_s, "evolving")
    assert m.finished > 0 and m.throughput_rps > 0
    assert 0 <= m.kv_hit_actual <= m.kv_hit_ideal + 1e-9 <= 1 + 1e-9
    assert 0 <= m.lost_kv_reuse <= 1
    assert m.ttft_p50_s <= m.ttft_p95_s and m.ttft_mean_s <= m.e2e_mean_s
    assert abs(sum(m.split_time_s.values()) - cfg.duration_s) < 1e-6


def test_metrics_need_only_the_metric_types(evolving_run, tmp_path):
    """Reading a stored log with ``types=METRIC_TYPES`` (what compare and partitioned runs do)
    gives the same figures as folding every event."""
    cfg = evolving_run.config
    log = DuckDbEventLog(str(tmp_path / "run.duckdb"))
    log.append([(i + 1, subject_for(ev), ev) for i, ev in enumerate(evolving_run.log)])
    every = compute_metrics((ev for _, _, ev in log.read()), cfg.warmup_s, cfg.end_s, "evolving")
    some = compute_metrics((ev for _, _, ev in log.read(types=METRIC_TYPES)), cfg.warmup_s, cfg.end_s, "evolving")
    log.close()
    assert msgspec.json.encode(some.summary()) == msgspec.json.encode(every.summary())
    assert some.ttft_s == every.ttft_s and some.finished > 0
    assert {type(ev).__name__ for ev in evolving_run.log} - METRIC_TYPES  # the filter does drop events


def test_metrics_folded_as_the_run_goes_equal_the_kept_logs(evolving_run):
    """``MetricsFold`` fed by ``Simulation(observe=)`` (what ``run_one`` does, keeping no log)
    gives the figures ``compute_metrics`` gives over the same run's kept log, to the last digit;
    and a run that keeps no log holds none."""
    cfg = evolving_run.config
    sessions = generate("cc", seed=1, agents=32)
    fold = MetricsFold(cfg.warmup_s, cfg.end_s)
    kept = Simulation(SMALL, get_stack("evolving"), sessions, cfg, observe=fold).run()
    fold2 = MetricsFold(cfg.warmup_s, cfg.end_s)
    bare = Simulation(SMALL, get_stack("evolving"), generate("cc", seed=1, agents=32), cfg, keep_log=False,
                      observe=fold2).run()
    whole = compute_metrics(kept.log, cfg.warmup_s, cfg.end_s, "evolving")
    assert whole.finished > 0 and whole.kv_hit_actual > 0  # the figures compared are not all zero
    for online in (fold.metrics("evolving"), fold2.metrics("evolving")):
        assert msgspec.json.encode(online.summary()) == msgspec.json.encode(whole.summary())
        assert online.ttft_s == whole.ttft_s and online.e2e_s == whole.e2e_s
    assert bare.log == [] and bare.events == kept.events == len(kept.log)


def test_session_pool_cycles_with_fresh_block_hashes():
    sessions = generate("cc", seed=2, agents=2)
    src = SessionSource(sessions)
    assert src.get(0) is sessions[0] and src.get(3).id.endswith("~1")
    a = [h for _, _, r in sessions[1].requests() for h in r.blocks]
    b = [h for _, _, r in src.get(3).requests() for h in r.blocks]
    assert len(a) == len(b) and not set(a) & set(b)
    assert len(set(_salt_blocks(a, 1))) == len(set(a))  # a bijection keeps distinct blocks distinct


def test_open_arrivals_start_sessions_at_poisson_times():
    sessions = generate("cc", seed=5, agents=30)
    cfg = SimConfig(nodes=3, duration_s=120.0, warmup_s=60.0, seed=2, agents=None, arrivals_per_min=6.0)
    sim = Simulation(SMALL, get_stack("static:1P2D"), sessions, cfg)
    res = sim.run()
    started = sim._next_session
    assert 8 <= started <= 32  # ~18 expected in 3 minutes at 6 per minute
    assert res.submitted >= started  # every started session submitted its first request
