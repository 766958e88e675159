"""The vLLM backend against a fake vLLM server in this process (real HTTP, real ZMQ): a request's
life through the worker on a bus (OpenAI completions, KV events in vLLM's layout -> the
request's own blocks as KvStored), the prefix reuse vLLM reports, eviction, a reroute closing
the stream, the refused role switch, the server's load, the command line."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from engine.backends.attached import prompt_ids
from engine.backends.vllm.backend import VllmBackend, VllmConfig
from engine.backends.vllm.fake import FakeVllm
from engine.backends.vllm.wire import BlockRemoved, BlockStored, KVEventBatch
from engine.profiles import load_profile
from engine.worker.loop import EngineWorker
from events.catalog import (
    AnomalyReported,
    KvEvicted,
    KvStored,
    NodeRegistered,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RoleSwitched,
    RouteDecided,
    SwitchRole,
)
from events.hashing import block_hashes
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens
from tests.integration.attached_host import Host, job

PROFILE = load_profile("gb300-glm52")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def backend(h, fake, **cfg):
    url = await fake.start()
    eps = [f"tcp://127.0.0.1:{fake.kv_events_port}"] if fake.kv_events_port else []
    b = VllmBackend(h.host, "c1", "collocated", PROFILE, VllmConfig(url=url, kv_events_endpoints=eps, **cfg))
    await b.start()
    await asyncio.sleep(0.2)  # ZMQ slow joiner
    return b


async def wait_bus(bus, pred, timeout=20.0):
    async def run():
        async with bus.consumer(None, start_seq=1) as c:
            async for d in c:
                if pred(d.event):
                    return d.event
    return await asyncio.wait_for(run(), timeout)


async def test_a_request_through_the_worker_on_a_fake_vllm(partition):
    fake = FakeVllm(kv_events_port=0, topic="kv", decode_s_per_token=0.001)
    url = await fake.start()
    cfg = VllmConfig(url=url, kv_events_endpoints=[f"tcp://127.0.0.1:{fake.kv_events_port}"], kv_events_topic="kv",
                     metrics_interval_s=0)
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    w = EngineWorker(bus, tokens, "n1", "collocated", PROFILE, heartbeat_s=0.1,
                     backend=lambda host, wk: VllmBackend(host, wk.src, "collocated", PROFILE, cfg))
    await w.start()
    try:
        reg = await wait_bus(bus, lambda e: isinstance(e, NodeRegistered))
        assert (reg.node, reg.role) == ("n1", "collocated") and w.backend.name == "vllm"
        await asyncio.sleep(0.2)  # ZMQ slow joiner
        blocks = [7000 + i for i in range(5)]
        sub = await tokens.subscribe("r1")
        await bus.publish(RequestSubmitted(ts=0.0, src="test", request="r1", branch="b", blocks=blocks,
                                           prompt_tokens=5 * 64 + 9, max_tokens=9))
        await bus.publish(RouteDecided(ts=0.0, request="r1", prefill_node="n1", decode_node="n1", policy="t"))
        fin = await wait_bus(bus, lambda e: isinstance(e, RequestFinished))
        assert (fin.request, fin.node, fin.output_tokens) == ("r1", "n1", 9)
        msgs = []
        while not msgs or msgs[-1].kind not in ("done", "error"):
            msgs.append(await sub.get(5.0))
        await sub.close()
        assert msgs[0].kind == "first" and msgs[-1].kind == "done" and sum(m.tokens for m in msgs) == 9
        assert "".join(m.text for m in msgs) == "x" * 9
        body = fake.requests[0]  # what vLLM's OpenAI API received
        assert body["model"] == "fake/model" and body["request_id"] == "r1" and body["ignore_eos"] is True
        assert len(body["prompt"]) == 5 * 64 + 9 and body["max_tokens"] == 9 and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        # vLLM's KV events (bytes hashes, 16-token blocks) name the request's own 64-token blocks
        stored = await wait_bus(bus, lambda e: isinstance(e, KvStored) and e.node == "n1")
        assert stored.tier == "L1" and set(stored.blocks) == set(blocks)
        assert type(fake.published[0].events[0]).__name__ == "AllBlocksCleared"  # the reset at start
        assert isinstance(fake.published[1].events[0].block_hashes[0], bytes)
        # the same prefix again: vLLM's cache (as its events told the pool) is the cached prefix
        await bus.publish(RequestSubmitted(ts=0.0, src="test", request="r2", branch="b", blocks=blocks[:3] + [9],
                                           prompt_tokens=4 * 64 + 1, max_tokens=2))
        await bus.publish(RouteDecided(ts=0.0, request="r2", prefill_node="n1", decode_node="n1", policy="t"))
        st = await wait_bus(bus, lambda e: isinstance(e, RequestStarted) and e.request == "r2")
        assert st.cached_tokens == 3 * 64
        await bus.publish(SwitchRole(ts=0.0, node="n1", to_role="prefill"))
        sw = await wait_bus(bus, lambda e: isinstance(e, RoleSwitched))
        assert (sw.role, sw.mechanism, sw.kv_dropped) == ("collocated", "refused", False)
        why = await wait_bus(bus, lambda e: isinstance(e, AnomalyReported))
        assert why.kind == "role_switch_refused" and why.component == "engine.vllm"
    finally:
        await w.stop()
        await fake.stop()


async def test_a_job_with_the_prompts_real_ids_sends_them_as_the_prompt():
    """``job.tokens`` (from the gateway's prompt store) go out as the completion's ``prompt``;
    their 64-token blocks are the request's blocks, so no alias is registered. A job without
    tokens (a replayed trace) still sends the ids made from its block hashes."""
    h = Host()
    fake = FakeVllm(kv_events_port=0, block_size=64)
    b = await backend(h, fake, metrics_interval_s=0)
    try:
        real = [(i * 37) % 49_000 + 3 for i in range(64 * 3 + 5)]  # three full blocks and a tail
        blocks = block_hashes(real, 64)
        j = job("real", blocks, max_tokens=2)
        j.prompt_tokens, j.tokens = len(real), real
        b.enqueue_prefill(j)
        await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "real")
        assert fake.requests[0]["prompt"] == real and fake.requests[0]["request_id"] == "real"
        assert not b.pagemap.aliases
        b.enqueue_prefill(job("trace", [11, 12], max_tokens=2))
        await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "trace")
        assert fake.requests[1]["prompt"] == prompt_ids([11, 12], 2 * 64 + 7, 64, "trace")
        assert len(b.pagemap.aliases) == 2  # the made-up ids' blocks map back to the trace's
    finally:
        await b.close()
        await fake.stop()


async def test_eviction_int_hashes_and_dp_rank():
    h = Host()
    fake = FakeVllm(kv_events_port=0, capacity_blocks=8, int_hashes=True, dp_rank=1, block_size=64)
    b = await backend(h, fake)
    try:
        b.enqueue_prefill(job("r1", range(10, 16), max_tokens=2))
        await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "r1")
        b.enqueue_prefill(job("r2", range(20, 26), max_tokens=2))
        gone = await h.wait(lambda e: isinstance(e, KvEvicted))
        assert gone.tier == "L1" and set(gone.blocks) <= set(range(10, 16))
        assert isinstance(fake.published[1].events[0].block_hashes[0], int)
        await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "r2")
        for _ in range(100):
            if b.kv_seq.get(1) == fake.seq - 1:
                break
            await asyncio.sleep(0.02)
        assert b.kv_seq == {1: fake.seq - 1} and b.kv_gaps == 0  # sequences per DP rank
        assert set(range(20, 26)) <= b.pool.l1
    finally:
        await b.close()
        await fake.stop()


async def test_reroute_closes_the_stream_and_vllm_aborts():
    h = Host()
    fake = FakeVllm(prefill_s_per_token=2e-3)
    b = await backend(h, fake, metrics_interval_s=0)
    try:
        b.enqueue_prefill(job("r1", range(100, 110)))  # ~1.3 s of prefill
        for _ in range(100):
            if "r1" in fake.inflight:
                break
            await asyncio.sleep(0.02)
        taken = b.remove_queued("r1")
        assert taken is not None and taken.request == "r1" and b.queued() == []
        for _ in range(100):
            if "r1" not in fake.inflight:
                break
            await asyncio.sleep(0.02)
        assert "r1" not in fake.inflight  # the handler was cancelled when the client went away
        assert not [e for e in h.events if getattr(e, "request", None) == "r1"]
    finally:
        await b.close()
        await fake.stop()


async def test_load_from_the_servers_metrics_and_model_errors():
    h = Host()
    fake = FakeVllm(decode_s_per_token=0.05)
    b = await backend(h, fake, metrics_interval_s=0.05)
    try:
        assert b.model == "fake/model" and b.role == "collocated"
        import aiohttp  # a request sent to the server by someone else

        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(f"{b.cfg.url}/v1/completions", json={
                "model": "fake/model", "prompt": [1, 2, 3], "max_tokens": 40, "stream": True}))
            for _ in range(100):
                if b.load().running == 1:
                    break
                await asyncio.sleep(0.02)
            assert b.load().running == 1
            task.cancel()
        b.model = "other"
        b.enqueue_prefill(job("bad", range(3)))
        fin = await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "bad")
        assert fin.output_tokens == 0 and any(m.kind == "error" and "404" in m.error for m in h.tokens)
        assert "404" in fin.error  # the stream says it failed, not only the client's token message
    finally:
        await b.close()
        await fake.stop()


def test_only_the_first_full_attention_group_is_followed():
    h = Host()
    b = VllmBackend(h.host, "c1", "prefill", PROFILE, VllmConfig(url="http://x"))
    assert b.role == "collocated"
    toks = list(range(64))
    sw = BlockStored(block_hashes=[b"s"], parent_block_hash=None, token_ids=toks, block_size=64, lora_id=None,
                     medium="GPU", lora_name=None, group_idx=1, kv_cache_spec_kind="sliding_window")
    full = BlockStored(block_hashes=[b"f"], parent_block_hash=None, token_ids=toks, block_size=64, lora_id=None,
                       medium="GPU", lora_name=None, group_idx=0)
    b.apply_kv(KVEventBatch(ts=0.0, events=[sw, full]))
    assert b.kv_group == 0 and len(b.pool.l1) == 1
    b.apply_kv(KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[b"s"], medium="GPU", group_idx=1)]))
    assert len(b.pool.l1) == 1 and b.skipped == {"group_1": 2}
    b.apply_kv(KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[b"f"], medium="GPU", group_idx=0)]))
    assert not b.pool.l1


def test_worker_command_line_for_vllm():
    base = [sys.executable, "-m", "engine.worker", "--node", "n1", "--nats-url", "nats://x:1", "--backend", "vllm"]
    r = subprocess.run(base, check=False, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--vllm-url" in r.stderr
    r = subprocess.run(base + ["--vllm-url", "http://127.0.0.1:9", "--kv-events-endpoint", "tcp://127.0.0.1:5557"],
                       check=False, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "no vLLM server at http://127.0.0.1:9" in r.stderr
    r = subprocess.run(base + ["--vllm-url", "http://127.0.0.1:9", "--kv-events-endpoint", "5557"],
                       check=False, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "--kv-events-endpoint" in r.stderr
