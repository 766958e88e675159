"""The Responses API's pure parts (services/drivers/gateway/responses_api.py): parsing and the
mapping onto chat messages, the output builder and its events (checked against the OpenAPI
document's Structs), and the bounded store behind ``previous_response_id``."""

from __future__ import annotations

import json

import msgspec
import pytest

from services.drivers.gateway import openapi, responses_api
from services.drivers.gateway.api import ApiError, context_error
from services.drivers.gateway.responses_api import ResponseBuilder, ResponseStore, parse_responses


def _parse(body: dict) -> responses_api.Parsed:
    return parse_responses(json.dumps(body).encode())


def test_a_string_input_is_one_user_message():
    p = _parse({"model": "m", "input": "hi", "instructions": "be brief"})
    assert p.messages == [{"role": "user", "content": "hi"}]
    assert responses_api.prompt_messages(p, []) == [{"role": "system", "content": "be brief"},
                                                    {"role": "user", "content": "hi"}]
    assert p.ignored == [] and p.unapplied == [] and p.tools is None


def test_items_map_onto_chat_messages():
    p = _parse({"input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "look"},
                                                        {"type": "input_image", "image_url": "data:"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "cat", "arguments": '{"f":"a"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "a b"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "A"}]},
        {"type": "reasoning", "id": "rs", "summary": [], "encrypted_content": "x"},
        {"type": "item_reference", "id": "msg_1"},
        {"type": "function_call", "call_id": "c3", "name": "ls", "arguments": "{}"},
    ]})
    calls = [{"id": c, "type": "function", "function": {"name": n, "arguments": a}}
             for c, n, a in (("c1", "ls", "{}"), ("c2", "cat", '{"f":"a"}'))]
    assert p.messages == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "input_image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}], "tool_calls": calls},
        {"role": "tool", "content": "a b", "tool_call_id": "c1"},
        {"role": "tool", "content": [{"type": "text", "text": "A"}], "tool_call_id": "c2"},
        {"role": "assistant", "content": [], "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
    ]
    assert responses_api.ignored_names(p.ignored) == ["input[].type: reasoning", "input[].type: item_reference"]


def test_unknown_fields_and_tool_types_are_accepted_and_counted():
    p = _parse({"input": "x", "reasoning": {"effort": "high"}, "include": ["reasoning.encrypted_content"],
                "parallel_tool_calls": True, "client_metadata": {"a": 1}, "future_field": [1],
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True},
                          {"type": "web_search"}, {"type": "namespace", "name": "ns", "tools": []}],
                "tool_choice": "required", "temperature": 0.5, "text": {"format": {"type": "json_schema"}}})
    assert p.tools == [{"name": "f", "parameters": {"type": "object"}}]
    names = responses_api.ignored_names(p.ignored)
    assert set(names) == {"future_field", "reasoning", "include", "parallel_tool_calls", "client_metadata",
                          "tools[].type: web_search"}  # text.format is honoured; an empty namespace renders nothing
    assert p.unapplied == []  # temperature reaches the engine; tool_choice and text.format constrain it
    hosted = _parse({"input": "x", "tool_choice": {"type": "web_search_preview"}})
    assert hosted.unapplied == ["tool_choice"]  # a hosted tool's choice forces nothing here


@pytest.mark.parametrize(("body", "param"), [
    ({"input": 3}, "input"),
    ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "message", "role": "user"}]}, "input[0].content"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]}, "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": [{"text": "x"}]}]}, "input[0].content[0].type"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"name": "f"}]}, "tools[0].type"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "stream": "yes"}, "stream"),
    ({"input": "x", "prompt_cache_key": ""}, "prompt_cache_key"),
    ({"input": "x", "prompt_cache_key": "k" * 257}, "prompt_cache_key"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
])
def test_a_known_field_of_the_wrong_shape_is_a_400_naming_it(body, param):
    with pytest.raises(ApiError) as err:
        _parse(body)
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_nothing_to_respond_to_is_a_400():
    with pytest.raises(ApiError) as err:
        responses_api.prompt_messages(_parse({"input": []}), [])
    assert err.value.param == "input"


def test_budget_errors_use_this_apis_names():
    err = responses_api.renamed(ApiError(400, "'max_tokens' must be an integer in [0, 5], got 9", "max_tokens"))
    assert (err.param, err.message) == ("max_output_tokens", "'max_output_tokens' must be an integer in [0, 5], got 9")
    err = responses_api.renamed(context_error(100, 90, 20, "messages"))
    assert err.param == "input" and "in the input" in err.message and err.code == "context_length_exceeded"


EXT = {"request": "b/1", "branch": "b", "version": 0, "prompt_blocks": 1, "simulated": True}


def _builder(**req) -> ResponseBuilder:
    return ResponseBuilder("resp_1", 7, "m", _parse({"input": "x", **req}).req, EXT)


def _events(raw: bytes) -> list[dict]:
    out = []
    for frame in raw.decode().strip().split("\n\n"):
        kind, data = frame.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        ev = json.loads(data[6:])
        assert ev["type"] == kind[7:]
        out.append(ev)
    return out


def test_the_event_sequence_fits_the_documented_structs():
    b = _builder(tools=[{"type": "web_search"}], tool_choice={"type": "function", "name": "f"})
    raw = b.start() + b.open_message() + b.text_delta("Hel") + b.text_delta("") + b.text_delta("lo")
    raw += b.close_message("completed")
    raw += b.add_item({"id": "fc_1", "type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
                       "status": "completed"})
    body = b.body("completed", responses_api.usage(10, 4, 2))
    raw += b.finish(body)
    events = _events(raw)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        msgspec.convert(e, openapi.ResponsesStreamEvent)  # forbid_unknown_fields: exact shapes
    msgspec.convert(body, openapi.ResponseObject)
    assert [it["type"] for it in body["output"]] == ["message", "function_call"]
    assert body["output"][0]["content"][0]["text"] == "Hello"
    assert body["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                             "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}
    # the output, as the history a previous_response_id continues
    assert responses_api.output_messages(body["output"]) == [
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}],
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


def test_a_failure_is_an_error_event_then_response_failed():
    b = _builder()
    events = _events(b.start() + b.open_message() + b.failed(ApiError(504, "no tokens", None, "timeout")))
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "no tokens"}
    for e in events:
        msgspec.convert(e, openapi.ResponsesStreamEvent)


def test_incomplete_and_non_streaming_bodies_fit():
    b = _builder(max_output_tokens=3, store=False)
    b.add_message("tok tok tok ", "incomplete")
    body = b.body(responses_api.status_of("length"), responses_api.usage(5, 0, 3))
    msgspec.convert(body, openapi.ResponseObject)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["store"] is False and responses_api.status_of("stop") == "completed"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_store_drops_the_least_recently_used_past_max_entries():
    s = ResponseStore(max_entries=2, ttl_s=100)
    for rid in ("a", "b"):
        s.put(rid, {"id": rid}, [])
    assert s.get("a") is not None  # a is now the most recently used
    s.put("c", {"id": "c"}, [])
    assert s.get("b") is None and s.get("a") is not None and s.get("c") is not None
    assert len(s) == 2 and s.evicted == 1


def test_the_store_forgets_after_its_ttl():
    clock = Clock()
    s = ResponseStore(ttl_s=10, clock=clock)
    s.put("a", {"id": "a"}, [{"role": "user", "content": "x"}])
    clock.t = 9.9
    assert s.get("a").history == [{"role": "user", "content": "x"}]
    clock.t = 10.0
    assert s.get("a") is None and len(s) == 0 and s.bytes == 0


def test_the_store_is_bounded_in_bytes():
    s = ResponseStore(max_bytes=1000, ttl_s=100)
    assert not s.put("huge", {"id": "x" * 2000}, [])  # alone over the bound: not kept
    for i in range(5):
        assert s.put(f"r{i}", {"id": "y" * 300}, [])
    assert s.bytes <= 1000 and len(s) == 3 and s.get("r4") is not None and s.get("r0") is None
    s.put("r4", {"id": "z"}, [])  # replacing an entry recounts its size
    assert s.bytes == sum(st.size for st in s._items.values())


# ----------------------------------------------------------------------------- namespace tools (Codex)
SPAWN = {"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent.",
         "parameters": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}}
WAIT = {"type": "function", "name": "wait_agent", "parameters": {"type": "object", "properties": {}}}
#: Codex 0.171 with model = "gpt-5-codex": its sub-agent tools in a namespace tool of ``tools``
NS_TOOLS = [{"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
            {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.",
             "tools": [SPAWN, WAIT]},
            {"type": "web_search", "external_web_access": False}]
#: Codex 0.171 with its default model: the tools in an ``additional_tools`` input item, the
#: sub-agent tools in the namespace ``collaboration``; ``functions`` holds its code tool's nested tools
ADDITIONAL = {"type": "additional_tools", "role": "developer", "tools": [
    {"type": "namespace", "name": "functions", "tools": [
        {"type": "custom", "name": "exec", "format": {"type": "grammar"}}, {**WAIT, "name": "wait"}]},
    {"type": "namespace", "name": "collaboration", "tools": [SPAWN, WAIT]}]}


def test_a_namespaces_function_tools_are_rendered_under_codexs_flat_names():
    p = _parse({"input": "hi", "tools": NS_TOOLS})
    assert [t["name"] for t in p.tools] == ["exec_command", "multi_agent_v1__spawn_agent", "multi_agent_v1__wait_agent"]
    assert p.tools[1]["parameters"] == SPAWN["parameters"] and p.tools[1]["description"] == "Spawn a sub-agent."
    assert p.namespaced == {"multi_agent_v1__spawn_agent": ("multi_agent_v1", "spawn_agent"),
                            "multi_agent_v1__wait_agent": ("multi_agent_v1", "wait_agent")}
    assert p.unserved == ["web_search"]
    assert responses_api.flat_name("ns_", "_f") == "ns__f"  # Codex trims the underscores at the seam


def test_additional_tools_items_are_tools_and_the_code_only_namespace_is_left_out():
    p = _parse({"input": [ADDITIONAL, {"role": "user", "content": "spawn an agent"}]})
    assert [t["name"] for t in p.tools] == ["collaboration__spawn_agent", "collaboration__wait_agent"]
    assert p.messages == [{"role": "user", "content": "spawn an agent"}]  # the item is no message
    assert p.unserved == ["namespace:functions"]
    with pytest.raises(ApiError) as e:
        _parse({"input": [{"type": "additional_tools", "tools": "x"}]})
    assert e.value.param == "input[0].tools"
    with pytest.raises(ApiError) as e:
        _parse({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [{"name": "f"}]}]})
    assert e.value.param == "tools[0].tools[0].type"


def test_a_call_of_a_namespaced_tool_is_a_function_call_naming_its_namespace():
    from services.drivers.gateway.toolcalls import ToolCall

    p = _parse({"input": "hi", "tools": NS_TOOLS})
    b = ResponseBuilder("resp_1", 7, "m", p.req, EXT, namespaced=p.namespaced)
    spawn = b.call_item(ToolCall("call_1", "multi_agent_v1__spawn_agent", '{"message": "say hi"}'))
    plain = b.call_item(ToolCall("call_2", "exec_command", "{}"))
    assert (spawn["namespace"], spawn["name"], spawn["arguments"]) == ("multi_agent_v1", "spawn_agent",
                                                                      '{"message": "say hi"}')
    assert "namespace" not in plain and plain["name"] == "exec_command"
    msgspec.convert(spawn, openapi.OutputFunctionCall)
    # sent back as input (Codex's next turn), it renders under the same flat name again
    back = _parse({"input": [{"role": "user", "content": "hi"}, {k: v for k, v in spawn.items() if k != "status"},
                             {"type": "function_call_output", "call_id": "call_1", "output": "{}"}], "tools": NS_TOOLS})
    assert back.messages[1]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"
    assert responses_api.output_messages([spawn]) == back.messages[1:2]


def test_a_named_tool_choice_in_a_namespace_forces_that_tool():
    from services.drivers.gateway import constraints

    p = _parse({"input": "hi", "tools": NS_TOOLS,
                "tool_choice": {"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"}})
    s = constraints.for_responses(p.req, p.tools, "hermes")
    assert s is not None and json.loads(s.constraint.json_schema)["properties"]["name"] == {"const": "multi_agent_v1__spawn_agent"}


def test_an_agent_message_is_the_sub_agents_task():
    p = _parse({"input": [{"type": "agent_message", "author": "/root", "recipient": "/root/say_hi", "content": [
        {"type": "input_text", "text": "Message Type: NEW_TASK\nPayload:\n"},
        {"type": "encrypted_content", "encrypted_content": "say hi"}]}]})
    assert p.messages == [{"role": "user", "content": [{"type": "text", "text": "Message Type: NEW_TASK\nPayload:\n"},
                                                       {"type": "text", "text": "say hi"}]}]
    assert p.ignored == []
