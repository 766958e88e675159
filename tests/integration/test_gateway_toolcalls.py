"""Tool calls out of the model through each API, streaming and not, with the
official ``openai`` and ``anthropic`` clients parsing the answers: a fake engine writes a
Hermes-format call (``<tool_call>{...}</tool_call>``) in small deltas, the gateway's parser
(``--tool-call-parser hermes``) turns it into ``tool_calls`` / ``tool_use`` / ``function_call``
(docs/gateway.md, "Tool calls")."""

from __future__ import annotations

import contextlib
import json

import anthropic
import openai
import pytest

from events.catalog import RequestSubmitted, RouteDecided
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens, TokenMsg
from services.drivers.gateway.app import Gateway, GatewayConfig
from tests.integration.gateway_harness import serving

MODEL = "evolving-sim"
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ANSWER = f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>"
PLAIN = "It is sunny in <b>Paris</b>."
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
A_TOOL = {"name": "get_weather", "description": "The weather in a city.",
          "input_schema": TOOL["function"]["parameters"]}
R_TOOL = {"type": "function", **TOOL["function"]}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


async def fake_engine(bus, tokens, chunk_chars: int = 5) -> None:
    """Route every request to n1/n2 and answer ANSWER (a tool call) when the prompt renders tools,
    else PLAIN, in ``chunk_chars`` pieces (a marker split across messages), finish ``stop``."""
    async with bus.consumer(None, start_seq=1, subjects=f"ei.{bus.partition}.agent.>") as c:
        async for d in c:
            ev = d.event
            if not isinstance(ev, RequestSubmitted):
                continue
            await bus.publish(RouteDecided(ts=ev.ts, request=ev.request, prefill_node="n1", decode_node="n2",
                                           policy="fake"))
            text = ANSWER if ev.prompt_tokens > 150 else PLAIN  # the tools block makes the prompt long (220 vs 48)
            parts = [text[i:i + chunk_chars] for i in range(0, len(text), chunk_chars)]
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                await tokens.publish(TokenMsg(request=ev.request, kind="done" if last else "first" if i == 0 else "chunk",
                                              tokens=1, total=i + 1, text=part,
                                              finish_reason="stop" if last else None))


@contextlib.asynccontextmanager
async def served(partition: str, parser: str = "hermes"):
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    gw = Gateway(bus, tokens, GatewayConfig(partition=partition, model=MODEL, tool_call_parser=parser),
                 clock=lambda: 100.0)
    async with serving(gw, fake_engine(bus, tokens)) as http:
        base = str(http.make_url("")).rstrip("/")
        yield (openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0),
               anthropic.AsyncAnthropic(base_url=base, api_key="none", max_retries=0))


# ----------------------------------------------------------------------------- OpenAI chat
async def test_openai_chat_tool_call_non_streaming(partition):
    async with served(partition) as (oai, _):
        r = await oai.chat.completions.create(model=MODEL, messages=ASK, tools=[TOOL], max_tokens=64)
        [choice] = r.choices
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        # tool_choice none, or no tools: the text as the model wrote it
        r = await oai.chat.completions.create(model=MODEL, messages=ASK, tools=[TOOL], tool_choice="none",
                                              max_tokens=64)
        assert r.choices[0].message.content == ANSWER and r.choices[0].finish_reason == "stop"
        assert not r.choices[0].message.tool_calls
        r = await oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64)
        assert r.choices[0].message.content == PLAIN


async def test_openai_chat_tool_call_streaming(partition):
    async with served(partition) as (oai, _):
        stream = await oai.chat.completions.create(model=MODEL, messages=ASK, tools=[TOOL], max_tokens=64,
                                                   stream=True)
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == "Let me check." and "<tool" not in text
        calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
        assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == \
            [(0, "get_weather", {"city": "Paris"})]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # the SDK's own accumulator
        async with oai.chat.completions.stream(model=MODEL, messages=ASK, tools=[TOOL], max_tokens=64) as s:
            final = await s.get_final_completion()
        [call] = final.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and final.choices[0].finish_reason == "tool_calls"


async def test_no_parser_leaves_the_text(partition):
    async with served(partition, parser="none") as (oai, _):
        r = await oai.chat.completions.create(model=MODEL, messages=ASK, tools=[TOOL], max_tokens=64)
        assert r.choices[0].message.content == ANSWER and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("parser", ["bogus"])
def test_an_unknown_parser_is_refused(partition, parser):
    with pytest.raises(ValueError, match="tool_call_parser"):
        Gateway(InMemoryBus(partition), MemoryTokens(partition), GatewayConfig(partition=partition,
                                                                               tool_call_parser=parser))


def test_auto_reads_the_parser_from_the_chat_template(partition):
    from services.drivers.gateway.chat_template import JinjaTemplate
    from services.drivers.gateway.model import PromptModel, simple
    from services.drivers.gateway.tokenizer import ByteTokenizer

    def gw(model, parser="auto"):
        return Gateway(InMemoryBus(partition), MemoryTokens(partition),
                       GatewayConfig(partition=partition, tool_call_parser=parser), model=model)

    qwen = PromptModel(ByteTokenizer(), JinjaTemplate("{{ messages[0].content }}<tool_call>\n</tool_call>"), "qwen")
    assert gw(qwen).tool_parser == "hermes"
    assert gw(qwen, "mistral").tool_parser == "mistral"  # the option wins
    assert gw(simple()).tool_parser == "none"  # the simple template asks for no format


# ----------------------------------------------------------------------------- Anthropic messages
async def test_anthropic_tool_use_non_streaming(partition):
    async with served(partition) as (_, ant):
        m = await ant.messages.create(model=MODEL, messages=ASK, tools=[A_TOOL], max_tokens=64)
        assert m.stop_reason == "tool_use"
        assert [b.type for b in m.content] == ["text", "tool_use"]
        assert m.content[0].text == "Let me check."
        use = m.content[1]
        assert use.id.startswith("toolu_") and (use.name, use.input) == ("get_weather", {"city": "Paris"})
        m = await ant.messages.create(model=MODEL, messages=ASK, tools=[A_TOOL], tool_choice={"type": "none"},
                                      max_tokens=64)
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == ANSWER and m.stop_reason == "end_turn"


async def test_anthropic_tool_use_streaming(partition):
    async with served(partition) as (_, ant):
        stream = await ant.messages.create(model=MODEL, messages=ASK, tools=[A_TOOL], max_tokens=64, stream=True)
        events = [ev async for ev in stream]
        kinds = [ev.type for ev in events]
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        starts = [ev for ev in events if ev.type == "content_block_start"]
        assert [(ev.index, ev.content_block.type) for ev in starts] == [(0, "text"), (1, "tool_use")]
        assert [ev.index for ev in events if ev.type == "content_block_stop"] == [0, 1]
        text = "".join(ev.delta.text for ev in events if ev.type == "content_block_delta" and ev.delta.type == "text_delta")
        assert text == "Let me check."
        args = "".join(ev.delta.partial_json for ev in events
                       if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta")
        assert json.loads(args) == {"city": "Paris"} and starts[1].content_block.name == "get_weather"
        assert events[-2].delta.stop_reason == "tool_use"
        # the SDK's own accumulator
        async with ant.messages.stream(model=MODEL, messages=ASK, tools=[A_TOOL], max_tokens=64) as s:
            final = await s.get_final_message()
        assert [b.type for b in final.content] == ["text", "tool_use"] and final.stop_reason == "tool_use"
        assert final.content[1].input == {"city": "Paris"}
        # without tools: the old sequence, one text block
        async with ant.messages.stream(model=MODEL, messages=ASK, max_tokens=64) as s:
            final = await s.get_final_message()
        assert [b.type for b in final.content] == ["text"] and final.content[0].text == PLAIN


# ----------------------------------------------------------------------------- Responses
async def test_responses_function_call_non_streaming(partition):
    async with served(partition) as (oai, _):
        r = await oai.responses.create(model=MODEL, input="Weather in Paris?", tools=[R_TOOL], max_output_tokens=64)
        assert r.status == "completed"
        assert [it.type for it in r.output] == ["message", "function_call"]
        assert r.output_text == "Let me check."
        fc = r.output[1]
        assert fc.call_id.startswith("call_") and fc.id.startswith("fc_") and fc.status == "completed"
        assert (fc.name, json.loads(fc.arguments)) == ("get_weather", {"city": "Paris"})
        # the call is in the stored history: a follow-up gives its output
        r2 = await oai.responses.create(model=MODEL, previous_response_id=r.id, max_output_tokens=64,
                                        input=[{"type": "function_call_output", "call_id": fc.call_id,
                                                "output": "sunny"}])
        assert r2.status == "completed"
        r = await oai.responses.create(model=MODEL, input="Weather?", tools=[R_TOOL], tool_choice="none",
                                       max_output_tokens=64)
        assert [it.type for it in r.output] == ["message"] and r.output_text == ANSWER


async def test_responses_function_call_streaming(partition):
    async with served(partition) as (oai, _):
        stream = await oai.responses.create(model=MODEL, input="Weather in Paris?", tools=[R_TOOL],
                                            max_output_tokens=64, stream=True)
        events = [ev async for ev in stream]
        assert [ev.sequence_number for ev in events] == list(range(len(events)))
        kinds = [ev.type for ev in events]
        i = kinds.index("response.function_call_arguments.delta")
        assert kinds[i - 1:i + 3] == ["response.output_item.added", "response.function_call_arguments.delta",
                                      "response.function_call_arguments.done", "response.output_item.done"]
        assert events[i - 1].output_index == 1 and events[i - 1].item.type == "function_call"
        assert json.loads(events[i + 1].arguments) == {"city": "Paris"}
        assert "".join(ev.delta for ev in events if ev.type == "response.output_text.delta") == "Let me check."
        final = events[-1].response
        assert kinds[-1] == "response.completed" and [it.type for it in final.output] == ["message", "function_call"]
        # the SDK's own accumulator
        async with oai.responses.stream(model=MODEL, input="Weather?", tools=[R_TOOL], max_output_tokens=64) as s:
            final = await s.get_final_response()
        assert [it.type for it in final.output] == ["message", "function_call"]
        assert final.output[1].name == "get_weather"


# ----------------------------------------------------------------------------- sessions without headers
async def _branches(bus) -> list[str]:
    head, out = await bus.last_seq(), []
    async with bus.consumer(None, start_seq=1) as c:
        async for d in c:
            if isinstance(d.event, RequestSubmitted):
                out.append(d.event.branch)
            if d.seq >= head:
                break
    return out


@contextlib.asynccontextmanager
async def served_bus(partition: str):
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    gw = Gateway(bus, tokens, GatewayConfig(partition=partition, model=MODEL, tool_call_parser="hermes"),
                 clock=lambda: 100.0)
    async with serving(gw, fake_engine(bus, tokens)) as http:
        base = str(http.make_url("")).rstrip("/")
        yield (bus, openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0),
               anthropic.AsyncAnthropic(base_url=base, api_key="none", max_retries=0))


async def test_a_headerless_tool_round_trip_stays_on_its_branch(partition):
    """The reply remembered for the conversation's hash chain is the one the client sends back:
    its text and its tool calls (OpenAI: the call as answered; Anthropic: the tool_use block).
    A second conversation opened with the same question holds the one-message prefix, so only
    the remembered reply tells the two apart."""
    async with served_bus(partition) as (bus, oai, ant):
        r = await oai.chat.completions.create(model=MODEL, messages=ASK, tools=[TOOL], max_tokens=64)
        await oai.chat.completions.create(model=MODEL, messages=ASK, tools=[TOOL], max_tokens=64)  # another one
        msg = r.choices[0].message
        back = [*ASK, msg.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"}]
        await oai.chat.completions.create(model=MODEL, messages=back, tools=[TOOL], max_tokens=64)
        m = await ant.messages.create(model=MODEL, messages=ASK, tools=[A_TOOL], max_tokens=64)
        await ant.messages.create(model=MODEL, messages=ASK, tools=[A_TOOL], max_tokens=64)
        use = m.content[1]
        back = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
        await ant.messages.create(model=MODEL, messages=back, tools=[A_TOOL], max_tokens=64)
        b = await _branches(bus)
        assert len(set(b)) == 4 and b[2] == b[0] and b[5] == b[3], b
