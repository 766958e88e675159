"""The gateway's constraints (services/drivers/gateway/constraints.py): a forced call in each
tool-call format, which the format's own parser reads back as the call; closed schemas; a JSON
answer from response_format / text.format; and every bad request a 400 naming its field."""

from __future__ import annotations

import importlib.util
import json

import pytest

from engine.backends.sim.instance import constrained_text
from services.drivers.gateway import constraints as cs
from services.drivers.gateway import toolcalls
from services.drivers.gateway.anthropic_api import parse_messages, tool_defs
from services.drivers.gateway.api import ApiError, chat_tools, parse_chat
from services.drivers.gateway.responses_api import parse_responses

jsonschema_rs = pytest.importorskip("jsonschema_rs")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"name": "get_weather", "parameters": WEATHER}, {"name": "ls", "parameters": {"type": "object"}}]


def test_a_hermes_call():
    s = cs.tool_call(TOOLS, "get_weather", "hermes")
    assert (s.parser, s.constraint.prefix, s.constraint.suffix) == ("hermes", "<tool_call>\n", "\n</tool_call>")
    assert json.loads(s.constraint.json_schema) == {
        "type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {**WEATHER,
                                                                                        "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False}


@pytest.mark.parametrize("parser", ["hermes", "mistral", "llama3_json", "none"])
@pytest.mark.parametrize("name", [None, "get_weather", "ls"])
def test_each_format_is_read_back_by_its_parser(parser, name):
    """What the engines write under the constraint (here the sim engine's value) is one call of
    the chosen tool with valid arguments once the request's parser reads it."""
    s = cs.tool_call(TOOLS, name, parser)
    assert s.parser == (parser if parser != "none" else "hermes")
    text = constrained_text(s.constraint.json_schema, s.constraint.prefix, s.constraint.suffix)
    pieces = toolcalls.parse_all(toolcalls.make(s.parser, "x"), [text[i:i + 3] for i in range(0, len(text), 3)])
    assert len(pieces) == 1 and isinstance(pieces[0], toolcalls.ToolCall), (text, pieces)
    call = pieces[0]
    tool = next(t for t in TOOLS if t["name"] == call.name)
    assert name in (None, call.name) and jsonschema_rs.validator_for(tool["parameters"]).is_valid(call.input())
    if name is None:
        assert [b["properties"]["name"]["const"] for b in json.loads(s.constraint.json_schema).get(
            "anyOf", json.loads(s.constraint.json_schema).get("items", {}).get("anyOf", []))] == ["get_weather", "ls"]


def test_closed_schemas():
    open_ = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                              "c": {"type": "array", "items": {"properties": {"d": {}}}}},
             "$defs": {"e": {"properties": {"f": {}}}},
             "allOf": [{"properties": {"g": {}}}]}
    c = cs.closed(open_)
    assert c["additionalProperties"] is False and c["properties"]["a"]["additionalProperties"] is False
    assert c["properties"]["c"]["items"]["additionalProperties"] is False
    assert c["$defs"]["e"]["additionalProperties"] is False
    assert "additionalProperties" not in c["allOf"][0]  # a branch of allOf stays open
    assert cs.closed({"properties": {}, "additionalProperties": True}) == {"properties": {}, "additionalProperties": True}
    assert cs.closed({"type": "string"}) == {"type": "string"}


def _chat(**extra):
    body = {"messages": [{"role": "user", "content": "x"}], **extra}
    req, _ = parse_chat(json.dumps(body).encode())
    return cs.for_chat(req, chat_tools(req), "none")


OAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "parameters": t["parameters"]}} for t in TOOLS]


def test_what_each_api_asks():
    assert _chat() is None and _chat(tools=OAI_TOOLS, tool_choice="auto") is None
    assert _chat(tools=OAI_TOOLS, tool_choice="required").parser == "hermes"
    named = _chat(tools=OAI_TOOLS, tool_choice={"type": "function", "function": {"name": "ls"}})
    assert json.loads(named.constraint.json_schema)["properties"]["name"] == {"const": "ls"}
    assert json.loads(_chat(response_format={"type": "json_object"}).constraint.json_schema) == {"type": "object"}
    js = _chat(response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}})
    assert js.parser is None and json.loads(js.constraint.json_schema) == {**WEATHER, "additionalProperties": False}
    assert _chat(tools=OAI_TOOLS, tool_choice="required", response_format={"type": "json_object"}).parser == "hermes"
    m = parse_messages(json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                                   "tools": [{"name": "get_weather", "input_schema": WEATHER}],
                                   "tool_choice": {"type": "tool", "name": "get_weather"}}).encode())
    assert cs.for_messages(m, tool_defs(m), "mistral").constraint.prefix == "[TOOL_CALLS]"
    r = parse_responses(json.dumps({"input": "x", "tools": [{"type": "function", "name": "ls"}],
                                    "tool_choice": {"type": "function", "name": "ls"}}).encode())
    assert cs.for_responses(r.req, r.tools, "none").parser == "hermes"
    r = parse_responses(json.dumps({"input": "x", "text": {"format": {"type": "json_schema", "name": "w",
                                                                       "schema": WEATHER}}}).encode())
    assert json.loads(cs.for_responses(r.req, r.tools, "none").constraint.json_schema)["required"] == ["city"]


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": OAI_TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}}, "tool_choice.function.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nope"}}}],
      "tool_choice": "required"}, "tool_choice"),
])
def test_bad_requests_are_a_400_naming_the_field(extra, param):
    pytest.importorskip("llguidance")
    with pytest.raises(ApiError) as e:
        _chat(**extra)
    assert (e.value.status, e.value.param) == (400, param), e.value.message
    with pytest.raises(ApiError) as e:
        r = parse_responses(json.dumps({"input": "x", "tool_choice": {"type": "function"}}).encode())
        cs.for_responses(r.req, r.tools, "none")
    assert e.value.param == "tool_choice.name"


def test_a_checked_constraint_is_not_compiled_again(monkeypatch):
    pytest.importorskip("llguidance")
    s = cs.tool_call(TOOLS, "ls", "hermes")
    cs.check(s, "tool_choice")
    calls = []
    monkeypatch.setattr(cs, "validate", lambda c: calls.append(c) or "")
    cs.check(s, "tool_choice")
    assert calls == []  # answered from the kept checks
    fresh = cs.tool_call([{"name": "only_in_this_test", "parameters": {"type": "object"}}], None, "hermes")
    cs.check(fresh, "tool_choice")
    assert calls == [fresh.constraint]


def test_anthropic_output_config_format():
    ignored: list[str] = []
    m = parse_messages(json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                                   "output_config": {"format": {"type": "json_schema", "schema": WEATHER}}}).encode(),
                       ignored)
    s = cs.for_messages(m, tool_defs(m), "none")
    assert s.parser is None and json.loads(s.constraint.json_schema)["required"] == ["city"] and ignored == []
    m = parse_messages(json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                                   "output_config": {"effort": "high"}}).encode(), ignored)
    assert cs.for_messages(m, None, "none") is None and ignored == ["output_config"]  # effort: ignored, counted
    pytest.importorskip("llguidance")
    with pytest.raises(ApiError) as e:
        cs.for_messages(parse_messages(json.dumps({
            "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}).encode()),
            None, "none")
    assert e.value.param == "output_config.format.schema"


@pytest.mark.parametrize("parser", ["hermes", "mistral"])
@pytest.mark.parametrize("name", [None, "tree"])
def test_a_tools_own_references_still_resolve_inside_the_call(parser, name):
    """Parameters with local references (``#/$defs/...``, ``#``) compile inside the call's schema,
    and the value written under it validates against the tool's own schema."""
    tree = {"$defs": {"leaf": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 3}},
                               "required": ["v"]}},
            "type": "object", "properties": {"leaf": {"$ref": "#/$defs/leaf"},
                                             "kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["leaf"]}
    tools = [{"name": "tree", "parameters": tree}, *TOOLS]
    s = cs.tool_call(tools, name, parser)
    if importlib.util.find_spec("llguidance"):
        assert cs.validate(s.constraint) == ""
    text = constrained_text(s.constraint.json_schema, s.constraint.prefix, s.constraint.suffix)
    (call,) = toolcalls.parse_all(toolcalls.make(s.parser, "x"), [text])
    tool = next(t for t in tools if t["name"] == call.name)
    assert jsonschema_rs.validator_for(tool["parameters"]).is_valid(call.input()), text
