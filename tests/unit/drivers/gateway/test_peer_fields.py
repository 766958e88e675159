"""vLLM's and SGLang's request extensions: honoured (``continuous_usage_stats``, ``ignore_eos``,
``min_tokens``) or ignored and named (every other field their servers accept), never a 400."""

from __future__ import annotations

import json

import pytest

from services.drivers.gateway.api import PEER_FIELDS, ApiError, parse_chat, parse_completion, sampling_fields

MSG = [{"role": "user", "content": "hi"}]

#: a value of the type each peer server expects (vLLM 0.32 / SGLang 0.5.23 schemas)
VALUES = {"add_generation_prompt": True, "add_special_tokens": False, "allowed_token_ids": [1, 2],
          "bad_words": ["x"], "cache_salt": "s", "chat_template": "{{ x }}", "chat_template_kwargs": {"a": 1},
          "continue_final_message": False, "documents": [{"t": "d"}], "include_reasoning": True,
          "include_stop_str_in_output": False, "kv_transfer_params": {"do_remote_prefill": False},
          "length_penalty": 1.0, "lora_path": "l", "no_stop_trim": False, "priority": 3,
          "prompt_logprobs": None, "regex": "a+", "ebnf": "root ::= 'a'", "rid": "r1", "request_id": "r1",
          "return_hidden_states": False, "return_token_ids": False, "return_tokens_as_token_ids": False,
          "separate_reasoning": True, "session_id": "s1", "session_params": {"id": "s"},
          "skip_special_tokens": True, "spaces_between_special_tokens": True, "stop_token_ids": [2],
          "stream_interval": 1, "stream_reasoning": True, "structured_outputs": None,
          "thinking_token_budget": 10, "truncate_prompt_tokens": 100, "truncation_side": "left",
          "use_beam_search": False, "vllm_xargs": {"k": "v"}}


def test_every_peer_field_has_a_value_here():
    assert sorted(VALUES) == sorted(PEER_FIELDS)


@pytest.mark.parametrize("parse, body", [
    (lambda raw, ig: parse_chat(raw, ig)[0], {"messages": MSG}),
    (parse_completion, {"prompt": "hi"}),
])
def test_peer_fields_are_ignored_and_named_never_a_400(parse, body):
    ignored: list[str] = []
    raw = json.dumps({**body, **VALUES, "ignore_eos": True, "min_tokens": 2, "stream": True,
                      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode()
    req = parse(raw, ignored)
    assert ignored == sorted(PEER_FIELDS)
    assert req.stream_options.include_usage and req.stream_options.continuous_usage_stats
    assert req.min_tokens == 2 and sampling_fields(req)["ignore_eos"] is True


def test_an_unknown_stream_option_is_ignored_and_named():
    ignored: list[str] = []
    req, _ = parse_chat(json.dumps({"messages": MSG, "stream": True,
                                    "stream_options": {"include_usage": True, "zz": 1, "k" * 1000: 2}}).encode(),
                        ignored)
    assert req.stream_options.include_usage and not req.stream_options.continuous_usage_stats
    assert ignored[1] == "stream_options.zz" and ignored[0].startswith("stream_options.kkk")
    assert len(ignored[0]) < 120  # a huge name is clipped before it is counted or logged


def test_a_known_stream_option_keeps_its_type_check():
    with pytest.raises(ApiError) as ei:
        parse_chat(json.dumps({"messages": MSG, "stream": True,
                               "stream_options": {"continuous_usage_stats": "yes"}}).encode())
    assert (ei.value.status, ei.value.param) == (400, "stream_options.continuous_usage_stats")
