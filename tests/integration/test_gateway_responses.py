"""The OpenAI Responses API (``POST /v1/responses``) through the official ``openai`` client, against
the gateway on the in-process bus with a fake router + engine (docs/gateway.md, "Responses API"):
text answers streaming and not, the event sequence, ``previous_response_id``, ``store: false``,
usage, and a body shaped like Codex CLI's first request."""

from __future__ import annotations

import contextlib
import json

import aiohttp
import openai
import pytest

from events.catalog import BranchEnded, BranchOpened, RequestSubmitted, RouteDecided
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens, TokenMsg, sim_text
from services.drivers.gateway.app import Gateway, GatewayConfig
from services.drivers.gateway.tokenizer import render_chat
from tests.integration.gateway_harness import serving

MODEL = "evolving-sim"
CACHED = 64  # what the fake engine says it reused of every prompt


async def fake_cluster(bus, tokens, finish: str) -> None:
    """Route every request to n1/n2 and answer ``max_tokens`` sim tokens in 3-token chunks,
    ending with ``finish``; the engine reports ``CACHED`` prompt tokens reused."""
    async with bus.consumer(None, start_seq=1, subjects=f"ei.{bus.partition}.agent.>") as c:
        async for d in c:
            ev = d.event
            if not isinstance(ev, RequestSubmitted):
                continue
            await bus.publish(RouteDecided(ts=ev.ts, request=ev.request, prefill_node="n1", decode_node="n2",
                                           policy="fake"))
            await tokens.publish(TokenMsg(request=ev.request, kind="first", tokens=1, total=1, text=sim_text(1),
                                          simulated=True, cached_tokens=min(CACHED, ev.prompt_tokens)))
            done = 1
            while ev.max_tokens - done > 3:
                await tokens.publish(TokenMsg(request=ev.request, kind="chunk", tokens=3, total=done + 3,
                                              text=sim_text(3, done), simulated=True))
                done += 3
            rest = ev.max_tokens - done
            await tokens.publish(TokenMsg(request=ev.request, kind="done", tokens=rest, total=ev.max_tokens,
                                          text=sim_text(rest, done), finish_reason=finish, simulated=True))


@contextlib.asynccontextmanager
async def served(partition: str, finish: str = "stop"):
    """(the gateway, an ``openai.AsyncOpenAI`` client of it, its bus)."""
    bus = InMemoryBus(partition)
    tokens = MemoryTokens(partition)
    gw = Gateway(bus, tokens, GatewayConfig(partition=partition, model=MODEL), clock=lambda: 100.0)
    async with serving(gw, fake_cluster(bus, tokens, finish)) as http:
        client = openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="none", max_retries=0)
        yield gw, client, bus


async def _events(bus) -> list:
    out = []
    head = await bus.last_seq()
    async with bus.consumer(None, start_seq=1) as c:
        async for d in c:
            out.append(d.event)
            if d.seq >= head:
                break
    return out


def _prompt(messages: list[dict], tools: list[dict] | None = None) -> int:
    """Prompt tokens of ``messages`` under the simple template and the byte tokenizer."""
    return len(render_chat(messages, tools).encode())


async def test_text_answer_non_streaming_with_usage(partition):
    async with served(partition) as (gw, client, bus):
        r = await client.responses.create(model=MODEL, instructions="Be brief.", input="What is 2+2?",
                                          max_output_tokens=8)
        assert r.object == "response" and r.status == "completed" and r.incomplete_details is None
        assert r.output_text == sim_text(8)
        [item] = r.output
        assert (item.type, item.role, item.status) == ("message", "assistant", "completed")
        assert item.content[0].type == "output_text" and item.content[0].annotations == []
        prompt = _prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}])
        assert r.usage.input_tokens == prompt and r.usage.input_tokens_details.cached_tokens == CACHED
        assert (r.usage.output_tokens, r.usage.total_tokens) == (8, prompt + 8)
        assert r.usage.output_tokens_details.reasoning_tokens == 0
        assert (r.model, r.instructions, r.max_output_tokens, r.store) == (MODEL, "Be brief.", 8, True)
        assert r.model_extra["evolving"]["decode_node"] == "n2"
        # stored: retrievable as it was answered
        again = await client.responses.retrieve(r.id)
        assert again.id == r.id and again.output_text == r.output_text
        # a request without branch headers or prompt_cache_key is still served and counted
        subs = [e for e in await _events(bus) if isinstance(e, RequestSubmitted)]
        assert len(subs) == 1 and subs[0].prompt_tokens == prompt
        assert gw.metrics.get("ei_gateway_requests_total", endpoint="responses") == 1
        assert gw.metrics.get("ei_frontend_requests_total", endpoint="responses", status="success") == 1


async def test_budget_reached_is_incomplete(partition):
    async with served(partition, finish="length") as (_gw, client, _bus):
        r = await client.responses.create(model=MODEL, input="hi", max_output_tokens=5)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.output[0].status == "incomplete" and r.output_text == sim_text(5)
        stream = await client.responses.create(model=MODEL, input="hi", max_output_tokens=5, stream=True)
        kinds = [ev.type async for ev in stream]
        assert kinds[-1] == "response.incomplete"


EVENT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done", "response.completed"]


async def test_streaming_event_order(partition):
    async with served(partition) as (_gw, client, _bus):
        stream = await client.responses.create(model=MODEL, input="Count to ten.", max_output_tokens=10, stream=True)
        events = [ev async for ev in stream]
        kinds = [ev.type for ev in events]
        collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
        assert collapsed == EVENT_ORDER
        assert kinds.count("response.output_text.delta") >= 3  # one per engine chunk
        assert [ev.sequence_number for ev in events] == list(range(len(events)))
        created, done = events[0].response, events[-1].response
        assert created.status == "in_progress" and created.output == [] and created.usage is None
        assert created.id == done.id and done.status == "completed"
        deltas = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
        assert deltas == sim_text(10) == done.output_text
        added, item_done = events[2], events[-2]
        assert added.item.status == "in_progress" and item_done.item.status == "completed"
        assert {ev.item_id for ev in events if hasattr(ev, "item_id")} == {added.item.id}
        assert done.usage.output_tokens == 10
        assert done.usage.input_tokens_details.cached_tokens == min(CACHED, done.usage.input_tokens)
        # the SDK's own accumulator checks the sequence too
        async with client.responses.stream(model=MODEL, input="Again.", max_output_tokens=4) as s:
            final = await s.get_final_response()
        assert final.output_text == sim_text(4) and final.status == "completed"


async def test_previous_response_id_continues_the_conversation(partition):
    async with served(partition) as (_gw, client, bus):
        h = {"x-branch-id": "chat-1"}
        r1 = await client.responses.create(model=MODEL, instructions="Be brief.", input="What is 2+2?",
                                           max_output_tokens=4, extra_headers=h)
        r2 = await client.responses.create(model=MODEL, previous_response_id=r1.id, max_output_tokens=4,
                                           input=[{"role": "user", "content": [{"type": "input_text",
                                                                               "text": "And 3+3?"}]}],
                                           extra_headers=h, stream=True)
        final = [ev async for ev in r2][-1].response
        assert final.previous_response_id == r1.id
        # instructions are not carried over; the first turn's input and output are
        history = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": sim_text(4)},
                   {"role": "user", "content": "And 3+3?"}]
        assert final.usage.input_tokens == _prompt(history)
        subs = [e for e in await _events(bus) if isinstance(e, RequestSubmitted)]
        assert [s.branch for s in subs] == ["chat-1", "chat-1"] and subs[1].prompt_tokens == _prompt(history)
        # a third turn continues the second (which was streamed)
        r3 = await client.responses.create(model=MODEL, previous_response_id=final.id, input="Thanks.",
                                           max_output_tokens=2)
        assert r3.usage.input_tokens == _prompt(history + [{"role": "assistant", "content": sim_text(4)},
                                                           {"role": "user", "content": "Thanks."}])


async def test_store_false_is_not_kept(partition):
    async with served(partition) as (gw, client, _bus):
        r = await client.responses.create(model=MODEL, input="secret", store=False, max_output_tokens=3)
        assert r.store is False and r.output_text == sim_text(3)
        with pytest.raises(openai.NotFoundError) as err:
            await client.responses.retrieve(r.id)
        assert err.value.body["code"] == "not_found"
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model=MODEL, input="more", previous_response_id=r.id)
        assert err.value.body["code"] == "previous_response_not_found"
        assert err.value.body["param"] == "previous_response_id"
        assert len(gw.responses_store) == 0


def _schema(n: int) -> dict:
    return {"type": "object", "properties": {f"arg_{i}": {"type": "string", "description": "x" * 400}
                                             for i in range(n)}, "required": ["arg_0"]}


def codex_body() -> dict:
    """The shape of ``codex exec`` 0.171's first request: ~40 KB, streaming, ``store: false``,
    reasoning and the fields no server here can honour, 9 tools of three types."""
    functions = [{"type": "function", "name": f"tool_{i}", "description": "d" * 200, "strict": False,
                  "parameters": _schema(12)} for i in range(7)]
    tools = [*functions,
             {"type": "namespace", "name": "mcp__files", "description": "files",
              "tools": [{"type": "function", "name": "read", "parameters": _schema(3)}]},
             {"type": "web_search", "external_web_access": False}]
    return {
        "model": MODEL, "instructions": "You are Codex. " + "i" * 4000,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions/>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<env>cwd=/w</env>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA" + "e" * 500},
            {"type": "function_call", "call_id": "call_1", "name": "tool_0", "arguments": '{"arg_0":"ls"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py"},
        ],
        "tools": tools, "tool_choice": "auto", "parallel_tool_calls": False, "store": False, "stream": True,
        "reasoning": {"effort": "medium", "summary": "auto"}, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "019a-codex-session", "client_metadata": {"originator": "codex_exec"},
        "text": {"verbosity": "low"},
    }


async def test_a_codex_like_body_is_served(partition):
    body = codex_body()
    assert len(json.dumps(body)) > 40_000
    async with served(partition) as (gw, client, bus):
        extra = {k: body[k] for k in ("client_metadata", "tools", "text", "input", "reasoning")}
        stream = await client.responses.create(
            model=MODEL, instructions=body["instructions"], tool_choice="auto", parallel_tool_calls=False,
            store=False, stream=True, include=body["include"], prompt_cache_key=body["prompt_cache_key"],
            extra_body=extra)
        events = [ev async for ev in stream]
        assert events[-1].type == "response.completed" and events[-1].response.store is False
        text = events[-1].response.output_text
        assert text  # a text answer (tool calls out of the model are not parsed here)
        # the prompt: instructions, the messages, the call and its output; the function tools and the
        # namespace's (under its flat name) rendered, web_search not
        expected = [{"role": "system", "content": body["instructions"]},
                    {"role": "developer", "content": "<permissions/>"},
                    {"role": "user", "content": "<env>cwd=/w</env>"}, {"role": "user", "content": "List the files."},
                    {"role": "assistant", "content": [], "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "tool_0", "arguments": '{"arg_0":"ls"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"}]
        fns = [{"name": t["name"], "description": t["description"], "parameters": t["parameters"]}
               for t in body["tools"][:7]] + [{"name": "mcp__files__read", "parameters": _schema(3)}]
        evs = await _events(bus)
        [sub] = [e for e in evs if isinstance(e, RequestSubmitted)]
        assert sub.prompt_tokens == _prompt(expected, fns)
        # prompt_cache_key is the session: the branch, kept open like a session header's
        assert sub.branch == body["prompt_cache_key"]
        assert [e.branch for e in evs if isinstance(e, BranchOpened)] == [body["prompt_cache_key"]]
        assert not any(isinstance(e, BranchEnded) for e in evs)
        assert len(gw.responses_store) == 0  # store: false
        ignored = {f: gw.metrics.get("ei_gateway_ignored_fields_total", api="responses", field=f)
                   for f in ("reasoning", "include", "parallel_tool_calls", "client_metadata", "text",
                             "tools[].type: web_search", "input[].type: reasoning")}
        assert all(v == 1 for v in ignored.values()), ignored
        assert gw.metrics.get("ei_gateway_ignored_fields_total", api="responses", field="tools[].type: namespace") == 0
        # the same session again: the same branch, whose prompt now extends the first
        body2 = {**body, "stream": False, "input": [*body["input"], {"type": "message", "role": "user",
                                                                     "content": "Thanks."}]}
        r = await client.post("/responses", cast_to=openai.types.responses.Response, body=body2)
        assert r.status == "completed"
        subs = [e for e in await _events(bus) if isinstance(e, RequestSubmitted)]
        assert [s.branch for s in subs] == [body["prompt_cache_key"]] * 2
        # a hosted tool is said to be unserved in the response, as on the Messages API
        raw = await client.responses.with_raw_response.create(model=MODEL, input="hi", store=False, extra_body={
            "tools": body["tools"][-2:]})
        assert raw.headers["x-evolving-unserved-tools"] == "web_search"
        assert json.loads(raw.content)["evolving"]["unserved_tools"] == ["web_search"]
        assert subs[1].blocks[: len(subs[0].blocks)] == subs[0].blocks


async def test_errors_are_openai_shaped(partition):
    async with served(partition) as (_gw, client, _bus):
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model=MODEL, input="hi", max_output_tokens=10_000_000)
        assert err.value.body["param"] == "max_output_tokens"
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model=MODEL, input=[{"type": "message", "role": "robot", "content": "x"}])
        assert err.value.body["param"] == "input[0].role"
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model=MODEL, input="x" * 300_000)
        assert (err.value.body["code"], err.value.body["param"]) == ("context_length_exceeded", "input")
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model=MODEL, input=[], extra_body={"prompt_cache_key": "a\x01b"})
        assert err.value.body["param"] == "prompt_cache_key"


async def test_a_branch_header_wins_over_prompt_cache_key(partition):
    async with served(partition) as (_gw, client, bus):
        r = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2, prompt_cache_key="pck",
                                          extra_headers={"x-branch-id": "agent-7"})
        assert r.status == "completed"
        [sub] = [e for e in await _events(bus) if isinstance(e, RequestSubmitted)]
        assert sub.branch == "agent-7"


async def test_a_responses_stream_whose_client_leaves_stops_the_engine(partition, capfd):
    """The route shares the serving path's cancellation: a client that leaves
    mid-stream makes the gateway publish RequestCancelled and the real sim engine stop."""
    from tests.integration.test_gateway_cancel import LONG, _engine_stopped, stack

    body = {"model": MODEL, "input": "y" * 300, "max_output_tokens": LONG, "stream": True}
    async with stack(partition) as (bus, tokens, gw, url), aiohttp.ClientSession() as http:
        r = await http.post(f"{url}/v1/responses", json=body)
        assert r.status == 200
        rid = r.headers["x-request-id"]
        sub = await tokens.subscribe(rid)
        deltas = 0
        async for line in r.content:
            deltas += line.startswith(b"event: response.output_text.delta")
            if deltas >= 2:
                break
        r.close()  # the client leaves
        cancel, fin = await _engine_stopped(bus, rid, sub)
        assert cancel.reason == "client_disconnected" and fin.error == "cancelled"
        assert fin.ts - cancel.ts <= 1.0 and 1 <= fin.output_tokens < LONG
        assert gw.in_flight == 0 and len(gw.responses_store) == 0  # an unfinished response is not stored
    assert "Traceback" not in capfd.readouterr().err


async def test_an_engine_that_goes_silent_mid_stream_ends_it_with_response_failed(partition):
    from tests.integration.test_gateway_app import gateway

    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition), {"stall": {"stuck"}}, token_timeout_s=0.3) as (gw, http):
        client = openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="none", max_retries=0)
        stream = await client.responses.create(model=MODEL, input="hi", max_output_tokens=8, stream=True,
                                               extra_headers={"x-branch-id": "stuck"})
        events = [ev async for ev in stream]
        assert [ev.type for ev in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
        assert events[-2].code == "timeout" and "no tokens" in events[-2].message
        failed = events[-1].response
        assert failed.status == "failed" and failed.error.code == "server_error"
        assert [ev.sequence_number for ev in events] == list(range(len(events)))
        assert len(gw.responses_store) == 0
        assert gw.metrics.get("ei_gateway_errors_total", status="504", code="timeout") == 1


async def test_a_headerless_previous_response_id_chain_is_one_branch(partition):
    """No header, no prompt_cache_key: the turns chained by previous_response_id render as one
    growing conversation, so the headerless rule (conversations.py) keeps them on one branch."""
    async with served(partition) as (_gw, client, bus):
        r = await client.responses.create(model=MODEL, instructions="Be brief.", input="one", max_output_tokens=3)
        for text in ("two", "three"):
            r = await client.responses.create(model=MODEL, instructions="Be brief.", input=text,
                                              previous_response_id=r.id, max_output_tokens=3)
        evs = await _events(bus)
        subs = [e for e in evs if isinstance(e, RequestSubmitted)]
        assert len(subs) == 3 and len({s.branch for s in subs}) == 1 and subs[0].branch.startswith("gw-")
        assert [s.version for s in subs] == [0, 0, 0]  # each prompt extends the one before
        assert [type(e).__name__ for e in evs if isinstance(e, (BranchOpened, BranchEnded))] == ["BranchOpened"]
