"""The soak's accounting and flatness verdicts (services/drivers/soak/stats.py), the duration
parser, and how the sampler names and finds the stack's processes."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.drivers.soak.procs import Sampler, descendants, role_of
from services.drivers.soak.run import parse_duration
from services.drivers.soak.stats import (
    Flatness,
    Outcome,
    flat,
    intervals,
    nearest_rank,
    poisson_floor,
    recorded_check,
    second_half,
    slope_per_min,
    verdict,
)
from tests.hyp import examples

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)
latency = st.floats(min_value=0.0, max_value=100.0, allow_nan=False)


# --------------------------------------------------------------------------- percentiles
@settings(max_examples=examples(40))  # each example sorts or fits; 40 cover the shapes, cheaply
@given(st.lists(finite, min_size=1, max_size=200), st.floats(min_value=0.001, max_value=1.0))
def test_nearest_rank_is_a_sample_value_and_numpys_inverted_cdf(xs, q):
    p = nearest_rank(xs, q)
    assert p in xs
    assert p == pytest.approx(float(np.percentile(xs, q * 100, method="inverted_cdf")))
    # at least a q share of the sample is <= p, and less than that is < p
    assert sum(x <= p for x in xs) >= q * len(xs) - 1e-9
    assert sum(x < p for x in xs) < q * len(xs) + 1e-9


@settings(max_examples=examples(40))  # each example sorts or fits; 40 cover the shapes, cheaply
@given(st.lists(finite, min_size=1, max_size=100), st.floats(0.01, 1.0), st.floats(0.01, 1.0))
def test_nearest_rank_is_monotone_in_q(xs, a, b):
    lo, hi = sorted((a, b))
    assert nearest_rank(xs, lo) <= nearest_rank(xs, hi)
    assert nearest_rank(xs, 1.0) == max(xs)


def test_nearest_rank_edges():
    assert nearest_rank([], 0.5) is None
    assert nearest_rank([3.0, 1.0, 2.0], 0.5) == 2.0
    assert nearest_rank([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0  # ceil(0.5 * 4) = 2nd value, no interpolation
    with pytest.raises(ValueError, match="quantile"):
        nearest_rank([1.0], 0.0)


# --------------------------------------------------------------------------- intervals
outcomes = st.lists(st.builds(Outcome, sent_s=st.floats(0.0, 59.999), ok=st.booleans(),
                              ttft_s=st.one_of(st.none(), latency), e2e_s=latency, wait_s=latency), max_size=150)


@settings(max_examples=examples(40))  # each example sorts or fits; 40 cover the shapes, cheaply
@given(outcomes, st.lists(st.floats(0.0, 59.999), max_size=10), st.sampled_from([1.0, 7.0, 10.0, 60.0]))
def test_intervals_conserve_every_request(outs, in_flight, width):
    rows = intervals(outs, width, 60.0, in_flight)
    assert len(rows) == math.ceil(60.0 / width)
    assert sum(r.sent for r in rows) == len(outs) + len(in_flight)
    assert sum(r.answered for r in rows) == sum(o.ok for o in outs)
    assert sum(r.failed for r in rows) == sum(not o.ok for o in outs)
    for r in rows:
        inside = [o for o in outs if r.start_s <= o.sent_s < r.start_s + width]
        assert r.answered + r.failed == len(inside)  # bucketed by the second it was sent in
        e2e = [o.e2e_s for o in inside if o.ok]
        if e2e:
            assert r.e2e_p50_s in e2e and r.e2e_p99_s in e2e and r.e2e_p50_s <= r.e2e_p99_s
        else:
            assert r.e2e_p50_s is None and r.e2e_p99_s is None


def test_intervals_take_only_answered_latencies():
    outs = [Outcome(0.5, True, 0.1, 0.2), Outcome(0.6, False, None, 9.0, error="HTTP 503"),
            Outcome(1.5, True, 0.3, 0.4)]
    rows = intervals(outs, 1.0, 2.0)
    assert [(r.sent, r.answered, r.failed) for r in rows] == [(2, 1, 1), (1, 1, 0)]
    assert rows[0].e2e_p99_s == 0.2 and rows[0].ttft_p50_s == 0.1  # the failure's 9 s is not a latency


# --------------------------------------------------------------------------- slopes and flatness
@settings(max_examples=examples(40))  # each example sorts or fits; 40 cover the shapes, cheaply
@given(st.floats(-1e3, 1e3), st.floats(-10.0, 10.0), st.integers(3, 60))
def test_slope_of_a_line_is_its_slope_per_minute(a, b, n):
    ts = [5.0 * i for i in range(n)]
    assert slope_per_min(ts, [a + b * t for t in ts]) == pytest.approx(b * 60, rel=1e-6, abs=1e-6)


@settings(max_examples=examples(40))  # each example sorts or fits; 40 cover the shapes, cheaply
@given(st.floats(-10.0, 10.0), st.integers(12, 60), st.data())
def test_one_outlier_does_not_make_a_trend(b, n, data):
    ts = [5.0 * i for i in range(n)]
    ys = [100.0 + b * t for t in ts]
    k = data.draw(st.integers(0, n - 1))
    ys[k] += data.draw(st.sampled_from([-1e4, 1e4]))  # one slow scrape, one allocator step
    assert slope_per_min(ts, ys) == pytest.approx(b * 60, rel=1e-6, abs=1e-6)


def test_second_half_keeps_the_points_after_the_middle():
    t, y = second_half([0, 10, 20, 30, 40], [1, None, 3, 4, 5])
    assert list(t) == [20, 30, 40] and list(y) == [3, 4, 5]
    t, y = second_half([], [])
    assert len(t) == 0


@settings(max_examples=examples(40))  # each example sorts or fits; 40 cover the shapes, cheaply
@given(st.floats(0.0, 5.0), st.floats(0.2, 10.0))
def test_flat_fails_exactly_when_growth_beats_the_limit(growth_mb_min, limit):
    ts = [5.0 * i for i in range(120)]
    ys = [300.0 + growth_mb_min / 60 * t for t in ts]
    f = flat("rss x", ts, ys, limit=limit, unit="MB/min")
    assert f.judged and f.points == 60
    assert f.ok == (growth_mb_min <= limit + 1e-9) or math.isclose(growth_mb_min, limit, rel_tol=1e-6)


def test_flat_judges_only_growth_and_relative_limits_scale_with_the_median():
    ts = [10.0 * i for i in range(60)]
    assert flat("rss x", ts, [500 - t for t in ts], limit=1.0, unit="MB/min").ok  # memory given back
    # latency: 5 %/min of a 200 ms median is 10 ms/min; 20 ms/min of drift fails, 5 ms/min passes
    up20 = [0.2 + 0.02 / 60 * (t - 450) for t in ts]  # centred on the second half
    up5 = [0.2 + 0.005 / 60 * (t - 450) for t in ts]
    f = flat("e2e p50", ts, up20, limit=0.05, unit="s/min", relative=True)
    assert not f.ok and f.limit == pytest.approx(0.05 * f.median) and f.median == pytest.approx(0.2, rel=0.02)
    assert flat("e2e p50", ts, up5, limit=0.05, unit="s/min", relative=True).ok
    floored = flat("ttft p50", ts, [1e-4] * 60, limit=0.05, unit="s/min", relative=True, floor=0.002)
    assert floored.limit == 0.002
    few = flat("rss y", list(range(8)), [100 * i for i in range(8)], limit=1.0, unit="MB/min")
    assert not few.judged and few.ok and few.slope > 1.0  # shown, not judged


# --------------------------------------------------------------------------- recorded, verdict
@given(st.integers(1, 10_000), st.integers(0, 10_000), st.integers(0, 5), st.integers(0, 3))
def test_recorded_ok_iff_every_stream_event_is_a_row(messages, recorded, dead, gap):
    rows = max(recorded, 1) + 7
    r = recorded_check(messages, messages, recorded, dead, log_rows=rows, log_max_seq=rows + gap)
    assert r.ok == (recorded == messages and dead == 0 and gap == 0)
    assert r.missing == max(0, messages - recorded)


def _verdict(**kw):
    base = {"sent": 100, "answered": 100, "failed": 0, "expected_arrivals": 100.0,
                "recorded": recorded_check(10, 10, 10, log_rows=12, log_max_seq=12), "verify_ok": True,
                "flatness": [Flatness("rss a", "MB/min", 0.1, 1.0, 60)]}
    return verdict(**{**base, **kw})


def test_verdict_names_every_failure():
    assert _verdict().ok
    assert _verdict(failed=2, answered=98).reasons == ["2 request(s) failed"]
    assert "never answered" in _verdict(answered=97).reasons[0]
    assert "Poisson floor" in _verdict(sent=60, answered=60).reasons[0]  # 100 - 3 * 10 = 70
    assert "recorder" in _verdict(recorded=recorded_check(10, 10, 9)).reasons[0]
    assert "verify" in _verdict(verify_ok=False).reasons[0]
    assert _verdict(verify_ok=None).ok  # --no-verify
    assert _verdict(restarts=["router (1 new pid(s))"]).reasons == ["restarted: router (1 new pid(s))"]
    grows = _verdict(flatness=[Flatness("fds gateway", "fds/min", 12.0, 0.5, 60)])
    assert grows.reasons == ["not flat: fds gateway grows 12 fds/min (limit 0.5)"]
    shown = _verdict(flatness=[Flatness("rss soak", "MB/min", 9.0, 1.0, 60, judged=False)])
    assert shown.ok


@given(st.floats(1.0, 1e6))
def test_poisson_floor_is_three_sigma_below_the_mean(m):
    assert poisson_floor(m) == pytest.approx(max(0.0, m - 3 * math.sqrt(m)))
    assert poisson_floor(m) < m


# --------------------------------------------------------------------------- parsing, processes
@pytest.mark.parametrize(("raw", "s"), [("10m", 600.0), ("8s", 8.0), ("90", 90.0), ("1.5m", 90.0), ("1h", 3600.0)])
def test_parse_duration(raw, s):
    assert parse_duration(raw) == s


@pytest.mark.parametrize("raw", ["", "m", "-1s", "0", "ten", "nanm", "infs"])
def test_parse_duration_refuses_bad_input(raw):
    with pytest.raises(ValueError, match="--duration"):
        parse_duration(raw)


@pytest.mark.parametrize(("argv", "role"), [
    (["/usr/bin/nats-server", "-c", "x.conf"], "nats-server"),
    (["python", "-m", "services.drivers.serve", "recorder", "--db", "x"], "recorder"),
    (["python", "-m", "services.drivers.serve", "router", "--router", "rr", "--shadow", "rr"], "shadow-rr"),
    (["python", "-m", "engine.worker", "--node", "n3", "--role", "decode"], "engine-n3"),
    (["python", "-m", "services.drivers.gateway", "--port", "0"], "gateway"),
    (["python", "-m", "services.drivers.cli", "up", "--engines", "4"], "up"),
    (["/x/.venv/bin/python", "/x/.venv/bin/evolving", "up"], "up"),
    (["/x/.venv/bin/python", "/x/.venv/bin/evolving", "soak"], None),
    (["timeout", "60", "sleep", "1"], None),
    ([], None),
])
def test_role_of_names_the_stacks_processes(argv, role):
    assert role_of(argv) == role


def test_sampler_walks_the_tree_and_reads_rss_and_fds():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        import os

        assert child.pid in descendants(os.getpid())
        s = Sampler(os.getpid())
        s.sample(0.0)
        s.sample(1.0)
        me = s.series["soak"]  # this process, as the client
        assert me.t_s == [0.0, 1.0] and min(me.rss_bytes) > 1e6 and min(me.fds) >= 3 and me.cpu_s[1] >= me.cpu_s[0] > 0
        assert all(0 < a < r for a, r in zip(me.anon_bytes, me.rss_bytes, strict=True))  # heap, not the libraries
        # the sleeping child is not a stack role; the test session's own nats-server (the conftest
        # fixture, a child of this process when it started here) is one
        assert s.restarts() == [] and set(s.series) - {"nats-server"} == {"soak"}
    finally:
        child.kill()
        child.wait()


def test_soak_profile_shrinks_the_kv_tiers_and_keeps_the_rest(tmp_path):
    from engine.profiles import load_profile
    from services.drivers.soak.live_up import LiveUpError, soak_profile

    base = load_profile("gb300-glm52")
    prof = load_profile(str(soak_profile("gb300-glm52", 131_072, tmp_path / "p.toml")))
    assert (prof.l1_capacity_tokens, prof.l2_capacity_tokens) == (131_072, 262_144)
    assert prof.name == "gb300-glm52-soak" and (prof.c1, prof.d0, prof.block_tokens) == (base.c1, base.d0, 64)
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n')
    with pytest.raises(LiveUpError, match="l1_capacity_tokens"):
        soak_profile(str(bad), 1024, tmp_path / "out.toml")


def test_machine_cpu_splits_into_the_stacks_and_other_work():
    from services.drivers.soak.procs import Series

    s = Sampler(None)
    s.machine = [(0.0, 100.0, 3.0), (10.0, 115.0, 4.0), (20.0, 125.0, 2.5)]  # 1.5 then 1.0 cores busy
    s.series["router"] = Series(t_s=[0.0, 10.0, 20.0], rss_bytes=[1, 1, 1], anon_bytes=[1, 1, 1], fds=[8, 8, 8],
                                cpu_s=[5.0, 7.0, 8.0], pids=[7, 7, 7])
    s.series["gateway"] = Series(t_s=[0.0, 10.0, 20.0], rss_bytes=[1, 1, 1], anon_bytes=[1, 1, 1], fds=[8, 8, 8],
                                 cpu_s=[1.0, 4.0, 50.0], pids=[9, 9, 10])  # restarted: its CPU not counted
    m = s.machine_dict()
    assert m["busy_cores"] == [1.5, 1.0] and m["stack_cores"] == [0.5, 0.1]
    assert m["other_cores"] == [1.0, 0.9] and m["load1"] == [4.0, 2.5]
