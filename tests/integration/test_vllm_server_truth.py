"""The vLLM backend kept true to its server (bugs 1-7) against the fake vLLM server in
this process (real HTTP, real ZMQ): a client's sampling and end of turn reach vLLM, the node
registers vLLM's KV capacity and honours its ``max_model_len``, a restarted server or worker
never leaves the directory with blocks the server no longer holds, what cannot be folded is
counted on the worker's ``/metrics``, and a bind address given as the endpoint is refused with
one line. The same behaviours against two real vLLM servers: tests/vllm/."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from engine.backends.vllm.backend import VllmBackend, VllmConfig, capacity_of, prom_labels
from engine.backends.vllm.fake import FakeVllm
from engine.backends.vllm.options import bind_endpoint, check_endpoint
from engine.profiles import load_profile
from engine.worker.loop import EngineWorker
from events.catalog import (
    AnomalyReported,
    KvEvicted,
    KvStored,
    NodeRegistered,
    RequestFinished,
    RequestSubmitted,
    RouteDecided,
)
from events.hashing import block_hashes
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens
from tests.integration.attached_host import Host, job

PROFILE = load_profile("gb300-glm52")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def attach(h, fake, node="c1", **cfg):
    url = fake.url if getattr(fake, "url", None) else await fake.start()
    fake.url = url
    eps = [f"tcp://127.0.0.1:{fake.kv_events_port}"] if fake.kv_events_port else []
    b = VllmBackend(h.host, node, "collocated", PROFILE, VllmConfig(url=url, kv_events_endpoints=eps,
                                                                    **{"metrics_interval_s": 0, **cfg}))
    await b.start()
    await asyncio.sleep(0.2)  # ZMQ slow joiner
    return b


async def until(pred, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def wait_bus(bus, pred, timeout=20.0):
    async def run():
        async with bus.consumer(None, start_seq=1) as c:
            async for d in c:
                if pred(d.event):
                    return d.event
    return await asyncio.wait_for(run(), timeout)


async def test_a_clients_sampling_and_end_of_turn_reach_vllm_and_capacity_is_the_servers(partition):
    """Bug 1: the gateway's RequestSubmitted (schema 1.3) sampling fields go to vLLM as its own,
    ``ignore_eos`` false for a client's turn, so the answer ends at end of turn (``stop``); bug 2:
    the node registers vLLM's num_gpu_blocks x block_size, not the profile's capacity."""
    fake = FakeVllm(kv_events_port=0, block_size=32, capacity_blocks=1000, eos_after=4, decode_s_per_token=0.001)
    url = await fake.start()
    cfg = VllmConfig(url=url, kv_events_endpoints=[f"tcp://127.0.0.1:{fake.kv_events_port}"], metrics_interval_s=0)
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    w = EngineWorker(bus, tokens, "n1", "collocated", PROFILE, heartbeat_s=0.1,
                     backend=lambda host, wk: VllmBackend(host, wk.src, "collocated", PROFILE, cfg))
    await w.start()
    try:
        reg = await wait_bus(bus, lambda e: isinstance(e, NodeRegistered))
        assert reg.l1_capacity_tokens == 1000 * 32 != PROFILE.l1_capacity_tokens
        assert reg.l2_capacity_tokens == 0
        sub = await tokens.subscribe("chat")
        await bus.publish(RequestSubmitted(ts=0.0, src="gateway", request="chat", branch="b", blocks=[5, 6],
                                           prompt_tokens=2 * 64 + 3, max_tokens=40, ignore_eos=False,
                                           temperature=0.7, top_p=0.9, top_k=20, seed=11, stop=["\n\n", "END"]))
        await bus.publish(RouteDecided(ts=0.0, request="chat", prefill_node="n1", decode_node="n1", policy="t"))
        fin = await wait_bus(bus, lambda e: isinstance(e, RequestFinished) and e.request == "chat")
        assert fin.output_tokens == 4  # ended at end of turn, not at max_tokens
        msgs = []
        while not msgs or msgs[-1].kind not in ("done", "error"):
            msgs.append(await sub.get(5.0))
        await sub.close()
        assert msgs[-1].kind == "done" and msgs[-1].finish_reason == "stop"
        body = fake.requests[-1]
        assert body["ignore_eos"] is False and body["max_tokens"] == 40
        assert (body["temperature"], body["top_p"], body["top_k"], body["seed"]) == (0.7, 0.9, 20, 11)
        assert body["stop"] == ["\n\n", "END"]
        # a trace replay's request that says ignore_eos runs to its recorded length
        await bus.publish(RequestSubmitted(ts=0.0, src="drive", request="trace", branch="b", blocks=[7],
                                           prompt_tokens=70, max_tokens=9, ignore_eos=True))
        await bus.publish(RouteDecided(ts=0.0, request="trace", prefill_node="n1", decode_node="n1", policy="t"))
        fin = await wait_bus(bus, lambda e: isinstance(e, RequestFinished) and e.request == "trace")
        assert fin.output_tokens == 9 and fake.requests[-1]["ignore_eos"] is True
        assert fake.requests[-1]["temperature"] == 0  # greedy when the client sent no sampling
    finally:
        await w.stop()
        await fake.stop()


async def test_context_limit_is_vllms_max_model_len():
    """Bug 3: ``max_tokens`` is cut to what fits vLLM's max_model_len (vLLM refuses the request
    otherwise) and a prompt that does not fit fails with one line naming the limit."""
    h = Host()
    fake = FakeVllm(max_model_len=300)
    b = await attach(h, fake)
    try:
        assert b.max_model_len == 300
        b.enqueue_prefill(job("fits", [1, 2], max_tokens=500))  # 135 prompt tokens
        fin = await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "fits")
        assert fake.requests[-1]["max_tokens"] == 300 - (2 * 64 + 7) and fin.output_tokens == 165
        b.enqueue_prefill(job("long", [1, 2, 3, 4, 5], max_tokens=5))  # 327 prompt tokens
        fin = await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "long")
        err = next(m for m in h.tokens if m.request == "long" and m.kind == "error")
        assert fin.output_tokens == 0 and "max_model_len 300" in err.error and "327" in err.error
        assert len(fake.requests) == 1  # the long prompt was never sent
    finally:
        await b.close()
        await fake.stop()


async def test_a_restarted_server_drops_the_nodes_blocks_then_they_refill():
    """Bug 4: the publisher's sequence starting over is a new server: the directory is told the
    old blocks are gone (KvEvicted, AnomalyReported engine_kv_resync), then the new server's
    events refill the view."""
    h = Host()
    fake = FakeVllm(kv_events_port=0, block_size=64)
    b = await attach(h, fake)
    try:
        b.enqueue_prefill(job("r1", [10, 11, 12], max_tokens=2))
        await h.wait(lambda e: isinstance(e, KvStored) and set(e.blocks) == {10, 11, 12})
        await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "r1")
        fake.restart()
        b.enqueue_prefill(job("r2", [20, 21], max_tokens=2))
        gone = await h.wait(lambda e: isinstance(e, KvEvicted))
        assert gone.tier == "L1" and set(gone.blocks) == {10, 11, 12}
        why = await h.wait(lambda e: isinstance(e, AnomalyReported))
        assert why.kind == "engine_kv_resync" and "server_restarted" in why.detail
        await h.wait(lambda e: isinstance(e, KvStored) and set(e.blocks) == {20, 21})
        assert b.pool.l1 == {20, 21} and b.resyncs["server_restarted"] == 1
        assert b.kv_event_counts()["resync_server_restarted"] == 1
    finally:
        await b.close()
        await fake.stop()


async def test_a_new_server_instance_seen_on_metrics_drops_the_view_and_resets_its_cache():
    """Bug 4, the other sign: ``process_start_time_seconds`` changed (a restart whose first events
    have not come yet): the view is dropped and the new server's cache reset, so both are empty."""
    h = Host()
    fake = FakeVllm(kv_events_port=0, block_size=64)
    b = await attach(h, fake, metrics_interval_s=0.05)
    try:
        b.enqueue_prefill(job("r1", [10, 11], max_tokens=2))
        await h.wait(lambda e: isinstance(e, KvStored) and set(e.blocks) == {10, 11})
        resets = sum(1 for bt in fake.published if type(bt.events[0]).__name__ == "AllBlocksCleared")
        fake.restart()
        gone = await h.wait(lambda e: isinstance(e, KvEvicted))
        assert set(gone.blocks) == {10, 11} and not b.pool.l1
        await until(lambda: sum(1 for bt in fake.published
                                if type(bt.events[0]).__name__ == "AllBlocksCleared") == resets + 1)
        assert b.resyncs["server_instance_changed"] == 1
    finally:
        await b.close()
        await fake.stop()


async def test_lost_events_resync_the_view_with_the_servers_cache():
    """A gap in the publisher's sequence (the event socket cut, a ZMQ high-water mark): the view
    may miss stores and removals, so it is dropped and vLLM's cache reset; both refill alike."""
    h = Host()
    fake = FakeVllm(kv_events_port=0, block_size=64)
    b = await attach(h, fake)
    try:
        b.enqueue_prefill(job("r1", [10, 11], max_tokens=2))
        await h.wait(lambda e: isinstance(e, KvStored) and set(e.blocks) == {10, 11})
        fake.seq += 3  # three batches never reached the worker
        b.enqueue_prefill(job("r2", [20, 21], max_tokens=2))
        gone = await h.wait(lambda e: isinstance(e, KvEvicted))
        assert {10, 11} <= set(gone.blocks)
        await until(lambda: b.resyncs["events_lost"] == 1 and not fake.blocks)
        assert b.kv_gaps == 1 and b.kv_event_counts()["sequence_gaps"] == 1
        b.enqueue_prefill(job("r3", [10, 11], max_tokens=2))  # refills from the server's events
        await until(lambda: {10, 11} <= b.pool.l1)
    finally:
        await b.close()
        await fake.stop()


async def test_a_restarted_worker_resyncs_so_the_blocks_vllm_keeps_are_not_lost():
    """Bug 5: a worker that restarts has no page map for the blocks vLLM still holds; it resets
    the server's prefix cache at start, so later requests' events chain from the root and every
    block reaches the directory (no orphan). A server that refuses the reset: the orphans are
    counted, on the worker's metrics too (bug 6)."""
    h = Host()
    fake = FakeVllm(kv_events_port=0, block_size=64)
    b = await attach(h, fake)
    b.enqueue_prefill(job("r1", [10, 11, 12], max_tokens=2))
    await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "r1")
    await until(lambda: b.pool.l1 == {10, 11, 12})
    await b.close()
    try:
        h2 = Host()
        b2 = await attach(h2, fake)  # the restarted worker
        try:
            assert not fake.blocks  # vLLM's cache was reset with the worker's view
            b2.enqueue_prefill(job("r2", [10, 11, 12, 13], max_tokens=2))
            await h2.wait(lambda e: isinstance(e, KvStored) and set(e.blocks) == {10, 11, 12, 13})
            assert b2.kv_event_counts()["orphan_pages"] == 0
        finally:
            await b2.close()
        fake.dev_mode = False  # a server started without VLLM_SERVER_DEV_MODE: no reset
        h3 = Host()
        b3 = await attach(h3, fake)
        try:
            b3.enqueue_prefill(job("r3", [10, 11, 12, 13, 14], max_tokens=2))
            await h3.wait(lambda e: isinstance(e, RequestFinished) and e.request == "r3")
            await until(lambda: b3.kv_event_counts()["orphan_pages"] == 1)
            assert b3.kv_event_counts()["resync_reset_refused"] == 1 and not b3.pool.l1
        finally:
            await b3.close()
    finally:
        await fake.stop()


async def test_a_reset_refused_while_blocks_are_held_is_tried_again(monkeypatch):
    """vLLM answers ``{"success": false}`` (200) while a previous worker's requests still hold
    blocks: the reset is tried again until it is done; a server that keeps refusing is counted."""
    h = Host()
    fake = FakeVllm(kv_events_port=0, block_size=64)
    fake.busy_resets = 2
    monkeypatch.setattr(VllmBackend, "reset_retry_s", 0.05)
    try:
        b = await attach(h, fake)
        try:
            assert fake.busy_resets == 0 and "reset_refused" not in b.resyncs
            assert type(fake.published[-1].events[0]).__name__ == "AllBlocksCleared"
        finally:
            await b.close()
        fake.busy_resets = 100
        b = await attach(Host(), fake)
        try:
            assert b.resyncs["reset_refused"] == 1 and fake.busy_resets == 100 - b.reset_tries
        finally:
            await b.close()
    finally:
        await fake.stop()


async def test_unfolded_events_are_counted_on_the_workers_metrics(partition):
    """Bug 6: orphan and unknown-block counts of the page map on ``/metrics``."""
    fake = FakeVllm(kv_events_port=0, block_size=64, dev_mode=False)
    url = await fake.start()
    fake._cache([7] * 64 * 2)  # vLLM cached two blocks before any worker subscribed
    cfg = VllmConfig(url=url, kv_events_endpoints=[f"tcp://127.0.0.1:{fake.kv_events_port}"], metrics_interval_s=0)
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    w = EngineWorker(bus, tokens, "n1", "collocated", PROFILE, heartbeat_s=0.1,
                     backend=lambda host, wk: VllmBackend(host, wk.src, "collocated", PROFILE, cfg))
    await w.start()
    try:
        await asyncio.sleep(0.2)  # ZMQ slow joiner
        fake._cache([7] * 64 * 3)  # its third block's parent is unknown to the worker
        fake.capacity = 1
        fake._cache([9] * 64)  # evicts blocks the worker never heard of
        await until(lambda: w.metrics.value("ei_engine_kv_event_anomalies_total", kind="unknown_removed") >= 1)
        assert w.metrics.value("ei_engine_kv_event_anomalies_total", kind="orphan_pages") == 1
        text = w.metrics.exposition().decode()
        assert 'ei_engine_kv_event_anomalies_total{kind="orphan_pages",node="n1"} 1.0' in text
        assert 'kind="resync_reset_refused"' in text
    finally:
        await w.stop()
        await fake.stop()


async def test_a_silent_publisher_is_an_error_naming_the_endpoint(capsys):
    """Bug 7 at run time: the endpoint answers nothing (a wrong host or port): once a request
    filled a block and no event came, the worker says what to check."""
    h = Host()
    fake = FakeVllm(kv_events_port=0, block_size=64)
    url = await fake.start()
    b = VllmBackend(h.host, "c1", "collocated", PROFILE, VllmConfig(url=url, metrics_interval_s=0,
                                                                    kv_events_endpoints=["tcp://127.0.0.1:9"]))
    b.events_silence_s = 0.3
    await b.start()
    try:
        b.enqueue_prefill(job("r1", [1, 2], max_tokens=2))
        await until(lambda: b.resyncs["silent_publisher"] == 1)
        assert "vllm_kv_events_silent" in capsys.readouterr().err
    finally:
        await b.close()
        await fake.stop()


async def test_the_views_cached_prefix_is_held_to_vllms_cached_tokens():
    """Part 5: each request's predicted cached prefix (the view's, what RequestStarted says) is
    compared with vLLM's reported cached_tokens: a multi-turn conversation agrees turn by turn
    (a prompt of exactly N cached blocks: vLLM reuses N - 1); blocks vLLM dropped without an
    event are a disagreement, counted with its size and on the worker's metrics."""
    from engine.metrics import EngineMetrics

    h = Host()
    fake = FakeVllm(kv_events_port=0, block_size=64)
    b = await attach(h, fake)
    try:
        conv = [(i * 37) % 30_000 + 3 for i in range(64 * 6 + 7)]  # one conversation's token ids

        def turn(rid: str, n: int):
            j = job(rid, block_hashes(conv[:n], 64), max_tokens=2)
            j.tokens, j.prompt_tokens = conv[:n], n
            return j

        for k in range(6):  # each turn's prompt extends the last by a block
            b.enqueue_prefill(turn(f"t{k}", 64 * (k + 1) + 7))
            await h.wait(lambda e, k=k: isinstance(e, RequestFinished) and e.request == f"t{k}")
            await until(lambda k=k: set(block_hashes(conv[:64 * (k + 1)], 64)) <= b.pool.l1)
        b.enqueue_prefill(turn("exact", 64 * 6))  # no partial block: vLLM reuses all but the last block
        await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "exact")
        started = [e.cached_tokens for e in h.events if type(e).__name__ == "RequestStarted" and e.phase == "prefill"]
        assert started == [0, 64, 128, 192, 256, 320, 320]
        assert b.cached_vs_server == {"agree": 7, "diff_tokens": 0}
        fake.blocks.clear()  # vLLM lost them and said nothing
        b.enqueue_prefill(turn("lost", 64 * 6 + 7))
        await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "lost")
        assert b.cached_vs_server == {"agree": 7, "disagree": 1, "diff_tokens": 6 * 64}
        m = EngineMetrics("c1", b.load, lambda tier: 0, b.kv_event_counts, lambda: dict(b.cached_vs_server))
        assert m.value("ei_engine_cached_tokens_vs_server_total", outcome="disagree") == 1
        assert m.value("ei_engine_cached_tokens_vs_server_diff_tokens_total") == 384
    finally:
        await b.close()
        await fake.stop()


@pytest.mark.parametrize(("ep", "fragment"), [
    ("tcp://*:5557", "the address the vLLM server binds"),
    ("tcp://0.0.0.0:5557", "tcp://127.0.0.1:5557"),
    ("tcp://127.0.0.1", "has no port"),
    ("5557", "not a ZMQ endpoint"),
    ("tcp://:5557", "names no host"),
])
def test_a_bind_address_or_a_malformed_endpoint_is_refused(ep, fragment):
    assert fragment in check_endpoint(ep)


def test_good_endpoints_pass_and_the_servers_bind_address_follows():
    for ep in ("tcp://127.0.0.1:5557", "tcp://host-a:1", "ipc:///tmp/kv.sock"):
        assert check_endpoint(ep) is None
    assert bind_endpoint("tcp://127.0.0.1:5557") == "tcp://*:5557"
    assert bind_endpoint("ipc:///tmp/kv.sock") == "ipc:///tmp/kv.sock"


def test_the_worker_refuses_the_bind_address_in_one_line():
    cmd = [sys.executable, "-m", "engine.worker", "--node", "n1", "--nats-url", "nats://x:1", "--backend", "vllm",
           "--vllm-url", "http://127.0.0.1:9", "--kv-events-endpoint", "tcp://*:5557"]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "binds" in r.stderr and "tcp://127.0.0.1:5557" in r.stderr


def test_capacity_and_labels_from_vllms_metrics_text():
    text = ('# HELP vllm:cache_config_info x\nvllm:cache_config_info{block_size="64",cache_dtype="auto",'
            'kv_cache_layout="None",num_gpu_blocks="728",prefix_caching_hash_algo="sha256"} 1.0\n')
    assert prom_labels(text, "vllm:cache_config_info")["prefix_caching_hash_algo"] == "sha256"
    assert capacity_of(text) == 728 * 64
    assert capacity_of(text.replace('num_gpu_blocks="728"', 'num_gpu_blocks="None"')) is None
    assert capacity_of("") is None
