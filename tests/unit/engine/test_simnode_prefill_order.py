"""The simulated prefill queue's order (issue 41 part 3, engine/backends/sim/prefill_order.py):
``fcfs`` serves a long cold prompt before the short ones behind it; ``short_first`` serves the
short ones first in time-bounded iterations, and the long one still finishes (aging)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.backends.sim.node import PrefillJob, SimNode
from engine.backends.sim.prefill_order import (
    AGING,
    LONG_SHARE,
    chunk_s,
    chunk_within,
    iteration_cap_s,
    order_key,
    remaining_s,
)
from engine.profiles import load_profile
from events.catalog import FirstToken, IterationDone, RequestStarted
from services.cores.directory.eviction import LruEviction
from tests.unit.engine.test_simnode import Host

P = replace(load_profile("gb300-glm52-pressure"), prefill_noise=0.0, decode_noise=0.0)
LONG, SHORT = 300_000, 2_000


def _job(rid: str, prompt: int, base: int, at: float = 0.0) -> PrefillJob:
    blocks = list(range(base, base + prompt // P.block_tokens))
    return PrefillJob(request=rid, blocks=blocks, prompt_tokens=prompt, max_tokens=2, decode_node="d",
                      fetch_plan=[], enqueued_s=at)


class _Host(Host):
    def add(self, nid, role, fetch_mode="async"):
        n = SimNode(nid, role, P, self, seed=1, fetch_mode=fetch_mode)
        self.nodes[nid] = n
        return n


def _run(order: str) -> Host:
    """A 300K cold prompt at t = 0, four 2K ones at t = 1 s, on one prefill node."""
    h = _Host()
    h.policy = LruEviction(P.block_tokens)
    node = h.add("p", "prefill")
    h.add("d", "decode")
    node.prefill_order = order
    node.enqueue_prefill(_job("long", LONG, 1_000_000))
    for i in range(4):
        h.q.schedule(1.0, node.enqueue_prefill, _job(f"s{i}", SHORT, 10_000 * (i + 1), at=1.0))
    h.run()
    return h


def _first_token(h: Host) -> dict[str, float]:
    return {e.request: e.ts for e in h.log if isinstance(e, FirstToken)}


def test_fcfs_blocks_the_short_prompts_behind_the_long_one():
    ft = _first_token(_run("fcfs"))
    assert all(ft[f"s{i}"] >= ft["long"] for i in range(4))  # head-of-line blocking: with its last chunk
    assert ft["s0"] > 30.0


def test_short_first_serves_short_prompts_within_a_bounded_iteration_and_finishes_the_long_one():
    h = _run("short_first")
    ft = _first_token(h)
    fcfs = _first_token(_run("fcfs"))
    cap = iteration_cap_s(P)
    # the short ones start at the first iteration boundary after they arrive: at most one
    # bounded iteration (plus their own) after t = 1 s
    assert all(ft[f"s{i}"] < 1.0 + 2 * cap + 0.2 for i in range(4))
    assert ft["long"] > ft["s3"]
    # the long prompt pays the fixed cost of more iterations, a few percent, not a starvation
    assert fcfs["long"] < ft["long"] < 1.10 * fcfs["long"]
    # every iteration but those carrying a single job stays within the cap (noise is off)
    for e in h.log:
        if isinstance(e, IterationDone) and e.phase == "prefill" and e.batch > 1:
            assert P.prefill_iteration_s(e.sum_t_uc, e.sum_A, e.sum_t_rst) <= cap + 1e-9
    started = {e.request for e in h.log if isinstance(e, RequestStarted) and e.phase == "prefill"}
    assert started == {"long", "s0", "s1", "s2", "s3"}


def test_order_key_ages_a_long_request_ahead_of_new_short_ones():
    long = _job("long", LONG, 0, at=0.0)
    long.est_uc = LONG
    short = _job("short", SHORT, 0, at=0.0)
    short.est_uc = SHORT
    assert remaining_s(P, long) == pytest.approx(chunk_s(P, LONG, 0)) and remaining_s(P, long) > 50
    assert order_key(P, short, 0.0) < order_key(P, long, 0.0)
    # a new short request: the long one goes first once it has waited its own service time
    wait = (remaining_s(P, long) - remaining_s(P, short)) / AGING
    fresh = replace(short, enqueued_s=wait + 1.0)
    assert order_key(P, long, wait + 1.0) < order_key(P, fresh, wait + 1.0)
    hint = replace(long, priority=1)  # the agent hint still comes first
    assert order_key(P, hint, 0.0) < order_key(P, short, 0.0)


def test_an_aged_long_prompt_leaves_short_ones_their_share():
    """A 300K cold prompt that has waited past its own service time is ahead of every short one
    in the order, yet while short ones are eligible it takes at most LONG_SHARE of each
    iteration: the short ones are served within a few bounded iterations, not after it."""
    h = _Host()
    h.policy = LruEviction(P.block_tokens)
    node = h.add("p", "prefill")
    h.add("d", "decode")
    node.prefill_order = "short_first"
    long = _job("long", LONG, 1_000_000, at=-200.0)  # it has waited 200 s, beyond its own ~90 s
    node.enqueue_prefill(long)
    shorts = [_job(f"s{i}", SHORT, 10_000 * (i + 1), at=1.0) for i in range(4)]
    for j in shorts:
        h.q.schedule(1.0, node.enqueue_prefill, j)
    h.q.schedule(1.0, lambda: orders.append(node._prefill_batch_order(1.0)[0].request))
    orders: list[str] = []
    h.run()
    ft = _first_token(h)
    cap = iteration_cap_s(P)
    assert orders == ["long"]  # aged ahead of every short one
    assert all(ft[f"s{i}"] < 1.0 + 4 * cap for i in range(4)) and ft["long"] > ft["s3"]
    shared = [e for e in h.log if isinstance(e, IterationDone) and e.phase == "prefill" and e.batch > 1]
    assert shared  # the long one kept progressing beside them, within its share
    for e in shared:
        assert P.prefill_iteration_s(e.sum_t_uc, e.sum_A, 0) <= cap + 1e-9
    assert LONG_SHARE < 1


@pytest.mark.parametrize("before", [0, 100_000, 300_000])
def test_chunk_within_is_the_largest_chunk_that_fits(before):
    t = 0.3
    x = chunk_within(P, t, before)

    def cost(c: int) -> float:
        return P.c1 * c + P.c2 * (c * before + c * (c + 1) / 2)

    assert x >= 1 and cost(x) <= t < cost(x + 1)
