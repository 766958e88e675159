"""``nvext.agent_hints`` parsing: known hints typed, unknown ones ignored."""

from __future__ import annotations

import json

import pytest

from services.drivers.gateway.api import AgentHints, ApiError, agent_hints, parse_chat, parse_completion

MSG = [{"role": "user", "content": "hi"}]


def _chat(nvext):
    body = {"messages": MSG} if nvext is None else {"messages": MSG, "nvext": nvext}
    return parse_chat(json.dumps(body).encode())[0]


@pytest.mark.parametrize("nvext, hints, unknown", [
    (None, None, []),
    ({}, None, []),
    ({"agent_hints": None}, None, []),
    ({"agent_hints": {}}, AgentHints(), []),
    ({"agent_hints": {"priority": 5, "osl": 1024, "speculative_prefill": True}},
     AgentHints(priority=5, osl=1024, speculative_prefill=True), []),
    ({"agent_hints": {"priority": -3}}, AgentHints(priority=-3), []),
    ({"agent_hints": {"osl": 0}}, AgentHints(osl=0), []),
    # unknown hints (a newer Dynamo's strict_priority, a typo) are ignored and reported
    ({"agent_hints": {"strict_priority": 1, "osl": 7, "latency_sensitivity": 0.5}},
     AgentHints(osl=7), ["latency_sensitivity", "strict_priority"]),
])
def test_agent_hints(nvext, hints, unknown):
    assert agent_hints(_chat(nvext)) == (hints, unknown)


def test_completions_take_them_too():
    r = parse_completion(json.dumps({"prompt": "x", "nvext": {"agent_hints": {"priority": 2}}}).encode())
    assert agent_hints(r) == (AgentHints(priority=2), [])


@pytest.mark.parametrize("nvext, param, code", [
    ({"agent_hints": {"osl": -1}}, "nvext.agent_hints.osl", "invalid_value"),
    ({"agent_hints": {"priority": "high"}}, "nvext.agent_hints.priority", "invalid_type"),
    ({"agent_hints": {"priority": 1.5}}, "nvext.agent_hints.priority", "invalid_type"),
    ({"agent_hints": {"speculative_prefill": "yes"}}, "nvext.agent_hints.speculative_prefill", "invalid_type"),
    ({"agent_hints": [1]}, "nvext.agent_hints", "invalid_type"),
    ({"agent_context": {"session_id": "s"}}, "nvext.agent_context", "unknown_parameter"),
    ("on", "nvext", "invalid_type"),
])
def test_bad_hints_are_a_400_naming_the_field(nvext, param, code):
    with pytest.raises(ApiError) as ei:
        agent_hints(_chat(nvext))
    assert (ei.value.status, ei.value.param, ei.value.code) == (400, param, code)
    assert param in ei.value.message
