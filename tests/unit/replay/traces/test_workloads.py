"""Synthetic workloads: deterministic from the seed, statistics within the documented ranges."""

from __future__ import annotations

import json

import numpy as np
import pytest

from events.catalog import BranchOpened
from replay.traces.fit import workload_samples
from replay.traces.format import encode_session, session_events, validate_session
from replay.traces.pacing import pace_sessions
from replay.traces.stats import trace_stats
from replay.traces.workloads import (
    CC_PARAMS_FILE,
    WORKLOADS,
    AgentPool,
    CcParams,
    Quantiles,
    generate,
    load_cc_params,
)


@pytest.mark.parametrize("name", ["cc", "putnam", "osworld"])
def test_same_seed_same_trace_other_seed_differs(name):
    a = [encode_session(s) for s in generate(name, seed=7, agents=6)]
    b = [encode_session(s) for s in generate(name, seed=7, agents=6)]
    c = [encode_session(s) for s in generate(name, seed=8, agents=6)]
    assert a == b and a != c
    # more agents never change the first ones
    assert [encode_session(s) for s in generate(name, seed=7, agents=8)][:6] == a


@pytest.mark.parametrize("name", ["cc", "putnam", "osworld"])
def test_sessions_are_valid_and_replayable(name):
    for s in generate(name, seed=3, agents=5):
        assert validate_session(s) == []
        evs = session_events(s, 2.0)
        assert sum(isinstance(e, BranchOpened) for e in evs) == len(s.branches)


def test_cc_like_ranges():
    """The generator loads the parameters fitted to the 100 real sessions (replay/traces/cc_params.json)."""
    sessions = generate("cc", seed=1, agents=60)
    sm = workload_samples(sessions)
    pauses = sm.dists["tool pause s"] + sm.dists["human pause s"]
    # recorded pacing keeps the users' think time (mean pause in minutes, as in the real sessions) ...
    assert float(np.mean(pauses)) > 60.0
    # ... and agent pacing replays them as autonomous agents: METHOD.md §5, CC mean pause 13-19 s
    paced = workload_samples(pace_sessions(sessions, "agent")).dists
    assert 13.0 <= float(np.mean(paced["tool pause s"] + paced["human pause s"])) <= 19.0
    assert sm.spawns > 0 and sm.compactions > 0 and sm.resumes > 0
    prompts = sm.dists["prompt tokens"]
    assert float(np.mean(prompts)) > 80_000             # real sessions average ~113k tokens
    assert max(prompts) <= WORKLOADS["cc"].params.context_cap + 250_000  # cap + one growth step
    assert trace_stats(sessions[:8]).ideal_hit_rate > 0.8
    kinds = {r.pause_kind for s in sessions for _b, _i, r in s.requests()}
    assert kinds == {"tool", "human"}


def test_cc_defaults_come_from_the_fit_file():
    doc = json.loads(CC_PARAMS_FILE.read_text())
    assert doc["command"].startswith("evolving trace fit ") and doc["sessions"] == 100
    assert WORKLOADS["cc"].params == load_cc_params() == CcParams.from_json(doc["params"])
    assert isinstance(WORKLOADS["cc"].params.growth, Quantiles)
    with pytest.raises(ValueError, match="unknown CC parameter"):
        CcParams.from_json({"grwoth": 1})


def test_a_bad_params_file_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text('{"params": {"grwoth": 1}}')
    with pytest.raises(ValueError, match=f"{bad}: not a CC parameter file .*unknown CC parameter"):
        load_cc_params(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a CC parameter file"):
        load_cc_params(bad)
    assert load_cc_params(tmp_path / "absent.json") == CcParams()


def test_quantiles_draws_follow_the_fitted_sample():
    rng = np.random.default_rng(0)
    data = rng.lognormal(6.0, 1.5, 5000)
    q = Quantiles.fit(data)
    assert q.at(0.0) == pytest.approx(data.min(), rel=1e-4) and q.at(1.0) == pytest.approx(data.max(), rel=1e-4)
    draws = [q.draw(rng) for _ in range(5000)]
    from scipy.stats import ks_2samp

    assert ks_2samp(data, draws).statistic < 0.03
    assert abs(np.mean(draws) / np.mean(data) - 1) < 0.1
    small = Quantiles.fit([1, 2, 3], integer=True)
    assert len(small.q) == 3 and small.p == () and small.at(0.5) == 2


def test_putnam_like_ranges():
    st = trace_stats(generate("putnam", seed=1, agents=40))
    assert 8.0 <= st.pause_s.mean <= 12.0
    assert st.subagents == 0 and st.branches == st.sessions   # one branch per problem
    assert st.output_tokens.mean > 0.1 * st.prompt_tokens.mean  # decode-heavy
    assert 3_000 < st.output_tokens.p50 < 5_000  # calibrated: best static split 2P7D (docs/traces.md §4)


def test_osworld_like_ranges():
    st = trace_stats(generate("osworld", seed=1, agents=20))
    assert 1.0 <= st.pause_s.mean <= 1.4
    assert st.subagents >= 2 * st.sessions                    # several agents per task
    assert st.prompt_tokens.mean > 100 * st.output_tokens.mean  # prefill-heavy


def test_system_prompt_shared_across_agents_only():
    a, b = generate("cc", seed=0, agents=2)
    ba, bb = a.branches[0].steps[0].blocks, b.branches[0].steps[0].blocks
    shared = 12_000 // 64
    assert ba[:shared] == bb[:shared] and ba[shared] != bb[shared]


def test_open_arrivals_and_pool():
    ss = generate("putnam", seed=2, agents=200, rate_per_min=30.0)
    starts = [s.start_s for s in ss]
    assert starts[0] == 0.0 and starts == sorted(starts)
    assert 0.8 <= (199 / (starts[-1] / 60)) / 30 <= 1.2  # observed rate near 30 per minute
    pool = AgentPool(generate("putnam", seed=2, agents=5), concurrency=2)
    first = pool.start()
    assert [s.id for s in first] == ["putnam-s2-00000", "putnam-s2-00001"]
    assert pool.replace(first[0].id).id == "putnam-s2-00002"
    assert pool.running == {"putnam-s2-00001", "putnam-s2-00002"}
