"""Bad input on the request bodies: nesting refused before decoding, echoes bounded.

The live answers (all four POST routes, aiohttp's own 400s, the 404 of a 7 MB model name) are
in tests/integration/test_gateway_fuzz.py (``test_regression_*``)."""

from __future__ import annotations

import json

import pytest

from services.drivers.gateway import anthropic_api, responses_api
from services.drivers.gateway.api import (
    MAX_ECHO_CHARS,
    MAX_JSON_DEPTH,
    MAX_MESSAGE_CHARS,
    ApiError,
    clip,
    decode_object,
    parse_chat,
    parse_completion,
)
from services.drivers.gateway.headers import HeaderError, parse_branch_headers

MSG = [{"role": "user", "content": "hi"}]


def nested(depth: int) -> object:
    """``depth`` levels: lists inside one object."""
    inner: object = 1
    for _ in range(depth - 1):
        inner = [inner]
    return {"x": inner}


def err(fn, raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as ei:
        fn(raw)
    return ei.value


PARSERS = [lambda raw: parse_chat(raw), parse_completion, anthropic_api.parse_messages,
           anthropic_api.parse_count_tokens, responses_api.parse_responses]


@pytest.mark.parametrize("parse", PARSERS, ids=["chat", "completions", "messages", "count_tokens", "responses"])
@pytest.mark.parametrize("raw", [
    b"[" * 990 + b"]" * 990,  # was a RecursionError (500) on every route
    b'{"messages": ' + b"[" * 990 + b"]" * 990 + b"}",
    b'{"a": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001,
    json.dumps({"messages": MSG, "metadata": nested(MAX_JSON_DEPTH)}).encode(),
])
def test_a_body_nested_too_deep_is_a_400_before_decoding(parse, raw):
    e = err(parse, raw)
    assert (e.status, e.code, e.param) == (400, "json_too_deep", "body")
    assert f"at most {MAX_JSON_DEPTH} deep" in e.message and "nested" in e.message


def test_the_limit_itself_is_accepted():
    ok = {"messages": [{"role": "user", "content": "hi", "tool_calls": [nested(MAX_JSON_DEPTH - 4)]}]}
    assert json.dumps(ok).count("[") == MAX_JSON_DEPTH - 3  # ok nests exactly MAX_JSON_DEPTH deep
    parse_chat(json.dumps(ok).encode())
    too = {"messages": [{"role": "user", "content": "hi", "tool_calls": [nested(MAX_JSON_DEPTH - 3)]}]}
    assert err(lambda r: parse_chat(r), json.dumps(too).encode()).message.startswith(
        f"the request body is nested {MAX_JSON_DEPTH + 1} deep")


def test_brackets_inside_strings_do_not_count():
    req, _ = parse_chat(json.dumps({"messages": [{"role": "user", "content": "[" * 5000}]}).encode())
    assert req.messages[0].content == "[" * 5000


def test_decode_object_is_shared_by_both_apis():
    assert err(decode_object, b"[" * 200 + b"]" * 200).code == "json_too_deep"


# ----------------------------------------------------------------------------- echoes
def test_clip():
    assert clip("abc") == "abc"
    assert clip("x" * MAX_ECHO_CHARS) == "x" * MAX_ECHO_CHARS
    assert clip("x" * 7_000_000) == "x" * MAX_ECHO_CHARS + "… (7000000 chars)"
    assert clip("abcdef", 3) == "abc… (6 chars)"


def test_an_error_message_and_param_are_bounded():
    e = ApiError(400, "m" * 10**6, "p" * 10**6)
    assert len(e.message) <= MAX_MESSAGE_CHARS + 32 and e.message.endswith("(1000000 chars)")
    assert len(e.param) <= MAX_ECHO_CHARS + 32
    assert len(json.dumps(e.body())) < 3000 and len(json.dumps(anthropic_api.error_body(e))) < 3000


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "r" * 7_000_000, "content": "hi"}]},  # msgspec repeats a bad enum value
    {"messages": MSG, "stream_options": {"k" * 7_000_000: True}},  # an unknown field, inside
    {"messages": MSG, "tool_choice": "x" * 7_000_000},
])
def test_a_huge_value_is_not_echoed_whole(body):
    e = err(lambda r: parse_chat(r), json.dumps(body).encode())
    assert e.status == 400
    assert len(e.message) < 1500 and (e.param is None or len(e.param) < 300), (len(e.message), e.param[:80])


def test_a_huge_anthropic_tool_type_is_not_echoed_whole():
    """An unknown tool type is accepted and left out (a server tool, as far as anyone can tell);
    what the header and the counter say of it is bounded."""
    body = {"model": "m", "max_tokens": 1, "messages": MSG, "tools": [{"type": "t" * 7_000_000, "name": "x"}]}
    unserved: list[str] = []
    anthropic_api.parse_messages(json.dumps(body).encode(), [], unserved)
    assert unserved == ["t" * 64]


@pytest.mark.parametrize("headers", [{"x-branch-end": "y" * 8000}, {"x-branch-id": "a", "x-parent-branch-id": "b",
                                                                      "x-branch-mode": "m" * 8000}])
def test_a_long_header_value_is_not_echoed_whole(headers):
    with pytest.raises(HeaderError) as ei:
        parse_branch_headers(headers)
    assert len(ei.value.message) < 400
