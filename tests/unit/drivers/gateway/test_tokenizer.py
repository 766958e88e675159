"""Byte tokenizer, optional HF loading, chat template, token subjects."""

from __future__ import annotations

import pytest

from events.wire import TokenMsg, decode, encode, sim_text, token_key, token_subject
from services.drivers.gateway.model import ModelError, load_model
from services.drivers.gateway.tokenizer import (
    GENERATION_PROMPT,
    ByteTokenizer,
    TemplateError,
    render_chat,
)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.encode("ab") == [97, 98]
    assert tok.encode("é") == [0xC3, 0xA9]
    assert tok.decode(tok.encode("héllo")) == "héllo"


def test_no_model_is_bytes_and_a_missing_named_model_is_an_error(tmp_path):
    m = load_model(None)
    assert isinstance(m.tokenizer, ByteTokenizer) and "default" in m.note
    with pytest.raises(ModelError, match="missing.json: no such file"):
        load_model(str(tmp_path / "missing.json"))  # named explicitly: never a silent fall back to bytes


def test_load_hf_tokenizer_when_present(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="the optional 'tokenizers' package is absent")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    t = tokenizers.Tokenizer(WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    t.pre_tokenizer = Whitespace()
    path = tmp_path / "tokenizer.json"
    t.save(str(path))
    m = load_model(str(path))
    assert m.tokenizer.encode("hello world") == [0, 1] and "tokenizers" in m.note


def test_render_chat_exact():
    text = render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert text == "<|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"


def test_next_turn_extends_the_previous_prompt():
    turn1 = [{"role": "user", "content": "hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert render_chat(turn2).startswith(render_chat(turn1))
    assert render_chat(turn1).endswith(GENERATION_PROMPT)


def test_parts_tools_and_null_content():
    text = render_chat([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ])
    assert "<|user|>\na[image_url]<|end|>" in text
    assert '<|assistant|>\n[{"id":"c1","type":"function"}]<|end|>' in text
    assert "<|tool:c1|>\n42<|end|>" in text


@pytest.mark.parametrize("messages, field", [
    ([], "messages"),
    ("hi", "messages"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": "a"}, "x"], "messages[1]"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0].text"),
])
def test_template_errors_name_the_field(messages, field):
    with pytest.raises(TemplateError) as ei:
        render_chat(messages)
    assert ei.value.field == field


def test_token_subject_is_one_safe_token_per_request():
    s = token_subject("default", "a.b/c d")
    assert s.startswith("eitok.default.") and s.count(".") == 2
    assert token_subject("default", "x") != token_subject("default", "y")
    assert token_key("x") == token_key("x") and len(token_key("x")) == 16


def test_token_msg_round_trip_and_sim_text():
    m = TokenMsg(request="r", kind="chunk", tokens=3, total=4, text=sim_text(3), simulated=True)
    assert decode(encode(m)) == m
    assert sim_text(2) == " this is" and sim_text(-1) == "" and sim_text(2, 11) == " model this"


def test_tools_render_first_as_one_block_and_not_at_all_without_tools():
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"name": "f", "parameters": {"type": "object", "a": 1}}]
    assert render_chat(msgs, tools) == ('<|tools|>\n[{"name":"f","parameters":{"a":1,"type":"object"}}]<|end|>\n'
                                        + render_chat(msgs))
    assert render_chat(msgs, []) == render_chat(msgs, None) == render_chat(msgs)
