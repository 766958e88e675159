"""The router's fetch cost, learned online from ``KvFetched``.

The streams below come from a model of the simulator's fetch link: one FIFO link per
destination node, a fetch of ``tokens`` occupies it for ``latency + tokens * s_per_token``,
and its ``KvFetched`` (one per source node) lands when the transfer ends with ``duration_s`` =
queued + transfer time, as ``engine/backends/sim/node.py`` reports it.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from events.catalog import IterationDone, KvFetched, RouteDecided
from services.cores.costmodel import PRIOR_FETCH, FetchCostLearner, FetchModel
from services.cores.router.least_ttft import LeastTtftRouter
from services.drivers.bench import scenario as s

BT = 64
# what the gb300-glm52 profile's link charges: 44,928 B/token at 40 GB/s, 2 ms setup
TRUE = FetchModel(latency_s=0.002, s_per_token=44928 / 40e9)


def link_stream(n: int, truth: FetchModel = TRUE, seed: int = 0, nodes: int = 3, mean_gap_s: float = 0.05,
                sources: int = 2, outliers: float = 0.0) -> list[KvFetched]:
    """``n`` fetches over ``nodes`` FIFO links, Poisson arrivals (mean gap ``mean_gap_s``, so
    many fetches queue behind others), 1-400 blocks each, split over ``sources`` peers; a share
    ``outliers`` of them is reported 5-20x slower than the link charged."""
    rng = np.random.default_rng(seed)
    free = [0.0] * nodes
    now = 0.0
    out: list[KvFetched] = []
    pending: list[tuple[float, list[KvFetched]]] = []
    for k in range(n):
        now += float(rng.exponential(mean_gap_s))
        dst = int(rng.integers(nodes))
        nb = int(rng.integers(1, 401))
        start = max(now, free[dst])
        dur = truth.fetch_s(nb * BT)
        if rng.random() < outliers:
            dur *= float(rng.uniform(5, 20))
        free[dst] = start + dur
        ts = start + dur
        cuts = sorted({0, nb, *(int(c) for c in rng.integers(1, nb + 1, size=sources - 1))})
        evs = [KvFetched(ts=ts, src=f"p{dst:02d}", request=f"r{k}", src_node=f"x{j}", dst_node=f"p{dst:02d}",
                         blocks=list(range(a, b)), duration_s=ts - now)
               for j, (a, b) in enumerate(itertools.pairwise(cuts)) if b > a]
        pending.append((ts, evs))
    pending.sort(key=lambda p: p[0])  # events are emitted when each fetch lands
    for _, evs in pending:
        out.extend(evs)
    return out


def feed(router, events):
    out = []
    for ev in events:
        out.extend(router.apply(ev))
    return out


def close(router, ts: float) -> None:
    """Any later event closes the fetches that landed before it."""
    router.apply(IterationDone(ts=ts, node="p00", phase="decode", duration_s=0.01))


def test_learns_the_links_per_token_cost_through_queueing():
    r = LeastTtftRouter()
    evs = link_stream(400, nodes=2, mean_gap_s=0.01)  # links ~80 % busy: most fetches queue
    fetches = {e.request: e for e in evs}
    queued = sum(1 for e in fetches.values() if e.duration_s > TRUE.fetch_s(400 * BT))
    assert queued > 200  # raw durations overstate the link
    feed(r, evs)
    close(r, evs[-1].ts + 1.0)
    m = r.fetch_model
    assert m.s_per_token == pytest.approx(TRUE.s_per_token, rel=1e-3)
    assert m.latency_s == pytest.approx(TRUE.latency_s, rel=1e-2)
    assert r.fetch.seen == 400 and r.fetch.rejected == 0
    # ~2.8x what the router assumed before it measured anything
    assert m.s_per_token > 2.5 * PRIOR_FETCH.s_per_token


def test_raw_durations_would_overstate_the_link():
    """The departure-interval correction is what makes the estimate right: fitting the raw
    ``duration_s`` (queued time included) of the same stream is far off."""
    evs = link_stream(400, nodes=2, mean_gap_s=0.01)
    raw = FetchCostLearner()
    by_fetch: dict[str, list[KvFetched]] = {}
    for e in evs:
        by_fetch.setdefault(e.request, []).append(e)
    for group in by_fetch.values():
        raw.add(sum(len(e.blocks) for e in group) * BT, group[0].duration_s)
    assert raw.model.s_per_token > 1.2 * TRUE.s_per_token or raw.model.latency_s > 5 * TRUE.latency_s


def test_prior_until_enough_fetches_then_learned():
    r = LeastTtftRouter(fetch_min_samples=8)
    evs = link_stream(40, mean_gap_s=1.0)
    requests = list(dict.fromkeys(e.request for e in evs))
    first8 = [e for e in evs if e.request in set(requests[:8])]
    # 7 closed, the 8th still pending (no later event yet)
    feed(r, first8)
    assert r.fetch.seen == 7
    assert r.fetch_model == FetchModel(0.002, 4e-7)
    close(r, first8[-1].ts + 0.5)
    assert r.fetch.seen == 8
    assert r.fetch_model.s_per_token == pytest.approx(TRUE.s_per_token, rel=1e-3)


def test_robust_to_a_minority_of_slow_reports():
    r = LeastTtftRouter()
    feed(r, link_stream(500, outliers=0.15, seed=3))
    close(r, 1e9)
    assert r.fetch_model.s_per_token == pytest.approx(TRUE.s_per_token, rel=0.1)
    assert r.fetch_model.latency_s < 0.01


def test_noisy_link_converges_within_a_few_percent():
    rng = np.random.default_rng(7)
    f = FetchCostLearner()
    for _ in range(256):
        tokens = int(rng.integers(1, 400)) * BT
        f.add(tokens, TRUE.fetch_s(tokens) * float(rng.lognormal(0.0, 0.05)))
    assert f.model.s_per_token == pytest.approx(TRUE.s_per_token, rel=0.03)


def test_bad_reports_are_rejected_not_learned():
    r = LeastTtftRouter()
    bad = [KvFetched(ts=1.0, request="a", src_node="x", dst_node="p00", blocks=[1], duration_s=0.0),
           KvFetched(ts=2.0, request="b", src_node="x", dst_node="p00", blocks=[], duration_s=0.1),
           KvFetched(ts=3.0, request="c", src_node="x", dst_node="p00", blocks=[1, 2], duration_s=math.nan),
           KvFetched(ts=4.0, request="d", src_node="x", dst_node="p00", blocks=[1], duration_s=-1.0)]
    feed(r, bad)
    close(r, 10.0)
    assert r.fetch.rejected == 4 and r.fetch.seen == 0
    assert r.fetch_model == PRIOR_FETCH
    with pytest.raises(ValueError, match="min_samples"):
        FetchCostLearner(min_samples=1)
    with pytest.raises(ValueError, match="finite"):
        FetchCostLearner(FetchModel(math.inf, 1e-7))


def test_learn_fetch_off_keeps_the_configured_cost():
    r = LeastTtftRouter(learn_fetch=False, fetch_s_per_token=3e-7)
    feed(r, link_stream(100))
    close(r, 1e9)
    assert r.fetch.seen == 100  # still measured (and snapshotted), not used
    assert r.fetch_model == FetchModel(0.002, 3e-7)


def test_snapshot_restore_mid_stream_equals_uninterrupted():
    evs = link_stream(120, seed=11)
    whole = LeastTtftRouter()
    feed(whole, evs)
    close(whole, 1e9)
    part = LeastTtftRouter()
    feed(part, evs[:61])  # mid-fetch: a pending fetch and a half-filled refit interval
    restored = LeastTtftRouter.from_snapshot(part.snapshot())
    assert restored.snapshot() == part.snapshot()
    feed(restored, evs[61:])
    close(restored, 1e9)
    assert restored.fetch_model == whole.fetch_model
    assert restored.snapshot() == whole.snapshot()


PREFIX = s.blocks(1_000, 200)  # 12,800 tokens


def popular_prefix(fetches: list[KvFetched]) -> list:
    """Measured fetches (``fetches``) first; then p00 alone gets 2 requests queued (~1 s of
    prefill) and holds the prefix; p01 joins idle; then a new request of the prefix."""
    t0 = math.ceil(fetches[-1].ts) + 1.0 if fetches else 0.0
    evs: list = list(fetches)
    evs += s.register(1, 1, ts=t0) + [s.branch("hot", t0), s.branch("new", t0)]
    for i in range(2):
        evs.append(s.submit(f"q{i}", "hot", PREFIX + s.blocks(10_000 + 100 * i, 40), t0 + 1.0))
    evs += s.store("p00", PREFIX, t0 + 1.5)
    evs += [e for e in s.register(2, 0, ts=t0 + 2.0) if e.node != "p00"]
    evs.append(s.submit("w", "new", PREFIX + s.blocks(50_000, 10), t0 + 3.0))
    return evs


def test_a_slow_measured_link_changes_the_decision():
    """Under the prior the 12,800-token fetch to idle p01 costs ~7 ms and wins; once the router
    has measured a link that charges 100 us/token, that fetch (1.3 s) costs more than waiting
    for p00's queue (~1 s), and the request goes to the holder."""
    slow = FetchModel(latency_s=0.002, s_per_token=1e-4)
    measured = link_stream(16, truth=slow, mean_gap_s=10.0, nodes=1)
    prior_r, learned_r = LeastTtftRouter(), LeastTtftRouter()
    rd_prior = [e for e in feed(prior_r, popular_prefix([])) if isinstance(e, RouteDecided)][-1]
    rd_learned = [e for e in feed(learned_r, popular_prefix(measured)) if isinstance(e, RouteDecided)][-1]
    assert learned_r.fetch_model.s_per_token == pytest.approx(1e-4, rel=1e-3)
    assert (rd_prior.request, rd_prior.prefill_node) == ("w", "p01") and rd_prior.fetch_plan
    assert (rd_learned.request, rd_learned.prefill_node) == ("w", "p00") and not rd_learned.fetch_plan
    by_node = {sc.node: sc for sc in rd_learned.scores}
    assert by_node["p01"].fetch_excess_s == pytest.approx(slow.fetch_s(200 * BT), rel=1e-3)


def shared_prefix_sessions(n: int, seed: int = 0) -> list:
    """One-request sessions over a few repositories: a third of them open a fresh 16K-64K-token
    prefix, the others reuse one of the last 12 opened and add their own 1K tokens. A reuse
    placed on a node other than the prefix's holders fetches it from them."""
    from replay.traces.format import Branch, End, Request, Session

    rng = np.random.default_rng(seed)
    out, prefixes = [], []
    for k in range(n):
        if not prefixes or rng.random() < 1 / 3:
            prefixes = [*prefixes[-11:], [int(x) for x in rng.integers(1, 2**62, size=int(rng.integers(256, 1025)))]]
        prefix = prefixes[int(rng.integers(len(prefixes)))]
        own = [int(x) for x in rng.integers(1, 2**62, size=16)]
        out.append(Session(id=f"s{k}", branches=[Branch(id="root", steps=[
            Request(blocks=prefix + own, tail_tokens=10, output_tokens=50), End()])]))
    return out


def test_simulator_run_learns_what_the_sim_link_charges():
    """After a simulated run with our router and asynchronous fetch, the fetch cost the router
    charges is the one the simulated link charged (``Profile.fetch_s``), within 20 %, where the
    prior was ~2.8x too cheap."""
    from dataclasses import replace

    from engine.profiles import load_profile
    from replay.sim.simulation import SimConfig, Simulation
    from replay.sim.stacks import get_stack

    prof = replace(load_profile("gb300-glm52"), prefill_noise=0.0, decode_noise=0.0)
    cfg = SimConfig(nodes=4, warmup_s=10.0, duration_s=120.0, seed=3, agents=None, arrivals_per_min=120.0,
                    directory_core=False)
    sim = Simulation(prof, get_stack("evolving-static:3P1D", start="3P1D"), shared_prefix_sessions(400), cfg)
    res = sim.run()
    router = sim.cores[-1]
    assert isinstance(router, LeastTtftRouter)
    fetched = [e for e in res.log if type(e) is KvFetched]
    assert len({e.request for e in fetched}) >= 12
    true_spt = prof.kv_bytes_per_token / prof.fetch_bandwidth_Bps
    assert PRIOR_FETCH.s_per_token < 0.5 * true_spt
    m = router.fetch_model
    assert m.s_per_token == pytest.approx(true_spt, rel=0.2)
    for tokens in (4_096, 16_384, 65_536):
        assert m.fetch_s(tokens) == pytest.approx(prof.fetch_s(tokens), rel=0.2)
