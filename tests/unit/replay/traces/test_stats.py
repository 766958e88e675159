"""Trace statistics: ideal prefix hits from first principles, counts, distributions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from replay.traces.format import Branch, Request, Session, Spawn
from replay.traces.importers._common import common_prefix
from replay.traces.importers.weka import import_weka
from replay.traces.stats import Dist, ideal_hits, trace_stats

WEKA = Path(__file__).resolve().parents[3] / "fixtures" / "traces" / "weka-claude-code"


def test_ideal_hits_trace_0504_from_the_source_hash_ids():
    doc = json.loads((WEKA / "trace_0504.json").read_text())
    h = [r["hash_ids"] for r in doc["requests"]]
    want = 64 * (common_prefix(h[0], h[1]) + max(common_prefix(h[0], h[2]), common_prefix(h[1], h[2])))
    st = trace_stats(import_weka(WEKA / "trace_0504.json").sessions)
    assert st.ideal_hit_tokens == want == 21_952
    assert st.ideal_hit_rate == pytest.approx(want / sum(r["in"] for r in doc["requests"]))


def test_weka_fixture_counts_and_distributions():
    doc = json.loads((WEKA / "trace_0291.json").read_text())
    st = trace_stats(import_weka(WEKA / "trace_0291.json").sessions)
    assert (st.requests, st.branches, st.subagents, st.compactions) == (32, 3, 2, 0)
    assert st.prompt_tokens.total == doc["totals"]["combined_tokens"]["input"]
    assert st.output_tokens.total == doc["totals"]["combined_tokens"]["output"]
    assert 0.5 < st.ideal_hit_rate < 1.0


def test_cross_session_shared_prefix_and_order():
    shared = Request(blocks=[1, 2], output_tokens=1)
    a = Session(id="a", start_s=0.0, branches=[Branch(id="m", steps=[
        shared, Spawn(branch="s"), Request(blocks=[1, 2, 3], tail_tokens=5, output_tokens=1, pause_s=1)]),
        Branch(id="s", parent="m", mode="subagent", steps=[Request(blocks=[7], output_tokens=1)])])
    b = Session(id="b", start_s=10.0, branches=[Branch(id="m", steps=[Request(blocks=[1, 2, 9], output_tokens=1)])])
    st = trace_stats([b, a])  # list order does not matter: arrival order does
    # a/m/0: miss; a/s/0: miss; a/m/2: hits [1, 2]; b/m/0 (t=10): hits [1, 2]
    assert ideal_hits([b, a]) == (4 * 64, 128 + 64 + 197 + 192)
    assert (st.sessions, st.requests, st.subagents, st.branches) == (2, 4, 1, 3)
    assert st.pause_s.n == 1 and st.pause_s.mean == 1.0


def test_dist():
    d = Dist.of([1, 2, 3, 4, 100])
    assert (d.n, d.p50, d.max, d.total) == (5, 3.0, 100.0, 110.0)
    assert d.p90 == pytest.approx(float(np.percentile([1, 2, 3, 4, 100], 90)))
    assert Dist.of([]) == Dist()
