"""The gateway's frontend metrics and ``usage.prompt_tokens_details.cached_tokens`` through the
app (aiohttp test client, InMemoryBus, a fake router + engine): a request, then ``/metrics``."""

from __future__ import annotations

import asyncio
import contextlib
import json

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from events.catalog import RequestSubmitted, RouteDecided
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens, TokenMsg, sim_text
from services.drivers.gateway.app import Gateway, GatewayConfig
from tests.integration.gateway_harness import serving as serve_app

T_C = 64  # what the fake router plans as cached
ENGINE_CACHED = 128  # what the fake engine says it found, on branches named "engine*"


async def fake_cluster(bus, tokens):
    async with bus.consumer(None, start_seq=1, subjects=f"ei.{bus.partition}.agent.>") as c:
        async for d in c:
            ev = d.event
            if not isinstance(ev, RequestSubmitted):
                continue
            await bus.publish(RouteDecided(ts=ev.ts, request=ev.request, prefill_node="n1", decode_node="n1",
                                           policy="fake", t_c=T_C, t_uc=ev.prompt_tokens - T_C))
            first = {"cached_tokens": ENGINE_CACHED} if ev.branch.startswith("engine") else {}
            await tokens.publish(TokenMsg(request=ev.request, kind="first", tokens=1, total=1, text=sim_text(1),
                                          simulated=True, **first))
            await asyncio.sleep(0.01)
            await tokens.publish(TokenMsg(request=ev.request, kind="chunk", tokens=2, total=3, text=sim_text(2),
                                          simulated=True))
            rest = ev.max_tokens - 3
            await tokens.publish(TokenMsg(request=ev.request, kind="done", tokens=rest, total=ev.max_tokens,
                                          text=sim_text(rest), finish_reason="length", simulated=True))


@contextlib.asynccontextmanager
async def gateway(partition):
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    gw = Gateway(bus, tokens, GatewayConfig(partition=partition, model="m1", served_model_names=("m1",)),
                 clock=lambda: 100.0)  # names restricted: "nope" is a 404
    async with serve_app(gw, fake_cluster(bus, tokens)) as client:
        yield gw, client


def _sse(text: str) -> list:
    return [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]


async def _scrape(client) -> dict:
    r = await client.get("/metrics")
    assert r.status == 200
    out = {}
    for fam in text_string_to_metric_families(await r.text()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, lab), v in samples.items() if n == name and labels.items() <= dict(lab).items())


CHAT = {"model": "m1", "messages": [{"role": "user", "content": "x" * 300}], "max_tokens": 8}


async def test_cached_tokens_in_usage_and_frontend_metrics(partition):
    async with gateway(partition) as (_gw, client):
        # non-streaming chat: the engine's count wins over the router's plan
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"x-branch-id": "engine-a"})
        assert r.status == 200, await r.text()
        usage = (await r.json())["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": ENGINE_CACHED}
        prompt = usage["prompt_tokens"]
        # streaming with include_usage: the usage chunk has it too; no engine count -> t_c
        r = await client.post("/v1/chat/completions", headers={"x-branch-id": "plan-b"},
                              json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
        chunks = _sse(await r.text())
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": T_C}
        assert all("usage" not in c for c in chunks[:-1])
        # completions (unary) and Anthropic messages (stream)
        r = await client.post("/v1/completions", json={"model": "m1", "prompt": "y" * 200, "max_tokens": 5},
                              headers={"x-branch-id": "engine-c"})
        assert (await r.json())["usage"]["prompt_tokens_details"] == {"cached_tokens": ENGINE_CACHED}
        r = await client.post("/v1/messages", headers={"x-branch-id": "engine-d"},
                              json={"model": "m1", "max_tokens": 6, "stream": True,
                                    "messages": [{"role": "user", "content": "z" * 300}]})
        assert r.status == 200
        start = next(c for c in _sse(await r.text()) if c["type"] == "message_start")
        assert start["message"]["usage"]["cache_read_input_tokens"] == ENGINE_CACHED
        r = await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
        assert r.status == 404  # refused before it is served: not a frontend request

        m = await _scrape(client)
        lab = {"model": "m1"}
        req = "ei_frontend_requests_total"
        assert _get(m, req, endpoint="chat_completions", request_type="unary", status="success", **lab) == 1
        assert _get(m, req, endpoint="chat_completions", request_type="stream", status="success", **lab) == 1
        assert _get(m, req, endpoint="completions", request_type="unary", status="success", **lab) == 1
        assert _get(m, req, endpoint="anthropic_messages", request_type="stream", status="success", **lab) == 1
        assert _get(m, req, status="error") == 0
        for h in ("time_to_first_token_seconds", "request_duration_seconds", "input_sequence_tokens",
                  "output_sequence_tokens", "cached_tokens"):
            assert _get(m, f"ei_frontend_{h}_count", **lab) == 4, h
            assert _get(m, f"ei_frontend_{h}_bucket", le="+Inf", **lab) == 4, h
        # each request: 2 tokens 10 ms after the first, then the rest at once
        assert _get(m, "ei_frontend_inter_token_latency_seconds_count", **lab) == (8 + 8 + 5 + 6) - 4
        assert _get(m, "ei_frontend_output_tokens_total", **lab) == 8 + 8 + 5 + 6
        assert _get(m, "ei_frontend_output_sequence_tokens_sum", **lab) == 8 + 8 + 5 + 6
        assert _get(m, "ei_frontend_cached_input_tokens_total", **lab) == 3 * ENGINE_CACHED + T_C
        assert _get(m, "ei_frontend_cached_tokens_sum", **lab) == 3 * ENGINE_CACHED + T_C
        assert _get(m, "ei_frontend_input_tokens_total", **lab) == _get(m, "ei_frontend_input_sequence_tokens_sum")
        assert _get(m, "ei_frontend_input_tokens_total", **lab) >= 2 * prompt
        assert _get(m, "ei_frontend_time_to_first_token_seconds_sum", **lab) > 0
        assert _get(m, "ei_frontend_queued_requests", **lab) == 0
        assert _get(m, "ei_frontend_inflight_requests", **lab) == 0
        # the existing names keep working
        assert _get(m, "ei_gateway_output_tokens_total") == 8 + 8 + 5 + 6
        assert _get(m, "ei_gateway_requests_total", endpoint="chat") == 3  # the 404 included, as before


async def test_a_route_timeout_is_an_error_request(partition):
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)  # no router at all
    gw = Gateway(bus, tokens, GatewayConfig(partition=partition, model="m1", route_timeout_s=0.2),
                 clock=lambda: 100.0)
    async with TestClient(TestServer(gw.make_app())) as client:
        r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert r.status == 503
        m = await _scrape(client)
    assert _get(m, "ei_frontend_requests_total", model="m1", endpoint="chat_completions", request_type="stream",
                status="error") == 1
    assert _get(m, "ei_frontend_request_duration_seconds_count") == 0
    assert _get(m, "ei_frontend_queued_requests", model="m1") == 0
