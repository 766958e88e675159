"""A fetch whose KV finds no room in the GPU tier lands in host memory.

Before the fix, fetched KV had to fit in both tiers of the destination at once; when the GPU
tier was full of blocks pinned by the running and queued requests (each queued job pins the KV
fetched for it for its whole wait), nothing was kept and the whole prompt was recomputed. On the
calibration sessions at the pressure profile that was 336-425K-token prompts whose KV sat in the
pool, each taking minutes of prefill (docs/experiments.md, "Why ours loses reuse"). METHOD §4.1
fetches peer L2 -> own L2 -> GPU: the host copy lands, and the GPU copy is restored from it when
the prefill starts.
"""

from __future__ import annotations

from dataclasses import replace

from engine.backends.sim.node import PrefillJob, SimNode
from engine.profiles import load_profile
from events.catalog import FetchStep, KvFetched, KvMoved, RequestStarted
from services.cores.directory.eviction import CountAwareEviction
from tests.unit.engine.simnode_host import DirectoryHost

L1_BLOCKS, L2_BLOCKS = 40, 200
P = replace(load_profile("gb300-glm52"), prefill_noise=0.0, decode_noise=0.0,
            l1_capacity_tokens=L1_BLOCKS * 64, l2_capacity_tokens=L2_BLOCKS * 64)


def job(rid: str, blocks: list[int], prompt: int, plan: list[FetchStep]) -> PrefillJob:
    return PrefillJob(request=rid, blocks=blocks, prompt_tokens=prompt, max_tokens=1, decode_node="d",
                      fetch_plan=plan, enqueued_s=0.0)


def started(h: DirectoryHost, rid: str) -> RequestStarted:
    return next(e for e in h.log if type(e) is RequestStarted and e.request == rid and e.phase == "prefill")


def test_a_fetch_without_gpu_room_lands_in_host_memory_and_is_restored_at_prefill_start():
    h = DirectoryHost(CountAwareEviction(64))
    p = h.nodes["p"] = SimNode("p", "prefill", P, h, seed=1)
    q = h.nodes["q"] = SimNode("q", "prefill", P, h, seed=2)
    h.nodes["d"] = SimNode("d", "decode", P, h, seed=3)
    ctx_a, ctx_b = list(range(1000, 1030)), list(range(2000, 2020))  # 30 + 20 blocks > 40 of GPU
    q._store("L2", ctx_a + ctx_b)
    # x keeps p busy (three prefill iterations) while a and b wait with their fetched KV
    p.enqueue_prefill(job("x", list(range(100, 104)), 3 * P.prefill_token_budget, []))
    p.enqueue_prefill(job("a", [*ctx_a, 1], 31 * 64, [FetchStep(src_node="q", first_block=0, n_blocks=30)]))
    p.enqueue_prefill(job("b", [*ctx_b, 2], 21 * 64, [FetchStep(src_node="q", first_block=0, n_blocks=20)]))
    while h.q.step():
        pass
    # a's fetch took 30 of the 40 GPU blocks, pinned while a waits: b's 20 do not fit there
    assert any(type(e) is KvFetched and e.request == "a" for e in h.log)
    moved = [e for e in h.log if type(e) is KvMoved and e.request == "b" and e.dst_phase == "prefill"]
    assert [(e.dst_tier, e.src_phase, e.dst_phase, e.blocks) for e in moved] == [("L2", "prefill", "prefill", ctx_b)]
    # b reuses its 20 fetched blocks (restored from p's host memory), it does not recompute them
    sb = started(h, "b")
    assert sb.cached_tokens == 20 * 64 and sb.restored_tokens == 20 * 64
    # the directory saw the host copy land on p and the branch's GPU copy restored there
    assert all(("p", "L2") in h.dir.holders(b) for b in ctx_b)


def test_a_fetch_with_gpu_room_still_lands_in_both_tiers():
    h = DirectoryHost(CountAwareEviction(64))
    p = h.nodes["p"] = SimNode("p", "prefill", P, h, seed=1)
    q = h.nodes["q"] = SimNode("q", "prefill", P, h, seed=2)
    h.nodes["d"] = SimNode("d", "decode", P, h, seed=3)
    ctx = list(range(1000, 1020))
    q._store("L2", ctx)
    p.enqueue_prefill(job("b", [*ctx, 2], 21 * 64, [FetchStep(src_node="q", first_block=0, n_blocks=20)]))
    while h.q.step():
        pass
    assert [e.blocks for e in h.log if type(e) is KvFetched and e.request == "b"] == [ctx]
    assert not any(type(e) is KvMoved and e.request == "b" and e.dst_phase == "prefill" for e in h.log)
    sb = started(h, "b")
    assert sb.cached_tokens == 20 * 64 and sb.restored_tokens == 0
