"""The gateway's HTTP app against an InMemoryBus (and once against a real nats-server), with a
fake "router + engine" task that answers RouteDecided and token messages."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from events.catalog import (
    BranchEnded,
    BranchOpened,
    ContextCompacted,
    RequestSubmitted,
    RouteDecided,
)
from events.hashing import block_hashes
from services.bus import InMemoryBus, NatsBus
from services.gateway.app import Gateway, GatewayConfig
from services.gateway.tokens import MemoryTokens, NatsTokens, TokenMsg, sim_text


async def fake_cluster(bus, tokens, chunk: int = 3, shadow_first: bool = True, fail: set[str] = frozenset(),
                       silent: set[str] = frozenset()):
    """Route every RequestSubmitted to n1/n2 and stream ``max_tokens`` sim tokens back."""
    async with bus.consumer(None, start_seq=1, subjects=f"ei.{bus.partition}.agent.>") as c:
        async for d in c:
            ev = d.event
            if not isinstance(ev, RequestSubmitted):
                continue
            if shadow_first:  # a shadow decision must be ignored by the gateway
                await bus.publish(RouteDecided(ts=ev.ts, request=ev.request, prefill_node="zz",
                                               decode_node="zz", policy="shadowy", shadow=True))
            if ev.branch in silent:
                continue
            await bus.publish(RouteDecided(ts=ev.ts, request=ev.request, prefill_node="n1",
                                           decode_node="n2", policy="fake"))
            if ev.branch in fail:
                await tokens.publish(TokenMsg(request=ev.request, kind="error", error="boom"))
                continue
            await tokens.publish(TokenMsg(request=ev.request, kind="first", tokens=1, total=1,
                                          text=sim_text(1), simulated=True))
            done = 1
            while ev.max_tokens - done > chunk:
                done += chunk
                await tokens.publish(TokenMsg(request=ev.request, kind="chunk", tokens=chunk, total=done,
                                              text=sim_text(chunk), simulated=True))
            rest = ev.max_tokens - done
            await tokens.publish(TokenMsg(request=ev.request, kind="done", tokens=rest, total=ev.max_tokens,
                                          text=sim_text(rest), finish_reason="length", simulated=True))


@contextlib.asynccontextmanager
async def gateway(bus, tokens, _fake: dict | None = None, **cfg):
    gw = Gateway(bus, tokens, GatewayConfig(partition=bus.partition, **cfg), clock=lambda: 100.0)
    task = asyncio.create_task(fake_cluster(bus, tokens, **(_fake or {})))
    try:
        async with TestClient(TestServer(gw.make_app())) as client:
            yield gw, client
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _events(bus, types=(BranchOpened, RequestSubmitted, ContextCompacted, BranchEnded)):
    out = []
    head = await bus.last_seq()
    async with bus.consumer(None, start_seq=1) as c:
        async for d in c:
            if isinstance(d.event, types):
                out.append(d.event)
            if d.seq >= head:
                break
    return out


def _sse(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


CHAT = {"model": "evolving-sim", "messages": [{"role": "user", "content": "x" * 200}], "max_tokens": 8}


async def test_chat_non_streaming_publishes_the_harness_events(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (gw, client):
        r = await client.post("/v1/chat/completions", json=CHAT,
                              headers={"x-branch-id": "s1/root", "x-branch-end": "true"})
        assert r.status == 200, await r.text()
        body = await r.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "tok " * 8}
        assert body["choices"][0]["finish_reason"] == "length"
        prompt = "<|user|>\n" + "x" * 200 + "<|end|>\n<|assistant|>\n"
        assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 8,
                                 "total_tokens": len(prompt) + 8}
        ext = body["evolving"]
        assert (ext["prefill_node"], ext["decode_node"], ext["simulated"]) == ("n1", "n2", True)
        assert "simulated" in ext["note"]
        assert r.headers["x-decode-node"] == "n2"
        evs = await _events(bus)
        assert [type(e).__name__ for e in evs] == ["BranchOpened", "RequestSubmitted", "BranchEnded"]
        sub = evs[1]
        assert sub.blocks == block_hashes(list(prompt.encode()), 64)
        assert (sub.branch, sub.prompt_tokens, sub.max_tokens, sub.version) == ("s1/root", len(prompt), 8, 0)
        assert sub.request == ext["request"]
        assert gw.metrics.get("ei_gateway_branches_ended_total") == 1


async def test_streaming_sse_chunks_and_done(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (_gw, client):
        r = await client.post("/v1/chat/completions",
                              json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
                              headers={"x-branch-id": "b"})
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events = _sse(await r.text())
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert text == "tok " * 8
        finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
        # no x-branch-end: the branch stays open
        assert [type(e).__name__ for e in await _events(bus)] == ["BranchOpened", "RequestSubmitted"]


async def test_completions_fork_and_inferred_compaction(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (gw, client):
        h = {"x-branch-id": "root"}
        p1 = "a" * 130
        for prompt in (p1, p1 + "b" * 64):  # grows: same version
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=h)
            assert r.status == 200, await r.text()
            assert (await r.json())["choices"][0]["text"] == "tok tok "
        r = await client.post("/v1/completions", json={"prompt": "c" * 130, "max_tokens": 2}, headers=h)
        assert r.status == 200
        r = await client.post("/v1/completions", json={"prompt": p1, "max_tokens": 1},
                              headers={"x-branch-id": "kid", "x-parent-branch-id": "root",
                                       "x-branch-mode": "fork", "x-branch-end": "1"})
        assert r.status == 200
        evs = await _events(bus)
        names = [type(e).__name__ for e in evs]
        assert names == ["BranchOpened", "RequestSubmitted", "RequestSubmitted", "ContextCompacted",
                         "RequestSubmitted", "BranchOpened", "RequestSubmitted", "BranchEnded"]
        assert [e.version for e in evs if isinstance(e, RequestSubmitted)] == [0, 0, 1, 0]
        kid = evs[5]
        assert (kid.branch, kid.parent, kid.mode, kid.session) == ("kid", "root", "fork", "root")
        assert gw.metrics.get("ei_gateway_compactions_total", reason="inferred") == 1


async def test_headerless_request_is_one_request_branch_and_counted(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (gw, client):
        r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert r.status == 200
        names = [type(e).__name__ for e in await _events(bus)]
        assert names == ["BranchOpened", "RequestSubmitted", "BranchEnded"]
        metrics = await (await client.get("/metrics")).text()
        assert "ei_gateway_headerless_requests_total 1" in metrics
        assert gw.metrics.get("ei_gateway_headerless_requests_total") == 1


@pytest.mark.parametrize("body, headers, field", [
    (b"{not json", {}, "body"),
    (b"[1, 2]", {}, "body"),
    (json.dumps({"model": "m"}).encode(), {}, "messages"),
    (json.dumps({"messages": []}).encode(), {}, "messages"),
    (json.dumps({"messages": [{"role": "bot", "content": "x"}]}).encode(), {}, "messages[0].role"),
    (json.dumps(CHAT).encode(), {"x-branch-id": "b", "x-parent-branch-id": "a", "x-branch-mode": "clone"},
     "x-branch-mode"),
    (json.dumps({**CHAT, "max_tokens": -1}).encode(), {}, "max_tokens"),
    (json.dumps({**CHAT, "max_tokens": 0}).encode(), {}, "max_tokens"),
    (json.dumps({**CHAT, "stream": "yes"}).encode(), {}, "stream"),
])
async def test_bad_input_is_400_naming_the_field(partition, body, headers, field):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (gw, client):
        r = await client.post("/v1/chat/completions", data=body,
                              headers={"Content-Type": "application/json", **headers})
        assert r.status == 400
        err = (await r.json())["error"]
        assert err["param"] == field and err["message"]
        assert await bus.last_seq() == 0  # nothing published
        assert gw.metrics.get("ei_gateway_errors_total", status="400") == 1


async def test_bad_prompt_is_400(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (_gw, client):
        r = await client.post("/v1/completions", json={"prompt": ["a", "b"]})
        assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
        r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
        assert r.status == 200 and (await r.json())["usage"]["prompt_tokens"] == 3


async def test_no_route_is_503_and_the_headerless_branch_still_ends(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition), route_timeout_s=0.2,
                       _fake={"silent": {"quiet"}}) as (gw, client):
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                              headers={"x-branch-id": "quiet", "x-branch-end": "true"})
        assert r.status == 503
        err = (await r.json())["error"]
        assert "RouteDecided" in err["message"] and "router" in err["message"]
        assert gw.metrics.get("ei_gateway_route_timeouts_total") == 1
        assert isinstance((await _events(bus))[-1], BranchEnded)


async def test_engine_error_is_502(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition), _fake={"fail": {"bad"}}) as (_gw, client):
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                              headers={"x-branch-id": "bad"})
        assert r.status == 502 and "boom" in (await r.json())["error"]["message"]


async def test_ended_branch_is_409_and_branch_end_request(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (_gw, client):
        h = {"x-dynamo-session-id": "sess"}
        assert (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=h)).status == 200
        # Dynamo-style dedicated minimal request that ends the session
        r = await client.post("/v1/completions", json={"prompt": "", "max_tokens": 0},
                              headers={**h, "x-dynamo-session-final": "true"})
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 0
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=h)
        assert r.status == 409
        names = [type(e).__name__ for e in await _events(bus)]
        assert names == ["BranchOpened", "RequestSubmitted", "BranchEnded"]


async def test_models_health(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition), model="glm") as (_gw, client):
        assert (await (await client.get("/v1/models")).json())["data"][0]["id"] == "glm"
        h = await (await client.get("/health")).json()
        assert h["status"] == "ok" and h["partition"] == partition


async def test_over_real_nats(nats_url, partition):
    bus = await NatsBus.connect(nats_url, partition=partition)
    try:
        async with gateway(bus, NatsTokens(bus.nc, partition)) as (_gw, client):
            r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True},
                                  headers={"x-branch-id": "n/root", "x-branch-end": "true"})
            assert r.status == 200
            events = _sse(await r.text())
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-1])
            assert text == "tok " * 8 and events[-1] == "[DONE]"
            names = [type(e).__name__ for e in await _events(bus)]
            assert names == ["BranchOpened", "RequestSubmitted", "BranchEnded"]
    finally:
        await bus.close()
