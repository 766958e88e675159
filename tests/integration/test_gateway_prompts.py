"""Prompts on the bus: the gateway with SmolLM2's own tokenizer and chat template
(its real GGUF) hashes blocks of the model's token ids and puts those ids into the prompt store
before it publishes the request; the recorder keeps neither the text nor the ids."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine.backends.sim.backend import SimBackend
from engine.model_files import smollm2_gguf
from engine.profiles import load_profile
from engine.worker.loop import EngineWorker
from events.catalog import RequestSubmitted, RouteDecided
from events.hashing import block_hashes
from services.adapters.bus import InMemoryBus, NatsBus, subject_matches
from services.adapters.bus.nats_prompts import NatsPromptStore
from services.adapters.bus.prompts import InMemoryPromptStore, encode_tokens
from services.adapters.bus.security import READS, prompt_bucket
from services.adapters.bus.tokens import MemoryTokens, NatsTokens, TokenMsg
from services.adapters.eventlog import DuckDbEventLog
from services.drivers.gateway.app import Gateway, GatewayConfig
from services.drivers.gateway.model import load_model
from services.drivers.recorder.service import run_recorder

SMOLLM2 = smollm2_gguf()
MARKER = "zebra quartz marmalade"  # a phrase to look for in what was recorded
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"Say {MARKER}, then count: " + " ".join(str(i) for i in range(60))}]


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("tokenizers", reason="the optional 'tokenizers' package (extra: engine)")
    pytest.importorskip("jinja2", reason="the optional 'jinja2' package (extra: engine)")
    return load_model(str(SMOLLM2))


async def _answer(bus: InMemoryBus, tokens: MemoryTokens, store: InMemoryPromptStore, seen: dict) -> None:
    """A router + engine: the store must already hold the ids when the request is on the stream."""
    async with bus.consumer(None, start_seq=1, subjects=f"ei.{bus.partition}.agent.>") as c:
        async for d in c:
            if type(d.event) is not RequestSubmitted:
                continue
            seen[d.event.request] = await store.get(d.event.request)
            await bus.publish(RouteDecided(ts=d.event.ts, request=d.event.request, prefill_node="n1",
                                           decode_node="n1", policy="fake"))
            await tokens.publish(TokenMsg(request=d.event.request, kind="done", tokens=1, total=1, text="ok",
                                          finish_reason="stop"))


@contextlib.asynccontextmanager
async def serving(model, store):
    bus, tokens, seen = InMemoryBus("pr"), MemoryTokens(), {}
    gw = Gateway(bus, tokens, GatewayConfig(partition="pr", block_tokens=16), clock=lambda: 100.0,
                 prompts={"pr": store}, model=model)
    task = asyncio.create_task(_answer(bus, tokens, store, seen))
    try:
        async with TestClient(TestServer(gw.make_app())) as client:
            yield bus, client, seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _submitted(bus) -> list[RequestSubmitted]:
    head, out = await bus.last_seq(), []
    async with bus.consumer(None, start_seq=1) as c:
        async for d in c:
            if type(d.event) is RequestSubmitted:
                out.append(d.event)
            if d.seq >= head:
                return out


async def test_block_hashes_are_of_the_model_ids_and_the_store_holds_them(model):
    store = InMemoryPromptStore()
    async with serving(model, store) as (bus, client, seen):
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
        assert r.status == 200, await r.text()
        body = await r.json()
        a = await client.post("/v1/messages", json={"model": "evolving-sim", "max_tokens": 1, "system": "Be brief.",
                                                    "messages": [{"role": "user", "content": MESSAGES[1]["content"]}]})
        assert a.status == 200, await a.text()
        (ev, ev2) = await _submitted(bus)
    ids = model.tokenizer.encode(model.template.render(MESSAGES))
    assert ids[0] == 1 and len(ids) < len(model.template.render(MESSAGES))  # ChatML markers, BPE: not bytes
    assert ev.prompt_tokens == len(ids) == body["usage"]["prompt_tokens"]
    assert ev.blocks == block_hashes(ids, 16) and len(ev.blocks) == len(ids) // 16
    assert seen[ev.request] == ids  # in the store before the request was on the stream
    assert await store.get(ev.request) == ids
    assert ev2.blocks == ev.blocks and seen[ev2.request] == ids  # the same conversation on Anthropic's API


async def test_the_recorder_keeps_no_prompt_text_or_ids(model, tmp_path):
    store = InMemoryPromptStore()
    async with serving(model, store) as (bus, client, _):
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
        assert r.status == 200
        (ev,) = await _submitted(bus)
    log = DuckDbEventLog(tmp_path / "run.duckdb")
    stop = asyncio.Event()
    task = asyncio.create_task(run_recorder(bus, log, max_batch=64, flush_interval_s=0.02, stop=stop))
    head = await bus.last_seq()
    for _ in range(500):
        if log.last_seq() >= head:
            break
        await asyncio.sleep(0.01)
    stop.set()
    await task
    assert log.count_by_type().get("RequestSubmitted") == 1
    log.close()
    raw = (tmp_path / "run.duckdb").read_bytes()
    ids = model.tokenizer.encode(model.template.render(MESSAGES))
    assert MARKER.encode() not in raw and b"zebra" not in raw  # no prompt text
    assert encode_tokens(ids)[12:12 + 64] not in raw  # nor the ids as the store holds them
    assert await store.get(ev.request) == ids  # (which the store does hold)
    # the recorder's durable reads the partition's event stream only, never the prompt bucket
    bucket_subject = f"$KV.{prompt_bucket('pr')}.{'0' * 32}"
    assert not any(subject_matches(f.replace("<p>", "pr"), bucket_subject) for f in READS["recorder"].filters)


class _Recording(SimBackend):
    """The sim node, remembering the token ids each prefill job reached it with."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.tokens: dict[str, list[int] | None] = {}

    def enqueue_prefill(self, job) -> None:
        self.tokens[job.request] = None if job.tokens is None else list(job.tokens)
        super().enqueue_prefill(job)


async def _stub_router(bus, node: str) -> None:
    async with bus.consumer(None, start_seq=1, subjects=f"ei.{bus.partition}.agent.>") as c:
        async for d in c:
            if type(d.event) is RequestSubmitted:
                await bus.publish(RouteDecided(ts=d.event.ts, request=d.event.request, prefill_node=node,
                                               decode_node=node, policy="stub"))


async def test_the_ids_reach_the_engine_over_nats(model, nats_url, partition):
    """HTTP -> gateway (SmolLM2's tokenizer, NatsPromptStore) -> stub router -> the worker, which
    reads the ids from the bucket on a real nats-server before its backend gets the job."""
    gw_bus, w_bus, r_bus = [await NatsBus.connect(nats_url, partition=partition) for _ in range(3)]
    profile = load_profile("gb300-glm52")
    worker = EngineWorker(w_bus, NatsTokens(w_bus.nc, partition), "n1", "collocated", profile, time_scale=5.0,
                          prompts=NatsPromptStore(w_bus.nc, partition),
                          backend=lambda host, w: _Recording(host, "n1", "collocated", profile))
    await worker.start()
    router = asyncio.create_task(_stub_router(r_bus, "n1"))
    gw = Gateway(gw_bus, NatsTokens(gw_bus.nc, partition), GatewayConfig(partition=partition), model=model,
                 prompts={partition: NatsPromptStore(gw_bus.nc, partition, ttl_s=60)})
    try:
        async with TestClient(TestServer(gw.make_app())) as client:
            r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3})
            assert r.status == 200, await r.text()
            rid = r.headers.get("x-request-id") or (await r.json())["evolving"]["request"]
        ids = model.tokenizer.encode(model.template.render(MESSAGES))
        assert worker.backend.tokens == {rid: ids}
        assert worker.prompt_fetch.found == 1 and worker.prompt_fetch.missing == 0
    finally:
        router.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await router
        await worker.stop()
        for b in (gw_bus, w_bus, r_bus):
            await b.close()
