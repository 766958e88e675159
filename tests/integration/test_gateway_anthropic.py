"""The official ``anthropic`` and ``openai`` Python clients against the gateway, over a real
nats-server, with a stub router and a real (simulated) engine worker: multi-turn tool-use
exchanges, streaming and not, as an agent harness drives them (docs/gateway.md, "Anthropic
Messages API")."""

from __future__ import annotations

import asyncio
import contextlib
import json

import anthropic
import openai
import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestClient, TestServer

from engine.profiles import load_profile
from engine.worker.loop import EngineWorker
from events.catalog import ContextCompacted, RequestSubmitted, RouteDecided
from services.adapters.bus import InMemoryBus, NatsBus
from services.adapters.bus.tokens import MemoryTokens, NatsTokens, sim_text
from services.drivers.gateway.app import Gateway, GatewayConfig
from tests.integration.test_gateway_app import gateway

KEY = "sk-evolving-test-key"
MODEL = "evolving-sim"
#: the whole max_tokens budget: the sim engine may end a turn early (its drawn length; random request ids)
FULL = {"ignore_eos": True}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                  "parameters": t["input_schema"]}} for t in TOOLS]


async def prefix_cache_router(bus, node: str, seen: set[int]) -> None:
    """Place every request on ``node``; ``t_c`` = the prompt's leading blocks seen before (a
    perfect prefix cache), so the reply's ``cache_read_input_tokens`` has something to show."""
    async with bus.consumer(None, start_seq=1, subjects=f"ei.{bus.partition}.agent.>") as c:
        async for d in c:
            ev = d.event
            if isinstance(ev, RequestSubmitted):
                hit = 0
                while hit < len(ev.blocks) and ev.blocks[hit] in seen:
                    hit += 1
                seen.update(ev.blocks)
                await bus.publish(RouteDecided(ts=ev.ts, request=ev.request, prefill_node=node, decode_node=node,
                                               policy="stub", t_c=hit * ev.block_tokens))


@pytest.fixture
async def served(nats_url, partition):
    """(gateway URL, the gateway, a bus to read the stream with)."""
    buses = [await NatsBus.connect(nats_url, partition=partition) for _ in range(3)]
    gw_bus, w_bus, r_bus = buses
    worker = EngineWorker(w_bus, NatsTokens(w_bus.nc, partition), "n1", "collocated",
                          load_profile("gb300-glm52"), time_scale=5.0)
    await worker.start()
    router = asyncio.create_task(prefix_cache_router(r_bus, "n1", set()))
    gw = Gateway(gw_bus, NatsTokens(gw_bus.nc, partition),
                 GatewayConfig(partition=partition, model=MODEL, served_model_names=(MODEL,), block_tokens=64,
                               api_keys=frozenset({KEY})))  # names restricted: another is a 404
    try:
        async with TestClient(TestServer(gw.make_app())) as client:
            yield str(client.make_url("")).rstrip("/"), gw, r_bus
    finally:
        router.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await router
        await worker.stop()
        for b in buses:
            await b.close()


async def _stream_events(bus) -> list:
    head = await bus.last_seq()
    out = []
    async with bus.consumer(None, start_seq=1) as c:
        async for d in c:
            out.append(d.event)
            if d.seq >= head:
                break
    return out


async def test_anthropic_client_multi_turn_tool_use_streaming_and_not(served):
    url, _gw, bus = served
    client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
    branch = {"x-branch-id": "claude/main"}
    system = "You are a weather bot."
    history: list = [{"role": "user", "content": "What is the weather in Paris?"}]

    # turn 1, streaming: the SDK's stream helper accumulates the events into a message
    async with client.messages.stream(model=MODEL, max_tokens=6, system=system, tools=TOOLS,
                                      messages=history, extra_headers=branch, extra_body=FULL) as stream:
        kinds = [ev.type async for ev in stream]
        first = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert [b.type for b in first.content] == ["text"] and first.content[0].text == sim_text(6)
    assert first.stop_reason == "max_tokens" and first.usage.output_tokens == 6
    assert first.usage.cache_read_input_tokens == 0  # nothing seen before
    counted = await client.messages.count_tokens(model=MODEL, system=system, tools=TOOLS, messages=history)
    assert first.usage.input_tokens == counted.input_tokens

    # the harness ran the tool the model "asked for": tool_use in the assistant turn, tool_result back
    history += [{"role": "assistant", "content": [*(b.to_dict() for b in first.content),
                                                  {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                              "content": "18 C, sunny"}]}]
    # turn 2, non-streaming
    second = await client.messages.create(model=MODEL, max_tokens=4, system=system, tools=TOOLS,
                                          messages=history, extra_headers=branch, extra_body=FULL)
    assert second.content[0].text == sim_text(4) and second.stop_reason == "max_tokens"
    u = second.usage
    total_in = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    counted2 = await client.messages.count_tokens(model=MODEL, system=system, tools=TOOLS, messages=history)
    assert total_in == counted2.input_tokens > counted.input_tokens  # tool_use / tool_result are in the prompt
    # turn 1's full blocks are read from the cache now: the engine found them (its count wins over
    # the router's plan; the gateway's blocks are the engine profile's 64 tokens)
    assert u.cache_read_input_tokens == (counted.input_tokens // 64) * 64 > 0

    # turn 3, streaming again, through the raw event stream
    history += [second.to_param(), {"role": "user", "content": "Thanks. And tomorrow?"}]
    raw = await client.messages.create(model=MODEL, max_tokens=3, system=system, tools=TOOLS, messages=history,
                                       stream=True, extra_headers={**branch, "x-branch-end": "true"}, extra_body=FULL)
    events = [ev async for ev in raw]  # the SDK drops the pings
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == sim_text(3)
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 3

    # on the bus: one branch, three requests whose prompts extend each other (no compaction)
    evs = await _stream_events(bus)
    subs = [e for e in evs if isinstance(e, RequestSubmitted)]
    assert [s.branch for s in subs] == ["claude/main"] * 3 and [s.max_tokens for s in subs] == [6, 4, 3]
    assert subs[0].prompt_tokens == counted.input_tokens and subs[1].prompt_tokens == counted2.input_tokens
    assert subs[1].blocks[: len(subs[0].blocks)] == subs[0].blocks
    assert not any(isinstance(e, ContextCompacted) for e in evs)


async def test_anthropic_defined_tools_client_ones_called_server_ones_left_out(served):
    """Anthropic's own tool types through the ``anthropic`` client: the client tools (bash, the
    text editor) are rendered with their documented input schemas and a forced call of each comes
    back as a ``tool_use`` with the tool's name and an input valid against that schema; a server
    tool (web search, web fetch) is accepted, left out of the prompt and reported - the response
    header ``x-evolving-unserved-tools``, ``evolving.unserved_tools`` and the ignored-fields counter."""
    import jsonschema

    from services.drivers.gateway.anthropic_api import client_tool

    url, gw, _bus = served
    client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
    bash = {"type": "bash_20250124", "name": "bash"}
    editor = {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    fetch = {"type": "web_fetch_20250910", "name": "web_fetch"}
    msgs = [{"role": "user", "content": "List the files, then show README.md"}]
    for tool in (bash, editor):
        raw = await client.messages.with_raw_response.create(
            model=MODEL, max_tokens=200, messages=msgs, tools=[bash, editor, search, fetch],
            tool_choice={"type": "tool", "name": tool["name"]}, extra_headers={"x-branch-id": f"cc/{tool['name']}"})
        msg = await raw.parse()
        assert msg.stop_reason == "tool_use", msg
        (use,) = [b for b in msg.content if b.type == "tool_use"]
        assert use.name == tool["name"]
        jsonschema.validate(use.input, client_tool(tool["type"], tool)["input_schema"])
        assert raw.headers["x-evolving-unserved-tools"] == "web_search_20250305,web_fetch_20250910"
        assert json.loads(await raw.read())["evolving"]["unserved_tools"] == ["web_search_20250305", "web_fetch_20250910"]
    for kind in ("web_search_20250305", "web_fetch_20250910"):
        assert gw.metrics.get("ei_gateway_ignored_fields_total", api="anthropic", field=f"tools[].type: {kind}") == 2
    # the server tools are not in the prompt; the client tools are
    with_all = await client.messages.count_tokens(model=MODEL, messages=msgs, tools=[bash, editor, search, fetch])
    clients_only = await client.messages.count_tokens(model=MODEL, messages=msgs, tools=[bash, editor])
    bare = await client.messages.count_tokens(model=MODEL, messages=msgs)
    assert with_all.input_tokens == clients_only.input_tokens > bare.input_tokens
    # the client runs the tool and sends its result back: the conversation goes on on its branch
    second = await client.messages.create(
        model=MODEL, max_tokens=4, tools=[bash, editor, search, fetch], extra_headers={"x-branch-id": "cc/bash"},
        messages=[*msgs, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "bash",
                                                            "input": {"command": "ls"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                "content": "README.md"}]}])
    assert second.stop_reason in ("end_turn", "max_tokens") and second.usage.output_tokens > 0


async def test_raw_sse_event_sequence_and_anthropic_errors(served):
    url, _gw, _bus = served
    body = {"model": MODEL, "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with ClientSession() as http:
        async with http.post(f"{url}/v1/messages", json=body,
                             headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            assert r.headers["request-id"]
            text = await r.text()
        frames = [f for f in text.split("\n\n") if f.strip()]
        names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
        datas = [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames]
        assert all(d["type"] == n for n, d in zip(names, datas, strict=True))
        assert names[:3] == ["message_start", "content_block_start", "ping"]
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert set(names[3:-3]) == {"content_block_delta"}
        start = datas[0]["message"]
        assert (start["role"], start["content"], start["stop_reason"]) == ("assistant", [], None)
        assert start["id"].startswith("msg_") and start["usage"]["cache_read_input_tokens"] == 0

        # errors: Anthropic's shape and status on /v1/messages*, OpenAI's elsewhere
        async def err(path, payload, headers=None, method="POST"):
            async with http.request(method, f"{url}{path}", json=payload,
                                    headers={"x-api-key": KEY, **(headers or {})}) as r:
                return r.status, await r.json()

        status, out = await err("/v1/messages", {**body, "stream": False, "top_k": -1})
        assert status == 400 and set(out) == {"type", "error"} and set(out["error"]) == {"type", "message"}
        assert out["error"]["type"] == "invalid_request_error" and "top_k" in out["error"]["message"]
        status, out = await err("/v1/messages", {"model": MODEL, "messages": body["messages"]})
        assert status == 400 and out["type"] == "error" and out["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in out["error"]["message"]
        status, out = await err("/v1/messages", {**body, "model": "claude-opus"})
        assert (status, out["error"]["type"]) == (404, "not_found_error")
        status, out = await err("/v1/messages", body, {"x-api-key": "sk-wrong-key-000"})
        assert (status, out["error"]["type"]) == (401, "authentication_error")
        status, out = await err("/v1/messages", None, method="GET")
        assert (status, out["error"]["type"]) == (405, "invalid_request_error")
        status, out = await err("/v1/chat/completions", {"model": "nope", "messages": body["messages"]})
        assert status == 404 and set(out) == {"error"} and out["error"]["code"] == "model_not_found"


async def test_openai_client_chat_with_tools_multi_turn_streaming(served):
    url, _gw, bus = served
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    branch = {"x-branch-id": "codex/main"}
    messages: list = [{"role": "system", "content": "You are a weather bot."},
                      {"role": "user", "content": "What is the weather in Paris?"}]

    async def turn(max_tokens: int) -> tuple[str, dict]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=OPENAI_TOOLS, tool_choice="auto", max_tokens=max_tokens,
            stream=True, stream_options={"include_usage": True}, extra_headers=branch)
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                text += ch.delta.content or ""
                finish = ch.finish_reason or finish
        assert finish == "length"
        return text, usage

    text, usage = turn1 = await turn(5)
    assert text == sim_text(5) and usage.completion_tokens == 5
    # the same conversation through the Messages API renders to the same prompt
    counted = await anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0).messages.count_tokens(
        model=MODEL, system=messages[0]["content"], tools=TOOLS, messages=messages[1:])
    assert usage.prompt_tokens == counted.input_tokens

    messages += [{"role": "assistant", "content": turn1[0],
                  "tool_calls": [{"id": "call_1", "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    text2, usage2 = await turn(3)
    assert text2 == sim_text(3) and usage2.prompt_tokens > usage.prompt_tokens
    evs = await _stream_events(bus)
    subs = [e for e in evs if isinstance(e, RequestSubmitted)]
    assert [s.branch for s in subs] == ["codex/main"] * 2
    assert subs[1].blocks[: len(subs[0].blocks)] == subs[0].blocks
    assert not any(isinstance(e, ContextCompacted) for e in evs)


async def test_engine_failures_in_anthropic_shape(partition):
    """An engine error before the first token is a JSON 502 ``api_error``; an engine that goes
    silent mid-stream ends the stream with an ``error`` event (no message_stop)."""
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition), {"fail": {"bad"}, "stall": {"slow"}},
                       token_timeout_s=0.2) as (_gw, client):
        body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        r = await client.post("/v1/messages", json=body, headers={"x-branch-id": "bad"})
        assert r.status == 502 and (await r.json())["error"]["type"] == "api_error"
        r = await client.post("/v1/messages", json={**body, "stream": True}, headers={"x-branch-id": "slow"})
        assert r.status == 200
        frames = [f for f in (await r.text()).split("\n\n") if f.strip()]
        names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
        assert names[:3] == ["message_start", "content_block_start", "ping"] and names[-1] == "error"
        assert "message_stop" not in names
        err = json.loads(frames[-1].split("\n")[1].removeprefix("data: "))
        assert err["type"] == "error" and err["error"]["type"] == "api_error"
