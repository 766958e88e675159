"""The Anthropic Messages API layer (services/drivers/gateway/anthropic_api.py): parsing, the
mapping onto the chat template, the response body, the SSE event sequence and the error shape."""

from __future__ import annotations

import json

import pytest

from services.drivers.gateway import anthropic_api as aa
from services.drivers.gateway.api import ApiError, chat_tools, parse_chat, sampling_fields, unapplied
from services.drivers.gateway.auth import ApiKeys
from services.drivers.gateway.tokenizer import GENERATION_PROMPT, render_chat

TOOL = {"name": "get_weather", "description": "The weather.", "input_schema": {"type": "object"}}


def body(**kw) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **kw}).encode()


def err(raw: bytes, fn=aa.parse_messages) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(raw)
    return e.value


def test_minimal_request_and_defaults():
    r = aa.parse_messages(body())
    assert (r.model, r.max_tokens, r.stream, r.system, r.tools) == ("m", 8, False, None, None)
    assert aa.render_prompt(r) == "<|user|>\nhi<|end|>\n" + GENERATION_PROMPT
    assert aa.unapplied(r) == []


@pytest.mark.parametrize("raw, param, code", [
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}', "max_tokens", "missing_required_parameter"),
    (b'{"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}', "model", "missing_required_parameter"),
    (b'{"model": "m", "max_tokens": 1, "messages": []}', "messages", "invalid_value"),
    (body(temperature=1.5), "temperature", "invalid_value"),
    (body(top_k=-1), "top_k", "invalid_value"),
    (body(stream="yes"), "stream", "invalid_type"),
    (body(messages=[{"role": "user", "content": [{"type": "hologram"}]}]), "messages[0].content[0].type",
     "invalid_value"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]), "messages[0].content[0].tool_use_id",
     "missing_required_parameter"),
    (body(tools=[{"name": "x"}]), "tools[0].input_schema", "missing_required_parameter"),
    (body(tool_choice={"type": "tool"}), "tool_choice.name", "missing_required_parameter"),
    (body(tool_choice={"type": "sometimes"}), "tool_choice.type", "invalid_value"),
])
def test_bad_requests_are_400s_naming_the_field(raw, param, code):
    e = err(raw)
    assert (e.status, e.param, e.code) == (400, param, code), e.message


def test_a_bad_role_names_anthropics_roles():
    e = err(body(messages=[{"role": "developer", "content": "x"}]))
    assert e.param == "messages[0].role" and "'user', 'assistant' or 'system'" in e.message
    assert "function" not in e.message  # not OpenAI's roles


def test_system_messages_fold_into_the_system_prompt_in_order():
    """Claude Code sends ``role: "system"`` inside ``messages``: each is an instruction, joined
    after the top-level ``system`` in order; the conversation renders without them."""
    r = aa.parse_messages(body(system=[{"type": "text", "text": "top"}], messages=[
        {"role": "system", "content": "first"}, {"role": "user", "content": "q"},
        {"role": "system", "content": [{"type": "text", "text": "second", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]))
    assert aa.system_prompt(r) == "top\n\nfirst\n\nsecond"
    assert [m["role"] for m in aa.chat_messages(r)] == ["system", "user", "assistant", "user"]
    assert aa.render_prompt(r) == ("<|system|>\ntop\n\nfirst\n\nsecond<|end|>\n<|user|>\nq<|end|>\n"
                                   "<|assistant|>\na<|end|>\n<|user|>\nq2<|end|>\n" + GENERATION_PROMPT)
    # a system message after the last assistant turn does not hide the prefill
    pre = aa.parse_messages(body(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "The"},
                                           {"role": "system", "content": "s"}]))
    assert aa.render_prompt(pre).endswith("<|assistant|>\nThe")


def test_unknown_fields_are_ignored_and_named():
    """Every top-level field Claude Code sends that is not ours is dropped (never a 400) and
    named, for the app to count; the known ones keep their checks."""
    ignored: list[str] = []
    r = aa.parse_messages(body(context_management={"edits": [{"type": "clear_tool_uses_20250919"}]},
                               output_config={"effort": "high"}, frobnicate=1), ignored)
    assert ignored == ["context_management", "frobnicate", "output_config"] and r.max_tokens == 8
    assert err(body(context_management={}, temperature=3)).param == "temperature"


def test_system_tools_tool_use_and_tool_result_render_through_the_chat_template():
    r = aa.parse_messages(body(
        system=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}], tools=[TOOL],
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "checking", "citations": None},  # extra fields: ignored
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"b": 1, "a": "x"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "boom"}, {"type": "image", "source": {}}]},
                {"type": "text", "text": "and "}, {"type": "image", "source": {"type": "base64"}}]},
        ]))
    assert aa.render_prompt(r) == (
        '<|tools|>\n[{"description":"The weather.","name":"get_weather","parameters":{"type":"object"}}]<|end|>\n'
        "<|system|>\nbe brief<|end|>\n"
        "<|user|>\nweather?<|end|>\n"
        '<|assistant|>\nchecking[{"function":{"arguments":"{\\"a\\":\\"x\\",\\"b\\":1}","name":"get_weather"},'
        '"id":"toolu_1","type":"function"}]<|end|>\n'
        "<|tool:toolu_1|>\n18 C<|end|>\n"
        "<|tool:toolu_2|>\n[error]boom[image]<|end|>\n"
        "<|user|>\nand [image]<|end|>\n" + GENERATION_PROMPT)


def test_the_same_tools_render_the_same_on_both_apis():
    a = aa.parse_messages(body(system="S", tools=[TOOL]))
    o, obj = parse_chat(json.dumps({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
                                    "tools": [{"type": "function", "function": {
                                        "name": TOOL["name"], "description": TOOL["description"],
                                        "parameters": TOOL["input_schema"]}}]}).encode())
    assert aa.render_prompt(a) == render_chat(obj["messages"], chat_tools(o))


def test_next_turn_prompt_extends_this_one():
    turn1 = [{"role": "user", "content": "q"}]
    turn2 = turn1 + [{"role": "assistant", "content": [{"type": "text", "text": "a"},
                                                       {"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]}]
    p1 = aa.render_prompt(aa.parse_messages(body(tools=[TOOL], messages=turn1)))
    p2 = aa.render_prompt(aa.parse_messages(body(tools=[TOOL], messages=turn2)))
    assert p2.startswith(p1) and len(p2) > len(p1)


def test_a_last_assistant_message_is_a_prefill():
    r = aa.parse_messages(body(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "The"}]))
    assert aa.render_prompt(r) == "<|user|>\nq<|end|>\n<|assistant|>\nThe"
    only = aa.parse_messages(body(messages=[{"role": "assistant", "content": "The"}]))
    assert aa.render_prompt(only) == "<|assistant|>\nThe"


def test_count_tokens_takes_no_max_tokens_and_renders_the_same():
    r = aa.parse_count_tokens(b'{"model": "m", "system": "s", "messages": [{"role": "user", "content": "hi"}]}')
    assert aa.render_prompt(r) == aa.render_prompt(aa.parse_messages(body(system="s")))
    ignored: list[str] = []
    aa.parse_count_tokens(body(), ignored)
    assert ignored == ["max_tokens"]  # not a field there: ignored


def test_unapplied_parameters():
    r = aa.parse_messages(body(temperature=0.5, top_p=0.9, top_k=5, stop_sequences=["x"],
                               tool_choice={"type": "any"}, thinking={"type": "enabled", "budget_tokens": 1024},
                               metadata={"user_id": "u"}, tools=[TOOL]))
    assert aa.unapplied(r) == ["thinking"]  # the sampling parameters reach the engine, tool_choice constrains it
    assert sampling_fields(aa.budget_request(r)) == {"ignore_eos": False, "temperature": 0.5, "top_p": 0.9,
                                                     "top_k": 5, "stop": ["x"]}
    neutral = aa.parse_messages(body(tool_choice={"type": "auto"}, thinking={"type": "disabled"}))
    assert aa.unapplied(neutral) == []


def test_budget_request_carries_max_tokens_and_stream():
    c = aa.budget_request(aa.parse_messages(body(max_tokens=3, stream=True, system="s")))
    assert (c.max_tokens, c.stream, c.stream_options, c.min_tokens) == (3, True, None, None)
    assert [m.role for m in c.messages] == ["system", "user"]


@pytest.mark.parametrize("finish, reason", [("length", "max_tokens"), ("stop", "end_turn"), ("", "max_tokens"),
                                            (None, "max_tokens"), ("eos", "end_turn"), ("tool_calls", "tool_use"),
                                            ("abort", "end_turn")])
def test_stop_reason(finish, reason):
    assert aa.stop_reason(finish) == reason


REPLY = aa.Reply("msg_1", "m", prompt_tokens=100, cache_read=64, extension={"simulated": True})


def test_full_message_body_and_usage():
    m = REPLY.message("tok tok ", 2, "length")
    assert m == {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                 "content": [{"type": "text", "text": "tok tok "}], "stop_reason": "max_tokens", "stop_sequence": None,
                 "usage": {"input_tokens": 36, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 64,
                           "output_tokens": 2}, "evolving": {"simulated": True}}
    assert aa.Reply("x", "m", 10, 50, {}).usage(1)["cache_read_input_tokens"] == 10  # never over the prompt


def _events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for frame in raw.decode().split("\n\n"):
        if frame:
            ev, data = frame.split("\n")
            out.append((ev.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_sse_event_sequence():
    b = aa.Blocks()
    raw = REPLY.start(1, b) + b.text("tok ") + b.text("") + b.text("tok ") + b.end() + REPLY.end(2, "length") \
        + REPLY.stop()
    evs = _events(raw)
    assert [e for e, _ in evs] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                   "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert all(d["type"] == e for e, d in evs)
    start = evs[0][1]["message"]
    assert (start["content"], start["stop_reason"], start["usage"]["output_tokens"]) == ([], None, 1)
    assert evs[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert evs[3][1] == {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "tok "}}
    assert evs[5][1] == {"type": "content_block_stop", "index": 0}
    assert evs[6][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert evs[6][1]["usage"]["output_tokens"] == 2 and evs[6][1]["usage"]["cache_read_input_tokens"] == 64


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                          (404, "not_found_error"), (405, "invalid_request_error"),
                                          (409, "invalid_request_error"), (413, "request_too_large"),
                                          (500, "api_error"), (502, "api_error"), (503, "overloaded_error"),
                                          (504, "api_error")])
def test_error_shape(status, kind):
    e = ApiError(status, "what went wrong")
    assert aa.error_body(e) == {"type": "error", "error": {"type": kind, "message": "what went wrong"}}
    assert _events(aa.error_event(e)) == [("error", aa.error_body(e))]


def test_x_api_key_is_an_api_key():
    keys = ApiKeys(frozenset({"sk-abcdefgh"}))
    keys.check(None, "sk-abcdefgh")
    keys.check("Bearer sk-abcdefgh")
    for auth, x in [(None, "sk-wrong-one"), ("Bearer sk-abcdefgh", "sk-wrong-one"), (None, ""), (None, None)]:
        with pytest.raises(ApiError) as e:
            keys.check(auth, x)
        assert e.value.status == 401


def test_openai_tools_are_accepted_and_a_forcing_tool_choice_is_applied():
    base = {"messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    r, _ = parse_chat(json.dumps(base).encode())
    assert chat_tools(r) == [{"name": "f", "parameters": {"type": "object"}}] and unapplied(r) == []
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        r, _ = parse_chat(json.dumps({**base, "tool_choice": choice}).encode())
        assert unapplied(r) == []  # the engine's output is constrained to a call (constraints.py)
    for bad, param in [({"tools": [{"type": "function"}]}, "tools[0].function"),
                       ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
                       ({"tool_choice": "sometimes"}, "tool_choice")]:
        with pytest.raises(ApiError) as e:
            parse_chat(json.dumps({**base, **bad}).encode())
        assert (e.value.status, e.value.param) == (400, param)


# ----------------------------------------------------------------------------- Anthropic-defined tools
CLIENT = [{"type": "bash_20250124", "name": "bash"},
          {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool", "max_characters": 10000},
          {"type": "text_editor_20250124", "name": "str_replace_editor"},
          {"type": "computer_20250124", "name": "computer", "display_width_px": 1024, "display_height_px": 768},
          {"type": "computer_20241022", "name": "computer"},
          {"type": "memory_20250818", "name": "memory"}]
SERVER = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
          {"type": "web_fetch_20250910", "name": "web_fetch"},
          {"type": "code_execution_20250825", "name": "code_execution"},
          {"type": "hologram_20990101", "name": "h"}]


def test_anthropic_defined_client_tools_render_with_their_documented_schemas():
    unserved: list[str] = []
    r = aa.parse_messages(body(tools=CLIENT), [], unserved)
    assert unserved == []
    defs = {d["name"]: d["parameters"] for d in aa.tool_defs(r)}
    assert [d["name"] for d in aa.tool_defs(r)] == [t["name"] for t in CLIENT]
    assert set(defs["bash"]["properties"]) == {"command", "restart"}
    edit = defs["str_replace_based_edit_tool"]
    assert edit["required"] == ["command", "path"]
    assert edit["properties"]["command"]["enum"] == ["view", "create", "str_replace", "insert"]  # no undo_edit
    assert "undo_edit" in defs["str_replace_editor"]["properties"]["command"]["enum"]  # the 2025-01 editor's
    by_type = dict(zip([t["type"] for t in CLIENT], aa.tool_defs(r), strict=True))
    assert "scroll" in by_type["computer_20250124"]["parameters"]["properties"]["action"]["enum"]
    assert "scroll" not in by_type["computer_20241022"]["parameters"]["properties"]["action"]["enum"]
    assert "1024x768" in by_type["computer_20250124"]["description"]
    # rendered into the prompt like any tool: the model sees the name and the input it takes
    prompt = aa.render_prompt(r)
    assert '"name":"str_replace_based_edit_tool"' in prompt and '"old_str"' in prompt


def test_a_client_tool_without_a_name_gets_its_documented_one():
    r = aa.parse_messages(body(tools=[{"type": "text_editor_20241022"}, {"type": "bash_20241022"},
                                      {"type": "bash_20991231"}]))
    assert [d["name"] for d in aa.tool_defs(r)] == ["str_replace_editor", "bash", "bash"]  # a newer bash too


def test_server_tools_are_accepted_left_out_of_the_prompt_and_reported():
    unserved: list[str] = []
    ignored: list[str] = []
    r = aa.parse_messages(body(tools=[*SERVER, {"type": "bash_20250124", "name": "bash"},
                                      {"type": "evil\r\nx-injected: 1" + "z" * 200, "name": "e"}]), ignored, unserved)
    assert [d["name"] for d in aa.tool_defs(r)] == ["bash"]
    assert unserved[:4] == [t["type"] for t in SERVER]
    assert unserved[4] == "evil??x-injected:?1" + "z" * 45 and len(unserved) == 5  # safe in a header, bounded
    assert ignored == []  # the app counts them under their own names (api.unserved_tool_names)
    plain = aa.parse_messages(body(tools=[{"type": "bash_20250124", "name": "bash"}]))
    assert aa.render_prompt(r) == aa.render_prompt(plain)  # nothing of them in the prompt
    only = aa.parse_messages(body(tools=SERVER[:1]))
    assert aa.tool_defs(only) is None and aa.render_prompt(only) == aa.render_prompt(aa.parse_messages(body()))
    # count_tokens parses the same way
    u2: list[str] = []
    aa.parse_count_tokens(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
                          b'"tools": [{"type": "web_fetch_20250910", "name": "web_fetch"}]}', [], u2)
    assert u2 == ["web_fetch_20250910"]
