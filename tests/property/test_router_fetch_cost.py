"""The router's learned fetch cost under random links and random streams
(hypothesis): exact recovery of any FIFO link from its ``KvFetched`` reports however much the
fetches queue, and a model that is always finite and non-negative whatever is reported."""

from __future__ import annotations

import itertools
import math

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.catalog import IterationDone, KvFetched
from services.cores.costmodel import FetchCostLearner, FetchModel
from services.cores.router.least_ttft import LeastTtftRouter
from tests.hyp import examples

BT = 64

fetch = st.tuples(
    st.floats(0.0, 2.0),  # gap since the previous fetch was asked for (s)
    st.integers(0, 2),  # destination node
    st.integers(1, 2000),  # blocks
    st.integers(1, 3),  # sources it is split over
)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(latency=st.floats(0.0, 0.05), s_per_token=st.floats(1e-9, 1e-4),
       fetches=st.lists(fetch, min_size=8, max_size=60))
def test_any_fifo_link_is_recovered_exactly(latency, s_per_token, fetches):
    if len({nb for _, _, nb, _ in fetches}) < 2:
        fetches = [*fetches, (0.0, 0, fetches[0][2] + 1, 1)]
    truth = FetchModel(latency, s_per_token)
    free, now, landed = [0.0] * 3, 0.0, []
    for k, (gap, dst, nb, n_src) in enumerate(fetches):
        now += gap
        start = max(now, free[dst])
        ts = free[dst] = start + truth.fetch_s(nb * BT)
        cuts = sorted({0, nb, *range(1, min(n_src, nb))})
        landed.append((ts, k, [KvFetched(ts=ts, request=f"r{k}", src_node=f"x{j}", dst_node=f"p{dst}",
                                         blocks=list(range(a, b)), duration_s=ts - now)
                               for j, (a, b) in enumerate(itertools.pairwise(cuts))]))
    r = LeastTtftRouter()
    for _, _, evs in sorted(landed, key=lambda x: (x[0], x[1])):
        for e in evs:
            r.apply(e)
    r.apply(IterationDone(ts=now + 1e6, node="p0", phase="decode", duration_s=0.01))
    assert r.fetch.seen == len(fetches) and r.fetch.rejected == 0
    r.fetch.refit()
    m = r.fetch_model
    assert m.s_per_token == pytest.approx(s_per_token, rel=1e-6)
    assert m.latency_s == pytest.approx(latency, rel=1e-6, abs=1e-9)


sample = st.tuples(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10**7)),
                   st.floats(allow_nan=True, allow_infinity=True))


@settings(max_examples=examples(100), deadline=None)
@given(samples=st.lists(sample, max_size=300), min_samples=st.integers(2, 20))
def test_model_is_finite_non_negative_and_snapshots_round_trip(samples, min_samples):
    f = FetchCostLearner(min_samples=min_samples, max_samples=64)
    for tokens, seconds in samples:
        f.add(tokens, seconds)
        m = f.model
        assert math.isfinite(m.latency_s) and math.isfinite(m.s_per_token)
        assert m.latency_s >= 0.0 and m.s_per_token >= 0.0
    assert f.seen + f.rejected == len(samples) and len(f.samples) <= 64
    enc = msgspec.msgpack.encode(f.to_state())
    g = FetchCostLearner.from_state(msgspec.msgpack.decode(enc))
    assert g.to_state() == f.to_state() and g.model == f.model
