"""The gateway's HTTP app against an InMemoryBus (and once against a real nats-server), with a
fake "router + engine" task that answers RouteDecided and token messages."""

from __future__ import annotations

import asyncio
import contextlib
import json

import msgspec
import pytest

from events.catalog import (
    BranchEnded,
    BranchOpened,
    ContextCompacted,
    RequestSubmitted,
    RouteDecided,
)
from events.hashing import block_hashes
from services.adapters.bus import InMemoryBus, NatsBus
from services.adapters.bus.tokens import MemoryTokens, NatsTokens, TokenMsg, sim_text
from services.drivers.gateway.app import Gateway, GatewayConfig
from tests.integration.gateway_harness import serving as serve_app


async def fake_cluster(bus, tokens, chunk: int = 3, shadow_first: bool = True, fail: set[str] = frozenset(),
                       silent: set[str] = frozenset(), stall: set[str] = frozenset()):
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
            if ev.branch in stall:  # the engine goes silent after the first token
                continue
            done = 1
            while ev.max_tokens - done > chunk:
                await tokens.publish(TokenMsg(request=ev.request, kind="chunk", tokens=chunk, total=done + chunk,
                                              text=sim_text(chunk, done), simulated=True))
                done += chunk
            rest = ev.max_tokens - done
            await tokens.publish(TokenMsg(request=ev.request, kind="done", tokens=rest, total=ev.max_tokens,
                                          text=sim_text(rest, done), finish_reason="length", simulated=True))


@contextlib.asynccontextmanager
async def gateway(bus, tokens, _fake: dict | None = None, **cfg):
    gw = Gateway(bus, tokens, GatewayConfig(partition=bus.partition, **cfg), clock=lambda: 100.0)
    async with serve_app(gw, fake_cluster(bus, tokens, **(_fake or {}))) as client:
        yield gw, client


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
        assert body["choices"][0]["message"] == {"role": "assistant", "content": sim_text(8)}
        assert body["choices"][0]["finish_reason"] == "length"
        prompt = "<|user|>\n" + "x" * 200 + "<|end|>\n<|assistant|>\n"
        assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 8,
                                 "total_tokens": len(prompt) + 8, "prompt_tokens_details": {"cached_tokens": 0}}
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
        assert text == sim_text(8)
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
            assert (await r.json())["choices"][0]["text"] == sim_text(2)
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
            assert text == sim_text(8) and events[-1] == "[DONE]"
            names = [type(e).__name__ for e in await _events(bus)]
            assert names == ["BranchOpened", "RequestSubmitted", "BranchEnded"]
    finally:
        await bus.close()


# --------------------------------------------------------------------------- hardening
KEY = "sk-test-key-0001"


def _assert_error(body: dict, status_code: str, param=...) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["code"], str) and err["code"] == status_code and err["message"]
    if param is not ...:
        assert err["param"] == param
    return err


async def test_api_keys(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition), api_keys=frozenset({KEY})) as (gw, client):
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        _assert_error(await r.json(), "missing_api_key")
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                              headers={"Authorization": "Bearer sk-wrong-key-0001"})
        assert r.status == 401
        _assert_error(await r.json(), "invalid_api_key")
        r = await client.get("/v1/models")
        assert r.status == 401
        assert await bus.last_seq() == 0  # nothing published without a key
        ok = {"Authorization": f"Bearer {KEY}"}
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=ok)
        assert r.status == 200 and (await r.json())["choices"][0]["text"] == sim_text(2)
        assert (await client.get("/v1/models", headers=ok)).status == 200
        assert (await client.get("/health")).status == 200  # probes need no key
        assert (await (await client.get("/health")).json())["auth"] is True
        assert (await client.get("/metrics")).status == 200
        assert gw.metrics.get("ei_gateway_errors_total", status="401") == 3


async def _raw_http(port: int, head: bytes, body_part: bytes = b"", timeout: float = 2.0) -> tuple[bytes, float]:
    """Send the request head and part of a body, then read what the server answers (no more body sent)."""
    import time

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    try:
        writer.write(head + body_part)
        await writer.drain()
        data = b""
        while b"\r\n\r\n" not in data or not _complete(data):
            chunk = await asyncio.wait_for(reader.read(65536), timeout)
            if not chunk:
                break
            data += chunk
        return data, time.monotonic() - t0
    finally:
        writer.close()


def _complete(data: bytes) -> bool:
    head, _, rest = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(rest) >= int(line.split(b":")[1])
    return head.startswith(b"HTTP/1.1 100")


def _parse(data: bytes) -> tuple[int, dict]:
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(rest) if rest else {}


async def test_a_60mb_body_is_refused_from_its_content_length_before_it_is_read(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (gw, client):
        size = 60 * 1024 * 1024
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {size}\r\n\r\n").encode()
        # only 64 KiB of the declared 60 MiB is ever sent: an answer proves nothing waited for the rest
        data, elapsed = await _raw_http(client.port, head, b'{"messages": "' + b"x" * 65536)
        status, body = _parse(data)
        assert status == 413 and elapsed < 1.0, (status, elapsed)
        _assert_error(body, "request_too_large", "body")
        assert str(size) in body["error"]["message"]
        assert gw.metrics.get("ei_gateway_requests_total") == 0  # the handler never ran
        assert gw.metrics.get("ei_gateway_errors_total", status="413") == 1


async def test_expect_100_continue_gets_413_instead_of_continue(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (_gw, client):
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 62914560\r\nExpect: 100-continue\r\n\r\n")
        data, elapsed = await _raw_http(client.port, head)
        assert not data.startswith(b"HTTP/1.1 100")
        status, body = _parse(data)
        assert status == 413 and elapsed < 1.0
        _assert_error(body, "request_too_large")
        # a small body with Expect goes on as usual
        body_ok = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body_ok)}\r\nExpect: 100-continue\r\n\r\n").encode()
        data, _ = await _raw_http(client.port, head)
        assert data.startswith(b"HTTP/1.1 100 Continue")


async def test_a_chunked_body_is_cut_at_the_limit(partition):
    """A body without Content-Length is read only up to the limit (client_max_size), then 413;
    the uploads stop long before their 60 MB (tests/integration/test_gateway_process.py measures
    the memory of a real gateway process under the same attack)."""
    bus = InMemoryBus(partition)
    block = b"x" * (1024 * 1024)
    sent = []

    async def body(n_mb: int):
        yield b'{"prompt": "'
        for _ in range(n_mb):
            sent.append(1)
            yield block

    async with gateway(bus, MemoryTokens(partition), max_body_bytes=2 * 1024 * 1024) as (gw, client):
        async def upload():
            r = await client.post("/v1/completions", data=body(60), headers={"Content-Type": "application/json"})
            return r.status, await r.json()

        results = await asyncio.wait_for(asyncio.gather(*(upload() for _ in range(3))), 60)
        for status, out in results:
            assert status == 413
            _assert_error(out, "request_too_large", "body")
        assert len(sent) < 3 * 60, len(sent)
        assert gw.metrics.get("ei_gateway_errors_total", status="413") == 3
        assert await bus.last_seq() == 0


async def test_context_length_exceeded(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition), context_length=300) as (_gw, client):
        r = await client.post("/v1/completions", json={"prompt": "p" * 290, "max_tokens": 20})
        assert r.status == 400
        err = _assert_error(await r.json(), "context_length_exceeded", "prompt")
        assert "maximum context length is 300 tokens" in err["message"] and "310" in err["message"]
        r = await client.post("/v1/chat/completions",
                              json={**CHAT, "messages": [{"role": "user", "content": "c" * 400}]})
        assert r.status == 400
        _assert_error(await r.json(), "context_length_exceeded", "messages")
        r = await client.post("/v1/completions", json={"prompt": list(range(300))})  # no room left at all
        _assert_error(await r.json(), "context_length_exceeded", "prompt")
        assert await bus.last_seq() == 0
        # without max_tokens the default (128) is capped to what the context leaves
        r = await client.post("/v1/completions", json={"prompt": "p" * 290})
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 10
        r = await client.post("/v1/completions", json={"prompt": "p" * 280, "max_tokens": 20})
        assert r.status == 200


async def test_unknown_model_and_the_model_endpoints(partition):
    """With ``--served-model-name`` the names are checked (without it any name is served:
    test_gateway_clients.py)."""
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition), model="org/glm-5",
                       served_model_names=("org/glm-5",)) as (_gw, client):
        r = await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
        assert r.status == 404
        _assert_error(await r.json(), "model_not_found", "model")
        r = await client.get("/v1/models/org/glm-5")
        card = await r.json()
        assert r.status == 200 and card["id"] == "org/glm-5" and card["object"] == "model"
        r = await client.get("/v1/models/gpt-4o")
        assert r.status == 404
        _assert_error(await r.json(), "model_not_found")
        r = await client.post("/v1/completions", json={"model": "org/glm-5", "prompt": "x", "max_tokens": 1})
        assert r.status == 200 and (await r.json())["model"] == "org/glm-5"
        assert await bus.last_seq() > 0


async def test_unknown_route_and_method_are_json(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (gw, client):
        r = await client.get("/v1/nothing")
        assert r.status == 404 and r.content_type == "application/json"
        _assert_error(await r.json(), "not_found")
        r = await client.get("/v1/chat/completions")
        assert r.status == 405 and r.content_type == "application/json" and "POST" in r.headers["Allow"]
        _assert_error(await r.json(), "method_not_allowed")
        assert gw.metrics.get("ei_gateway_errors_total", status="405", code="method_not_allowed") == 1


@pytest.mark.parametrize("raw, param", [
    (b'{"model": "evolving-sim", "messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}',
     "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages[0].content"),
])
async def test_a_lone_surrogate_is_a_json_400(partition, raw, param):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (_gw, client):
        r = await client.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
        assert r.status == 400 and r.content_type == "application/json"
        _assert_error(await r.json(), "invalid_value", param)
        assert await bus.last_seq() == 0


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"n": 2}, "n"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"response_format": {"type": "grammar"}}, "response_format"),
    ("/v1/chat/completions", {"logit_bias": {"1": 5}}, "logit_bias"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"logprobs": 1}, "logprobs"),
])
async def test_parameters_it_cannot_honour_are_a_400_naming_them(partition, path, extra, param):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (_gw, client):
        base = CHAT if "chat" in path else {"prompt": "x", "max_tokens": 1}
        r = await client.post(path, json={**base, **extra})
        assert r.status == 400
        err = _assert_error(await r.json(), "unsupported_parameter", param)
        assert param in err["message"]
        assert await bus.last_seq() == 0


async def test_sampling_and_stopping_travel_on_the_request_event(partition):
    """The engine gets what the client asked (docs/gateway.md, "Sampling and stopping"): every
    request says ignore_eos (false unless asked: its turn ends at end of turn), and the sampling
    parameters the client set; Anthropic's stop_sequences arrive as stop."""
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (_gw, client):
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status == 200
        r = await client.post("/v1/completions", json={"prompt": "z" * 50, "max_tokens": 4, "ignore_eos": True,
                                                      "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 11,
                                                      "stop": "END"})
        assert r.status == 200
        r = await client.post("/v1/messages", json={"model": "evolving-sim", "max_tokens": 4, "temperature": 0.5,
                                                   "stop_sequences": ["\n\nHuman:"],
                                                   "messages": [{"role": "user", "content": "hi"}]})
        assert r.status == 200
        plain, bench, anth = [e for e in await _events(bus) if isinstance(e, RequestSubmitted)]
        assert plain.ignore_eos is False and plain.temperature is msgspec.UNSET and plain.stop is msgspec.UNSET
        assert (bench.ignore_eos, bench.temperature, bench.top_p, bench.top_k, bench.seed, bench.stop) == \
            (True, 0.7, 0.9, 40, 11, ["END"])
        assert (anth.ignore_eos, anth.temperature, anth.stop) == (False, 0.5, ["\n\nHuman:"])


async def test_a_request_without_a_budget_gets_what_the_context_leaves(partition):
    """vLLM's default: the engine ends the turn, the budget only bounds it (a client such as
    Codex that sets none must not be cut at a small default: docs/gateway.md)."""
    for cap, want in ((0, 300), (50, 50)):  # --default-max-tokens 0 (the default): no cap but the context
        bus = InMemoryBus(partition)
        async with gateway(bus, MemoryTokens(partition), context_length=400, default_max_tokens=cap) as (_gw, client):
            r = await client.post("/v1/completions", json={"prompt": "z" * 100})
            assert r.status == 200
            assert [(e.prompt_tokens, e.max_tokens) for e in await _events(bus, (RequestSubmitted,))] == [(100, want)]


async def test_sampling_parameters_are_reported_as_unapplied(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (_gw, client):
        r = await client.post("/v1/chat/completions", json={**CHAT, "min_p": 0.1, "presence_penalty": 1, "n": 1,
                                                            "temperature": 0.7, "seed": 1})  # these two reach the engine
        assert r.status == 200
        assert (await r.json())["evolving"]["unapplied"] == ["min_p", "presence_penalty"]
        assert r.headers["x-evolving-unapplied"] == "min_p,presence_penalty"
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert "unapplied" not in (await r.json())["evolving"] and "x-evolving-unapplied" not in r.headers


async def test_errors_inside_a_stream_have_string_codes(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition), token_timeout_s=0.3,
                       _fake={"stall": {"st"}}) as (gw, client):
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-branch-id": "st"})
        assert r.status == 200
        events = _sse(await r.text())
        errs = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errs) == 1 and events[-1] == "[DONE]"
        _assert_error(errs[0], "timeout")
        assert gw.metrics.get("ei_gateway_errors_total", status="504", code="timeout") == 1


async def test_metrics_are_prometheus_text_per_app(partition):
    from prometheus_client.parser import text_string_to_metric_families

    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (gw1, c1), \
            gateway(InMemoryBus(partition), MemoryTokens(partition)) as (_gw2, c2):
        assert (await c1.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})).status == 200
        assert (await c1.post("/v1/completions", json={"prompt": "x", "n": 5})).status == 400
        r = await c1.get("/metrics")
        assert r.headers["Content-Type"].startswith("text/plain")
        fams = {f.name: f for f in text_string_to_metric_families(await r.text())}
        val = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
        assert val[("ei_gateway_requests_total", (("endpoint", "completions"),))] == 2
        assert val[("ei_gateway_output_tokens_total", ())] == 3
        assert val[("ei_gateway_errors_total", (("code", "unsupported_parameter"), ("status", "400")))] == 1
        assert fams["ei_gateway_in_flight_requests"].type == "gauge"
        other = await (await c2.get("/metrics")).text()
        assert "ei_gateway_output_tokens_total 0.0" in other  # its own registry
        assert gw1.metrics.get("ei_gateway_output_tokens_total") == 3


async def test_evolving_drive_sends_its_api_key(partition):
    from replay.traces.format import Branch, Request, Session
    from services.drivers.gateway.drive import DriveConfig, Driver

    session = Session(id="s", branches=[Branch(id="root", steps=[Request(blocks=[1], output_tokens=2)])])
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition), api_keys=frozenset({KEY})) as (_gw, client):
        keyless = await Driver(DriveConfig(gateway="", run_id="a-"), http=client).run([session])
        keyed = await Driver(DriveConfig(gateway="", run_id="b-", api_key=KEY), http=client).run([session])
    assert keyless.summary()["requests_failed"] == 1 and "401" in keyless.results[0].error
    assert keyed.summary()["requests_ok"] == 1 and keyed.summary()["output_tokens"] == 2


async def test_an_unexpected_exception_is_a_json_500(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (gw, client):
        def broken(_text):
            raise RuntimeError("tokenizer bug")

        gw.tokenizer.encode = broken
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status == 500 and r.content_type == "application/json"
        err = _assert_error(await r.json(), "internal_error", None)
        assert "tokenizer bug" not in err["message"]  # no internals leak to the client
        assert (await client.get("/health")).status == 200  # and the gateway goes on


async def test_claude_code_headers_give_one_agent_with_a_subagent_and_idle_expiry(partition):
    """Claude Code's headers (session, agent id) become a root branch and a
    sub-agent; Claude Code never ends a session, so both end by idle expiry on the stream."""
    bus = InMemoryBus(partition)
    now = [100.0]
    async with gateway(bus, MemoryTokens(partition), branch_ttl_s=60.0) as (gw, client):
        gw.clock = lambda: now[0]
        cc = {"x-claude-code-session-id": "cc-sess"}
        hints = {"agent_hints": {"priority": 4, "osl": 5, "made_up_hint": 1}}
        for headers, body in [(cc, CHAT), ({**cc, "x-claude-code-agent-id": "cc-agent"}, {**CHAT, "nvext": hints}),
                              (cc, CHAT)]:
            r = await client.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status == 200, await r.text()
            now[0] += 1.0
        assert gw.metrics.get("ei_gateway_unknown_agent_hints_total") == 1
        evs = await _events(bus)
        assert [type(e).__name__ for e in evs] == ["BranchOpened", "RequestSubmitted", "BranchOpened",
                                                   "RequestSubmitted", "RequestSubmitted"]
        root, sub = evs[0], evs[2]
        assert (root.branch, root.parent, root.mode, root.session) == ("cc-sess", None, "root", "cc-sess")
        assert (sub.branch, sub.parent, sub.mode, sub.session) == ("cc-agent", "cc-sess", "subagent", "cc-sess")
        assert [e.branch for e in evs if isinstance(e, RequestSubmitted)] == ["cc-sess", "cc-agent", "cc-sess"]
        assert (evs[3].priority, evs[3].osl, evs[3].expected_output_tokens()) == (4, 5, 5)
        assert gw.table.open.keys() == {"cc-sess", "cc-agent"}
        # the next request, 61 s after the sub-agent's: the sub-agent has expired, the session not
        now[0] = 101.0 + 61.0
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"x-branch-id": "other"})
        assert r.status == 200
        now[0] = 200.0  # and the periodic check (what the ticker calls) ends the rest
        await gw._expire(gw.clock())
        ended = [e for e in await _events(bus) if isinstance(e, BranchEnded)]
        assert [(e.branch, e.reason, e.ts) for e in ended] == [("cc-agent", "idle", 162.0),
                                                                ("cc-sess", "idle", 200.0)]
        assert gw.metrics.get("ei_gateway_branches_expired_total") == 2
        # Claude Code resumes the session later: a fresh branch on the stream, same session
        r = await client.post("/v1/chat/completions", json=CHAT, headers=cc)
        assert r.status == 200
        reopened = [e for e in await _events(bus) if isinstance(e, BranchOpened)][-1]
        assert (reopened.branch, reopened.session) == ("cc-sess~2", "cc-sess")


async def test_the_expiry_ticker_ends_idle_branches_without_requests(partition):
    bus = InMemoryBus(partition)
    now = [100.0]
    async with gateway(bus, MemoryTokens(partition), branch_ttl_s=0.2) as (gw, client):
        gw.clock = lambda: now[0]
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"session-id": "codex-1"})
        assert r.status == 200
        now[0] = 101.0
        for _ in range(100):  # the ticker runs every TTL / 4 (0.05 s here)
            if not gw.table.open:
                break
            await asyncio.sleep(0.02)
        ended = [e for e in await _events(bus) if isinstance(e, BranchEnded)]
        assert [(e.branch, e.reason) for e in ended] == [("codex-1", "idle")]
