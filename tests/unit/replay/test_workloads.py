"""Synthetic workloads: deterministic from the seed, statistics within the documented ranges."""

from __future__ import annotations

import pytest

from events.catalog import BranchOpened
from replay.stats import trace_stats
from replay.trace import encode_session, session_events, validate_session
from replay.workloads import AgentPool, generate


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
    st = trace_stats(generate("cc", seed=1, agents=30))
    assert 13.0 <= st.pause_s.mean <= 19.0          # METHOD.md §5
    assert st.subagents > 0 and st.compactions > 0
    assert st.prompt_tokens.p50 > 20_000             # long contexts
    assert st.prompt_tokens.max <= 120_000 + 40_000  # compaction threshold + one tool result
    assert st.ideal_hit_rate > 0.8


def test_putnam_like_ranges():
    st = trace_stats(generate("putnam", seed=1, agents=40))
    assert 8.0 <= st.pause_s.mean <= 12.0
    assert st.subagents == 0 and st.branches == st.sessions   # one branch per problem
    assert st.output_tokens.mean > 0.2 * st.prompt_tokens.mean  # decode-heavy


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
