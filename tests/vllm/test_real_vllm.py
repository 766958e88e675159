"""The vLLM backend against two real vLLM servers on the CPU (``pytest -m vllm``, see
conftest.py): the bugs the fake-server tests cover (tests/integration/test_vllm_server_truth.py),
held against vLLM itself, and ``evolving up --engines vllm --attach`` serving a chat through the
gateway on both servers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from engine.backends.vllm.backend import VllmBackend, VllmConfig, capacity_of
from engine.profiles import load_profile
from events.catalog import AnomalyReported, KvEvicted, KvStored, RequestFinished
from events.hashing import block_hashes
from services.drivers.gateway.model import load_model
from services.drivers.up.testing import stop_up, wait_ready_file
from tests.integration.attached_host import Host, job
from tests.vllm.conftest import MAX_MODEL_LEN, SERVED

pytestmark = pytest.mark.vllm

PROFILE = load_profile("gb300-glm52")
REPO = Path(__file__).resolve().parents[2]
SYSTEM = "You are a concise assistant who answers in one sentence. " * 12  # > 2 blocks of 64 tokens


def chat_ids(hf_model, question: str, system: str = SYSTEM) -> list[int]:
    m = load_model(str(hf_model))
    return m.tokenizer.encode(m.template.render([{"role": "system", "content": system},
                                                 {"role": "user", "content": question}]))


def real_job(rid: str, ids: list[int], max_tokens: int, ignore_eos: bool | None):
    j = job(rid, block_hashes(ids, 64), max_tokens=max_tokens)
    j.prompt_tokens, j.tokens, j.ignore_eos = len(ids), ids, ignore_eos
    return j


async def attach(h, server, **cfg) -> VllmBackend:
    b = VllmBackend(h.host, "v1", "collocated", PROFILE,
                    VllmConfig(url=server.url, kv_events_endpoints=[server.kv_endpoint], kv_events_topic="kv",
                               metrics_interval_s=0, **cfg))
    await b.start()
    await asyncio.sleep(0.3)  # ZMQ slow joiner
    return b


async def completion(server, ids: list[int]) -> dict:
    """vLLM's own answer for ``ids`` (one token): its usage, ``cached_tokens`` included."""
    async with aiohttp.ClientSession() as s, s.post(f"{server.url}/v1/completions", json={
            "model": SERVED, "prompt": ids, "max_tokens": 1, "temperature": 0}) as r:
        return (await r.json())["usage"]


async def test_a_chat_ends_at_end_of_turn_and_a_replay_runs_to_its_length(vllm_servers, hf_model):
    """Bug 1: ``ignore_eos`` false (a client's turn) -> vLLM stops at <|im_end|>; true -> max_tokens."""
    h = Host()
    b = await attach(h, vllm_servers[0])
    try:
        ids = chat_ids(hf_model, "What is the capital of France?")
        b.enqueue_prefill(real_job("turn", ids, 64, ignore_eos=False))
        fin = await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "turn", 120)
        done = next(m for m in h.tokens if m.request == "turn" and m.kind == "done")
        text = "".join(m.text for m in h.tokens if m.request == "turn")
        assert done.finish_reason == "stop" and 0 < fin.output_tokens < 64 and "Paris" in text, text
        b.enqueue_prefill(real_job("replay", ids, 24, ignore_eos=True))
        fin = await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "replay", 120)
        assert fin.output_tokens == 24
    finally:
        await b.close()


async def test_capacity_and_context_are_the_servers(vllm_servers, hf_model):
    """Bugs 2 and 3: num_gpu_blocks x block_size and max_model_len, as the server reports them."""
    h = Host()
    s = vllm_servers[0]
    b = await attach(h, s)
    try:
        async with aiohttp.ClientSession() as http, http.get(f"{s.url}/metrics") as r:
            cap = capacity_of(await r.text())
        assert cap and b.kv_capacity_tokens == (cap, 0) and cap % 64 == 0
        assert b.max_model_len == MAX_MODEL_LEN
        long_ids = chat_ids(hf_model, "Summarise. " * 900)
        assert len(long_ids) > MAX_MODEL_LEN
        b.enqueue_prefill(real_job("long", long_ids, 8, ignore_eos=False))
        await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "long", 60)
        err = next(m for m in h.tokens if m.request == "long" and m.kind == "error")
        assert f"max_model_len {MAX_MODEL_LEN}" in err.error
        near = long_ids[: MAX_MODEL_LEN - 4]
        b.enqueue_prefill(real_job("near", near, 50, ignore_eos=True))  # only 4 tokens fit
        fin = await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "near", 300)
        assert fin.output_tokens == 4
    finally:
        await b.close()


async def test_the_pools_prefix_is_vllms_cached_tokens_and_a_restarted_worker_resyncs(vllm_servers, hf_model):
    """vLLM's events name the request's own blocks; the pool's prefix for a repeated prompt is
    what vLLM reports cached. Bug 5: a restarted worker resets vLLM's cache (cached_tokens 0
    after it) and every block of later requests reaches it, no orphan."""
    s = vllm_servers[1]
    ids = chat_ids(hf_model, "Which planet is the largest?")
    blocks = block_hashes(ids, 64)
    h = Host()
    b = await attach(h, s)
    try:
        b.enqueue_prefill(real_job("a", ids, 4, ignore_eos=True))
        await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "a", 120)
        await h.wait(lambda e: isinstance(e, KvStored) and set(blocks) <= set(e.blocks), 30)
        usage = await completion(s, ids)
        held = b.pool.prefix_len(blocks, 0, b.pool.l1) * 64
        assert held == len(blocks) * 64 == usage["prompt_tokens_details"]["cached_tokens"], usage
    finally:
        await b.close()
    h2 = Host()
    b2 = await attach(h2, s)  # the restarted worker
    try:
        assert b2.resyncs["worker_start"] == 1 and "reset_refused" not in b2.resyncs
        usage = await completion(s, ids)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # vLLM's cache was reset with the view
        await h2.wait(lambda e: isinstance(e, KvStored) and set(blocks) <= set(e.blocks), 30)
        assert b2.kv_event_counts()["orphan_pages"] == 0
    finally:
        await b2.close()


async def test_the_views_prediction_agrees_with_vllms_cached_tokens_on_a_multi_turn_replay(vllm_servers, hf_model):
    """Part 5: three conversations of eight turns each, interleaved, every turn's prompt the whole
    conversation so far; the prefix the view predicts (RequestStarted.cached_tokens) equals vLLM's
    reported cached_tokens for >= 95% of the requests."""
    m = load_model(str(hf_model))
    h = Host()
    b = await attach(h, vllm_servers[0])
    try:
        chats = {c: [{"role": "system", "content": f"Conversation {c}. " + SYSTEM}] for c in "abc"}
        n = 0
        for t in range(8):
            for c, msgs in chats.items():
                msgs.append({"role": "user", "content": f"Question {t} of conversation {c}: what is {t} + {t}?"})
                ids = m.tokenizer.encode(m.template.render(msgs))
                b.enqueue_prefill(real_job(f"{c}{t}", ids, 12, ignore_eos=False))
                await h.wait(lambda e, r=f"{c}{t}": isinstance(e, RequestFinished) and e.request == r, 120)
                answer = "".join(x.text for x in h.tokens if x.request == f"{c}{t}")
                msgs.append({"role": "assistant", "content": answer})
                n += 1
                await asyncio.sleep(0.3)  # the request's KV events reach the view before the next turn
        got = b.cached_vs_server
        assert got["agree"] + got["disagree"] == n, got
        assert got["agree"] / n >= 0.95, got
        print(f"cached_tokens agreement: {got['agree']}/{n}, {got['diff_tokens']} tokens apart in all")
    finally:
        await b.close()


async def test_a_restarted_server_drops_the_nodes_blocks_then_they_refill(vllm_servers, hf_model):
    """Bug 4: the server restarts under its worker; the node's blocks are dropped (KvEvicted), the
    directory told why (AnomalyReported), and the new server's events refill the view."""
    s = vllm_servers[1]
    ids = chat_ids(hf_model, "Name a primary color.")
    blocks = block_hashes(ids, 64)
    h = Host()
    b = await attach(h, s, wait_s=900.0)
    b.cfg.metrics_interval_s = 0.5
    try:
        b.enqueue_prefill(real_job("before", ids, 4, ignore_eos=True))
        await h.wait(lambda e: isinstance(e, KvStored) and set(blocks) <= set(e.blocks), 120)
        await asyncio.to_thread(s.restart)
        b._bg.append(asyncio.create_task(b._poll_metrics()))
        gone = await h.wait(lambda e: isinstance(e, KvEvicted), 60)
        assert set(blocks) <= set(gone.blocks)
        why = await h.wait(lambda e: isinstance(e, AnomalyReported) and e.kind == "engine_kv_resync", 10)
        assert "server" in why.detail
        n = len(h.events)
        b.enqueue_prefill(real_job("after", ids, 4, ignore_eos=True))
        await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "after", 120)
        await h.wait(lambda e: h.events.index(e) >= n and isinstance(e, KvStored) and set(blocks) <= set(e.blocks), 30)
    finally:
        await b.close()


async def test_a_wrong_endpoint_is_reported_once_a_block_filled(vllm_servers, hf_model, capsys):
    """Bug 7 at run time, on a real server: its events go elsewhere, the worker says what to check."""
    s = vllm_servers[0]
    h = Host()
    b = VllmBackend(h.host, "v1", "collocated", PROFILE,
                    VllmConfig(url=s.url, kv_events_endpoints=["tcp://127.0.0.1:9"], metrics_interval_s=0))
    b.events_silence_s = 2.0
    await b.start()
    try:
        b.enqueue_prefill(real_job("w", chat_ids(hf_model, "Hello."), 2, ignore_eos=True))
        await h.wait(lambda e: isinstance(e, RequestFinished) and e.request == "w", 120)
        for _ in range(100):
            if b.resyncs["silent_publisher"]:
                break
            await asyncio.sleep(0.1)
        assert b.resyncs["silent_publisher"] == 1 and "vllm_kv_events_silent" in capsys.readouterr().err
    finally:
        await b.close()


def test_up_attached_to_both_servers_serves_a_chat(vllm_servers, hf_model, tmp_path):
    """Part 2 (--attach) and bug 8: ``evolving up --engines vllm --attach`` on the two servers; a
    chat through the gateway ends at end of turn, a repeated prefix is reported cached, a client
    that leaves mid-stream leaves no traceback in the gateway's log, and ``verify`` passes."""
    import openai

    run_dir, ready = tmp_path / "run", tmp_path / "ready.json"
    up = subprocess.Popen(
        [sys.executable, "-m", "services.drivers.cli", "up", "--engines", "vllm", "--insecure",
         "--attach", ",".join(s.url for s in vllm_servers),
         "--attach-kv-events", ",".join(s.kv_endpoint for s in vllm_servers), "--model", str(hf_model),
         "--run-dir", str(run_dir), "--gateway-port", "0", "--ready-file", str(ready), "--no-status",
         "--stop-timeout-s", "15"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        urls = wait_ready_file(ready, up, 180)
        client = openai.OpenAI(base_url=f"{urls['gateway']}/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == [SERVED]
        cached = []
        for q in ("What is the capital of France?", "What is the capital of Italy?"):
            r = client.chat.completions.create(model=SERVED, max_tokens=48, temperature=0, messages=[
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 48, r
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
        assert cached[0] == 0 and cached[1] >= 128, cached  # the system prompt's blocks, routed to their node
        stream = client.chat.completions.create(model=SERVED, max_tokens=200, stream=True, messages=[
            {"role": "user", "content": "Tell a long story."}], extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()  # the client leaves mid-stream
        r = client.chat.completions.create(model=SERVED, max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
        assert r.choices[0].message.content
    finally:
        out = stop_up(up, 90)
    gateway_log = (run_dir / "logs" / "gateway.log").read_text()
    assert "Traceback" not in gateway_log, gateway_log[-3000:]
    v = subprocess.run([sys.executable, "-m", "services.drivers.cli", "verify", str(run_dir / "run.duckdb")],
                       check=False, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert v.returncode == 0, (v.stdout[-2000:], v.stderr[-2000:], out[-2000:])
