"""A queued prefill job keeps the prefix its node already holds.

Before the fix a queued job pinned its blocks only once fetched KV had landed (or it had
started); a job whose prefix was all local pinned nothing, so the stores of the requests ahead
of it in the queue could evict exactly the KV it was routed there to reuse. Under count-aware
eviction that prefix is often count 0 on this node (the branch's count stays where its KV last
was until the KV moves), so it went first.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.backends.sim.node import PrefillJob, SimNode
from engine.profiles import load_profile
from events.catalog import RequestStarted
from services.cores.directory.eviction import CountAwareEviction, LruEviction
from tests.unit.engine.simnode_host import DirectoryHost

BLOCKS = 40  # per tier
P = replace(load_profile("gb300-glm52"), prefill_noise=0.0, decode_noise=0.0,
            l1_capacity_tokens=BLOCKS * 64, l2_capacity_tokens=BLOCKS * 64)


def job(rid: str, blocks: list[int], prompt: int) -> PrefillJob:
    return PrefillJob(request=rid, blocks=blocks, prompt_tokens=prompt, max_tokens=1, decode_node="d",
                      fetch_plan=[], enqueued_s=0.0)


@pytest.mark.parametrize("policy", [CountAwareEviction(64), LruEviction(64)], ids=["count_aware", "lru"])
def test_a_queued_job_keeps_its_local_prefix_while_the_jobs_ahead_store_theirs(policy):
    h = DirectoryHost(policy)
    p = h.nodes["p"] = SimNode("p", "prefill", P, h, seed=1)
    h.nodes["d"] = SimNode("d", "decode", P, h, seed=2)
    prefix = list(range(1, 11))  # 10 blocks held on p, the oldest copies there
    p._store("L1", prefix)
    p._store("L2", prefix)
    # a job ahead that takes three prefill iterations (3 x the 16,384-token budget), then
    # stores 32 new blocks: 10 + 32 > 40, so the store must evict while r still waits
    p.enqueue_prefill(job("x", list(range(100, 132)), 3 * P.prefill_token_budget))
    p.enqueue_prefill(job("r", [*prefix, 300], 11 * 64))  # routed here for its local prefix
    while h.q.step():
        pass
    started = next(e for e in h.log if type(e) is RequestStarted and e.request == "r" and e.phase == "prefill")
    x_first = next(e for e in h.log if type(e) is RequestStarted and e.request == "x")
    assert started.ts > x_first.ts  # r waited in the queue behind x
    assert started.cached_tokens == len(prefix) * 64
