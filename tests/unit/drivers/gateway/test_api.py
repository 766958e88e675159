"""Request validation (msgspec Structs), the refused and unapplied parameters, the error shape."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.drivers.gateway.api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    context_error,
    parse_chat,
    parse_completion,
    requested_max_tokens,
    sampling_fields,
    unapplied,
)
from tests.hyp import examples

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw) -> bytes:
    return json.dumps({"messages": MSG, **kw}).encode()


def err(fn, raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as ei:
        fn(raw)
    return ei.value


def test_a_valid_chat_request_decodes_into_structs():
    req, obj = parse_chat(chat(model="m", max_tokens=5, stream=True, stream_options={"include_usage": True},
                               temperature=0.2, stop=["x"]))
    assert isinstance(req, ChatRequest) and req.messages[0].role == "user"
    assert req.stream_options.include_usage and requested_max_tokens(req) == 5
    assert obj["messages"] == MSG  # the template renders the decoded messages
    assert unapplied(req) == []  # temperature and stop reach the engine (sampling_fields)
    assert sampling_fields(req) == {"ignore_eos": False, "temperature": 0.2, "stop": ["x"]}


@pytest.mark.parametrize("raw, param, code", [
    (b"{not json", "body", "invalid_json"),
    (b"[1]", "body", "invalid_type"),
    (b'{"model": "m"}', "messages", "missing_required_parameter"),
    (chat(max_tokens=-1), "max_tokens", "invalid_value"),
    (chat(max_tokens=True), "max_tokens", "invalid_type"),
    (chat(max_tokens=1.5), "max_tokens", "invalid_type"),
    (chat(stream="yes"), "stream", "invalid_type"),
    (chat(temperature=3), "temperature", "invalid_value"),
    (chat(stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage", "invalid_type"),
    (json.dumps({"messages": []}).encode(), "messages", "invalid_value"),
    (json.dumps({"messages": [{"role": "bot", "content": "x"}]}).encode(), "messages[0].role", "invalid_value"),
    (json.dumps({"messages": [{"role": "user", "content": 3}]}).encode(), "messages[0].content", "invalid_type"),
])
def test_bad_chat_fields_are_named(raw, param, code):
    e = err(parse_chat, raw)
    assert (e.status, e.param, e.code) == (400, param, code)
    assert param in e.message or param == "body"


def test_unknown_top_level_fields_are_ignored_and_named():
    ignored: list[str] = []
    req, _obj = parse_chat(chat(frobnicate=1, aardvark=2), ignored)
    assert ignored == ["aardvark", "frobnicate"] and req.max_tokens is None
    done: list[str] = []
    assert parse_completion(json.dumps({"prompt": "p", "zz": 1}).encode(), done).prompt == "p" and done == ["zz"]
    # the known fields keep their strict checks, whatever else came with them
    assert err(parse_chat, chat(frobnicate=1, temperature=3)).param == "temperature"


def test_role_error_lists_the_roles():
    e = err(parse_chat, json.dumps({"messages": [{"role": "bot"}]}).encode())
    assert "assistant" in e.message and "'bot'" in e.message


@pytest.mark.parametrize("raw, param", [
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content"),
    (b'{"prompt": "\\ud83d"}', "prompt"),
    (b'{"prompt": "x", "user": "\\ud800"}', "user"),
])
def test_a_lone_surrogate_is_a_400_naming_its_field(raw, param):
    fn = parse_completion if b"prompt" in raw else parse_chat
    e = err(fn, raw)
    assert (e.status, e.param, e.code) == (400, param, "invalid_value") and "surrogate" in e.message


def test_a_surrogate_pair_is_fine():
    assert parse_completion(b'{"prompt": "\\ud83d\\ude00"}').prompt == "\U0001F600"


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"response_format": {"type": "regex"}}, "response_format"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
])
def test_chat_parameters_it_cannot_honour_are_refused(extra, param):
    e = err(parse_chat, chat(**extra))
    assert (e.status, e.param, e.code) == (400, param, "unsupported_parameter")
    assert param in e.message


@pytest.mark.parametrize("extra", [
    {"n": 1}, {"logprobs": False}, {"top_logprobs": 0}, {"tools": []}, {"tool_choice": "none"},
    {"tool_choice": "auto"}, {"response_format": {"type": "text"}}, {"logit_bias": {}},
    {"modalities": ["text"]}, {"parallel_tool_calls": True}, {"user": "u"}, {"metadata": {"a": "b"}},
    {"store": False}, {"seed": 3}, {"ignore_eos": True}, {"min_tokens": 1},
    {"tools": [{"type": "function", "function": {"name": "f"}}]}, {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "f"}}},
    {"response_format": {"type": "json_object"}}, {"response_format": {"type": "json_schema", "json_schema": {}}},
])
def test_neutral_values_are_accepted(extra):
    parse_chat(chat(**extra))


def test_several_refused_parameters_are_all_named():
    e = err(parse_chat, chat(n=3, logprobs=True, functions=[{}]))
    assert all(p in e.message for p in ("n", "logprobs", "functions")) and e.param == "n"


@pytest.mark.parametrize("extra, param", [
    ({"best_of": 2}, "best_of"), ({"logprobs": 0}, "logprobs"), ({"echo": True}, "echo"),
    ({"suffix": "end"}, "suffix"), ({"n": 4}, "n"),
])
def test_completion_parameters_it_cannot_honour_are_refused(extra, param):
    e = err(parse_completion, json.dumps({"prompt": "x", **extra}).encode())
    assert (e.status, e.param, e.code) == (400, param, "unsupported_parameter")


@pytest.mark.parametrize("prompt, ok", [
    ("abc", "abc"), (["abc"], "abc"), ([1, 2, 3], [1, 2, 3]), ("", ""),
])
def test_prompt_forms(prompt, ok):
    assert parse_completion(json.dumps({"prompt": prompt}).encode()).prompt == ok


@pytest.mark.parametrize("prompt, param", [
    (["a", "b"], "prompt"), ([], "prompt"), (["a", 1], "prompt"), ([[1, 2]], "prompt[0]"),
    ([-1], "prompt[0]"), (3, "prompt"), (None, "prompt"),
])
def test_bad_prompts_are_named(prompt, param):
    e = err(parse_completion, json.dumps({"prompt": prompt}).encode())
    assert (e.status, e.param) == (400, param)


def test_max_tokens_and_max_completion_tokens():
    r = parse_completion(b'{"prompt": "x", "max_completion_tokens": 7}')
    assert requested_max_tokens(r) == 7
    e = err(parse_completion, b'{"prompt": "x", "max_tokens": 3, "max_completion_tokens": 7}')
    assert e.param == "max_completion_tokens"


def test_context_error_has_openais_shape():
    e = context_error(100, 90, 20, "messages")
    body = e.body()["error"]
    assert body["code"] == "context_length_exceeded" and body["param"] == "messages"
    assert "maximum context length is 100 tokens" in body["message"] and "110 tokens" in body["message"]


def test_every_default_code_is_a_string():
    for status in (400, 401, 404, 405, 409, 413, 418, 500, 502, 503, 504):
        e = ApiError(status, "m")
        assert isinstance(e.body()["error"]["code"], str) and isinstance(e.type, str)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
    max_leaves=8)
_keys = st.sampled_from(["messages", "prompt", "model", "max_tokens", "stream", "n", "stop", "tools",
                         "stream_options", "temperature", "logprobs", "echo", "x"])


_SETTINGS = settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(st.dictionaries(_keys, _json, max_size=5), st.booleans())
def test_any_json_object_parses_or_is_a_400_with_a_string_code(obj, as_chat):
    """The invariant behind 'never a text/plain 500': arbitrary bodies end in a request or an ApiError."""
    raw = msgspec.json.encode(obj)
    try:
        (parse_chat if as_chat else parse_completion)(raw)
    except ApiError as e:
        assert e.status == 400 and isinstance(e.code, str) and e.code
        assert e.param is None or isinstance(e.param, str)


@_SETTINGS
@given(st.binary(max_size=64))
def test_any_bytes_parse_or_are_a_400(raw):
    try:
        parse_completion(raw)
    except ApiError as e:
        assert e.status == 400 and isinstance(e.code, str)


def test_completion_request_is_a_struct():
    assert isinstance(parse_completion(b'{"prompt": "x"}'), CompletionRequest)


def test_sampling_fields_for_the_event():
    req = parse_completion(json.dumps({"prompt": "x", "ignore_eos": True, "top_k": 40, "seed": 3, "stop": "END"}).encode())
    assert sampling_fields(req) == {"ignore_eos": True, "top_k": 40, "seed": 3, "stop": ["END"]}
    req = parse_completion(json.dumps({"prompt": "x", "stop": ["a"] * 17}).encode())
    with pytest.raises(ApiError) as ei:
        sampling_fields(req)
    assert ei.value.param == "stop"


_ids = st.lists(st.one_of(st.integers(0, 60_000), st.sampled_from([0, 2**31 - 1, 2**31, 2**32, -1, 2**63])),
                max_size=6)
_prompts = st.one_of(_ids, st.lists(st.one_of(st.integers(0, 9), st.booleans(), st.text(max_size=2),
                                              st.floats(0, 1), st.none()), max_size=3))
_fields = st.dictionaries(st.sampled_from(["max_tokens", "stream", "n", "stream_options", "echo", "unknown_x",
                                           "temperature", "model"]),
                          st.one_of(st.integers(-1, 3), st.booleans(), st.none(), st.text(max_size=3),
                                    st.just({"include_usage": True, "newer": 1})), max_size=4)


@_SETTINGS
@given(_prompts, _fields)
def test_a_token_id_prompt_parses_as_the_general_path_does(prompt, fields):
    """parse_completion's token-id path (typed decode, range check in C) gives the request, the
    ignored names and the 400 (status, param, code, message) of the general path on any body."""
    from services.drivers.gateway.api import parse_completion_general

    raw = json.dumps({"prompt": prompt, **fields}).encode()

    def run(fn):
        ignored: list[str] = []
        try:
            return fn(raw, ignored), ignored
        except ApiError as e:
            return (e.status, e.param, e.code, e.message), ignored

    assert run(parse_completion) == run(parse_completion_general)


def test_token_ids_at_the_edges_of_the_range():
    assert parse_completion(b'{"prompt": [0, 2147483647]}').prompt == [0, 2147483647]
    for bad in (b"[2147483648]", b"[4294967296]", b"[-1]", b"[1, true]", b"[1.0]"):
        assert err(parse_completion, b'{"prompt": ' + bad + b"}").param in ("prompt[0]", "prompt[1]")
