"""The data plane as an independent choice and composed stacks.

A baseline router plans no peer fetch; with a shared-pool data plane the node's driver plans
it from the directory's lookup, so the same routing runs with or without asynchronous fetch.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from engine.profiles import load_profile
from events.catalog import FirstToken, KvFetched, RequestStarted, RequestSubmitted, RouteDecided
from replay.sim.figures import compute_metrics
from replay.sim.simulation import SimConfig, Simulation
from replay.sim.stacks import PARTS, get_stack
from replay.traces.format import Branch, End, Request, Session

PROFILE = replace(load_profile("gb300-glm52"), prefill_noise=0.0, decode_noise=0.0)


def shared_prefix_sessions(n: int, groups: int = 5, prefix_blocks: int = 256, own_blocks: int = 16,
                           seed: int = 0) -> list[Session]:
    """``n`` one-request sessions in rounds of ``2 * groups``: the first ``groups`` open fresh
    16K-token prefixes (a repository each), the next ``groups`` reuse them in the same order
    and then differ. Round robin over 3 prefill nodes sends the two users of a prefix, 5
    arrivals apart, to different nodes: the second either recomputes the prefix or, with a
    shared pool, fetches it from the peer that computed it."""
    rng = np.random.default_rng(seed)
    out = []
    prefixes: list[list[int]] = []
    for k in range(n):
        if k % (2 * groups) == 0:
            prefixes = [[int(x) for x in rng.integers(1, 2**62, size=prefix_blocks)] for _ in range(groups)]
        prefix = prefixes[k % groups]
        own = [int(x) for x in rng.integers(1, 2**62, size=own_blocks)]
        req = Request(blocks=prefix + own, tail_tokens=10, output_tokens=50)
        out.append(Session(id=f"s{k}", branches=[Branch(id="root", steps=[req, End()])]))
    return out


def run(stack: str, arrivals_per_min: float = 60.0):
    cfg = SimConfig(nodes=4, warmup_s=30.0, duration_s=120.0, seed=5, agents=None,
                    arrivals_per_min=arrivals_per_min)
    return Simulation(PROFILE, get_stack(stack), shared_prefix_sessions(400), cfg).run()


def routes(log) -> list[tuple[str, str, str]]:
    return [(e.request, e.prefill_node, e.decode_node) for e in log if type(e) is RouteDecided and not e.shadow]


@pytest.fixture(scope="module")
def local_and_async():
    return run("static:3P1D+round_robin+local"), run("static:3P1D+round_robin+async")


def test_async_fetch_changes_ttft_not_the_routes(local_and_async):
    local, fetched = local_and_async
    # same routing: round robin sees the same requests at the same times either way
    assert routes(local.log) == routes(fetched.log) and len(routes(local.log)) > 100
    # the router plans no fetch in either run; the data plane does in the async one
    assert all(not e.fetch_plan for e in local.log + fetched.log if type(e) is RouteDecided)
    assert not any(type(e) is KvFetched for e in local.log)
    fetches = [e for e in fetched.log if type(e) is KvFetched]
    assert fetches and all(e.src_node != e.dst_node for e in fetches)
    got = {e.request: e.fetched_tokens for e in fetched.log if type(e) is RequestStarted and e.phase == "prefill"}
    assert sum(got.values()) > 0
    # fetching the shared prefix instead of recomputing it: lower TTFT, less recompute
    m_local = compute_metrics(local.log, 30.0, 150.0, "local")
    m_async = compute_metrics(fetched.log, 30.0, 150.0, "async")
    assert m_async.ttft_mean_s < 0.8 * m_local.ttft_mean_s
    assert m_async.uncached_tokens_per_req < m_local.uncached_tokens_per_req
    assert m_async.lost_kv_reuse < m_local.lost_kv_reuse


def test_fetch_at_prefill_start_charges_the_fetch_to_prefill():
    """Same routing again, under load (requests queue): the fetch now happens when prefill
    starts and its time is added to the prefill iteration (the memory-pool baseline), where the
    asynchronous fetch runs during the queue wait; so TTFT is above the async one's. (On idle
    nodes the two are equal: there is no wait to hide a fetch in.)"""
    fetched = run("static:3P1D+round_robin+async", arrivals_per_min=300.0)
    at_start = run("static:3P1D+round_robin+at_start", arrivals_per_min=300.0)
    assert routes(at_start.log) == routes(fetched.log)
    assert all(e.hidden_s == 0.0 for e in at_start.log if type(e) is KvFetched)
    assert any(e.hidden_s > 0.0 for e in fetched.log if type(e) is KvFetched)

    def ttft(log):
        sub = {e.request: e.ts for e in log if type(e) is RequestSubmitted}
        return float(np.mean([e.ts - sub[e.request] for e in log if type(e) is FirstToken]))

    assert ttft(at_start.log) > ttft(fetched.log)


def test_composed_stack_syntax():
    st = get_stack("static:4P5D+round_robin+async")
    assert (st.planner, st.router, st.fetch_mode, st.eviction, st.split) == ("static", "round_robin", "async", "lru",
                                                                            (4, 5))
    assert not st.plans_fetch and get_stack("evolving").plans_fetch
    # a spec that starts with a part applies it to evolving
    st = get_stack("cache_aware+async")
    assert (st.planner, st.router, st.fetch_mode, st.eviction) == ("evolving", "cache_aware", "async", "count_aware")
    assert get_stack("dynamo+count_aware").eviction == "count_aware"
    assert get_stack("evolving+least_ttft+local").fetch_mode == "none"
    assert get_stack("arrow+restart").mechanism == "restart"
    assert get_stack("evolving+drop_kv").mechanism == "in_place_drop_kv"
    # every part's kind appears once at most; unknown parts and bases are named in the error
    with pytest.raises(KeyError, match="two eviction parts"):
        get_stack("evolving+lru+count_aware")
    with pytest.raises(KeyError, match="unknown part 'fast'"):
        get_stack("static:4P5D+fast")
    with pytest.raises(KeyError, match="unknown stack"):
        get_stack("dynamic+lru")
    assert set(PARTS) >= {"async", "at_start", "local", "lru", "count_aware", "round_robin", "cache_aware"}


def test_the_same_stack_spelled_two_ways_gives_the_same_log():
    """``evolving-cacheaware`` and ``cache_aware+async`` are one stack: byte-identical logs."""
    from tests.unit.replay.sim.test_sim import _encode, _run

    a = _run("evolving-cacheaware", duration=60.0)
    b = _run("cache_aware+async", duration=60.0)
    assert _encode(a.log) == _encode(b.log)


def test_start_is_honoured_for_every_stack():
    for name in ("evolving", "dynamo", "arrow", "static:4P5D", "evolving-static:4P5D", "memory-pool",
                 "static:4P5D+round_robin+async"):
        st = get_stack(name, start="2P7D")
        assert st.initial_roles(9) == ["prefill"] * 2 + ["decode"] * 7, name
    # static stacks keep their own split as the planner's target (ordered at warm-up end)
    cfg = SimConfig(nodes=9)
    assert get_stack("static:4P5D", start="2P7D").core_config(PROFILE, cfg)["planner"]["kwargs"]["initial"] == "4P5D"
    # evolving's warm-up-end reference is the start split
    kw = get_stack("evolving", start="6P3D").core_config(PROFILE, cfg)["planner"]["kwargs"]
    assert kw["initial"] == "6P3D"
    # without --start: unchanged (the pinned golden log depends on it)
    assert "initial" not in get_stack("evolving").core_config(PROFILE, cfg)["planner"]["kwargs"]
    assert get_stack("evolving").initial_roles(9) == ["collocated"] * 9
