"""The tool-call parsers (services/drivers/gateway/toolcalls.py): each format, the fallbacks to
text, the held-back marker prefixes, the choice from a chat template, and the two properties
(any split of the text gives the same pieces; text without markers passes through)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.drivers.gateway import toolcalls
from services.drivers.gateway.toolcalls import ToolCall, detect, make, parse_all


def _call(n: int, name: str, args: dict) -> ToolCall:
    return ToolCall(f"call_k_{n}", name, json.dumps(args, ensure_ascii=False, separators=(",", ":")))


def whole(kind: str, text: str) -> list:
    return parse_all(make(kind, "k"), [text])


HERMES = ('Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("kind, text, want", [
    ("hermes", HERMES, ["Let me look.", _call(0, "get_weather", {"city": "Paris"}), _call(1, "get_time", {})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call> done',  # arguments as a string
     [_call(0, "f", {"a": 1}), "done"]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}', [_call(0, "f", {"a": 1})]),  # unclosed, complete JSON
    ("hermes", 'a <tool_call>{"name": "f", "arguments": {"a": </tool_call> b',  # malformed: text, marker kept
     ['a <tool_call>{"name": "f", "arguments": {"a": </tool_call> b']),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1', ['<tool_call>{"name": "f", "arguments": {"a": 1']),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', ['<tool_call>{"arguments": {}}</tool_call>']),  # no name
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
     ['<tool_call>{"name": "f", "arguments": [1]}</tool_call>']),
    ("hermes", "1 < 2 and <tool_ is not a marker", ["1 < 2 and <tool_ is not a marker"]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"x": "é"}}, {"name": "g", "arguments": {}}]',
     ["Sure.", _call(0, "f", {"x": "é"}), _call(1, "g", {})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}', [_call(0, "f", {"x": 1}), _call(1, "g", {})]),
    ("mistral", "[TOOL_CALLS] not json", ["[TOOL_CALLS] not json"]),
    ("llama3_json", '{"name": "f", "parameters": {"q": "a;b"}}', [_call(0, "f", {"q": "a;b"})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"n": 2}}',
     [_call(0, "f", {}), _call(1, "g", {"n": 2})]),
    ("llama3_json", '  {"answer": 42}', ['  {"answer": 42}']),  # JSON, but not a call: text
    ("llama3_json", 'The JSON is {"name": "f", "parameters": {}}', ['The JSON is {"name": "f", "parameters": {}}']),
])
def test_formats_and_fallbacks(kind, text, want):
    assert whole(kind, text) == want
    assert parse_all(make(kind, "k"), list(text)) == want  # one character at a time


def test_a_possible_marker_is_held_back_and_released():
    p = make("hermes", "k")
    assert p.feed("Hi <tool") == ["Hi"]  # " <tool" may start a call (the space may sit before one)
    assert p.feed("box>") == [" <toolbox>"]  # it did not
    assert p.feed(" <tool_call>") == []
    assert p.feed('{"name": "f"}') == []
    assert p.feed("</tool_call>\n") == [ToolCall("call_k_0", "f", "{}")]
    assert p.feed("\nthen") == ["then"]  # whitespace beside a call is dropped
    assert p.finish() == []


def test_mistral_holds_everything_after_its_marker():
    p = make("mistral", "k")
    assert p.feed("ok [TOOL_") == ["ok"]
    assert p.feed('CALLS][{"name": "f", "arguments": {}}]') == []
    assert p.finish() == [ToolCall("call_k_0", "f", "{}")]


def test_llama3_decides_from_the_start_of_the_output():
    p = make("llama3_json", "k")
    assert p.feed("  ") == [] and p.feed("<|py") == []
    assert p.feed("thon_tag|>") == [] and p.feed('{"name": "f", "parameters": {}}') == []
    assert p.finish() == [ToolCall("call_k_0", "f", "{}")]
    q = make("llama3_json", "k")
    assert q.feed("Hello") == ["Hello"] and q.feed(" {x}") == [" {x}"]


@pytest.mark.parametrize("source, want", [
    ('{% for tool in tools %}<tools>{{ tool | tojson }}</tools>{% endfor %}<tool_call>\n{"name": <function-name>}',
     "hermes"),
    ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral"),
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
    ('Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.',
     "llama3_json"),
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}", "none"),  # SmolLM2
    (None, "none"),
])
def test_detect_from_the_chat_template(source, want):
    assert detect(source) == want


def test_none_makes_no_parser():
    assert make("none", "k") is None


def test_the_module_is_pure():
    tree = ast.parse(Path(toolcalls.__file__).read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert mods <= {"__future__", "json", "abc", "dataclasses", "typing"}


# ----------------------------------------------------------------------------- properties
PIECES = ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": 1}}', '{"name": ', "[TOOL_CALLS]",
          '[{"name": "g", "arguments": {}}]', "g[ARGS]{}", "<|python_tag|>", '{"name": "h", "parameters": {}}',
          ";", " ", "\n", "<", "<tool", "[TOOL", "text", "é", "{", "}"]
texts = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=5)), max_size=12).map("".join)


def _splits(text: str, cuts: list[int]) -> list[str]:
    at = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *at], [*at, len(text)], strict=True)]


@pytest.mark.parametrize("kind", ["hermes", "mistral", "llama3_json"])
@given(text=texts, cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=10))
def test_any_split_gives_the_same_pieces_as_the_whole(kind, text, cuts):
    assert parse_all(make(kind, "k"), _splits(text, cuts)) == whole(kind, text)


@pytest.mark.parametrize("kind", ["hermes", "mistral", "llama3_json"])
@given(text=st.text(), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=10))
def test_text_without_markers_passes_through_unchanged(kind, text, cuts):
    if "<tool_call>" in text or "[TOOL_CALLS]" in text or text.lstrip().startswith(("{", "<|python_tag|>")):
        return
    assert "".join(parse_all(make(kind, "k"), _splits(text, cuts))) == text


def test_the_gateway_option():
    from services.drivers.gateway.__main__ import build_parser

    assert build_parser().parse_args([]).tool_call_parser == "auto"
    assert build_parser().parse_args(["--tool-call-parser", "mistral"]).tool_call_parser == "mistral"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tool-call-parser", "qwen3_coder"])
