"""Real clients' requests against the in-process bus: what Claude Code sends gets a 200 (unknown
fields ignored and counted, system messages folded, any model name), ``--served-model-name``
restricts the names, and a client without session headers has its multi-turn conversation
folded into one branch by the hash chain over its messages (docs/gateway.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from events.catalog import BranchEnded, BranchOpened, ContextCompacted, RequestSubmitted
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens, sim_text
from services.drivers.gateway.app import Gateway, GatewayConfig
from services.drivers.gateway.openapi import ModelCard, ModelList
from tests.integration.gateway_harness import serving
from tests.integration.test_gateway_app import _events, fake_cluster, gateway

#: The shape of Claude Code 2.1.x's first ``/v1/messages`` request (`claude -p`), cut down: the
#: top-level fields, block-level cache_control, a system message inside ``messages``.
CLAUDE_CODE = {
    "model": "claude-opus-4-8",
    "max_tokens": 32,
    "stream": True,
    "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                "cache_control": {"type": "ephemeral"}},
               {"type": "text", "text": "Working directory: /repo", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
    "messages": [
        {"role": "system", "content": "The user is in plan mode."},
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>Context</system-reminder>"},
            {"type": "text", "text": "say hi", "cache_control": {"type": "ephemeral"}}]},
    ],
    "tools": [{"name": "Bash", "description": "Run a command.", "cache_control": {"type": "ephemeral"},
               "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                                "required": ["command"], "additionalProperties": False,
                                "$schema": "http://json-schema.org/draft-07/schema#"}}],
    "metadata": {"user_id": "user_abc_account__session_0f0e"},
    "temperature": 1,
    "thinking": {"type": "enabled", "budget_tokens": 31999},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
}
BETAS = "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27"
CC_HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": BETAS, "x-api-key": "k",
              "x-app": "cli", "user-agent": "claude-cli/2.1.197 (external, sdk-cli)"}


def _anthropic_text(raw: str) -> str:
    out = []
    for line in raw.splitlines():
        if line.startswith("data: "):
            ev = json.loads(line[6:])
            if ev.get("type") == "content_block_delta":
                out.append(ev["delta"]["text"])
    return "".join(out)


async def test_a_claude_code_request_gets_a_200_and_its_unknown_fields_are_counted(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (gw, client):
        for _ in range(2):
            r = await client.post("/v1/messages", json=CLAUDE_CODE, headers=CC_HEADERS)
            assert r.status == 200, await r.text()
            raw = await r.text()
            assert '"model":"claude-opus-4-8"' in raw  # the name it asked for
            assert _anthropic_text(raw) == sim_text(32) and "event: message_stop" in raw
        for field in ("context_management", "output_config"):
            assert gw.metrics.get("ei_gateway_ignored_fields_total", api="anthropic", field=field) == 2
        for beta in BETAS.split(","):
            assert gw.metrics.get("ei_gateway_ignored_fields_total", api="anthropic",
                                  field=f"anthropic-beta: {beta}") == 2
        assert len(gw._ignored_logged) == 5  # one log line per name, not per request
        text = await (await client.get("/metrics")).text()
        assert 'ei_gateway_ignored_fields_total{api="anthropic",field="output_config"} 2.0' in text
        # count_tokens takes the same body
        r = await client.post("/v1/messages/count_tokens", json={k: v for k, v in CLAUDE_CODE.items()
                                                                 if k not in ("max_tokens", "stream")},
                              headers=CC_HEADERS)
        assert r.status == 200 and (await r.json())["input_tokens"] > 0


async def test_the_system_messages_are_folded_into_the_prompt(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (_gw, client):
        body = {**CLAUDE_CODE, "stream": False, "tools": None}
        r = await client.post("/v1/messages", json=body, headers={"x-branch-id": "cc"})
        assert r.status == 200, await r.text()
        prompt = ("<|system|>\nYou are Claude Code, Anthropic's official CLI for Claude.Working directory: /repo"
                  "\n\nThe user is in plan mode.<|end|>\n"
                  "<|user|>\n<system-reminder>Context</system-reminder>say hi<|end|>\n<|assistant|>\n")
        sub = next(e for e in await _events(bus) if isinstance(e, RequestSubmitted))
        assert sub.prompt_tokens == len(prompt.encode())  # the byte tokenizer: one token a byte


async def test_unknown_openai_fields_are_counted_and_known_ones_stay_strict(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (gw, client):
        body = {"model": "gpt-5-codex", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "frobnicate": {"x": 1}, "include_reasoning": True}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status == 200, await r.text()
        assert (await r.json())["model"] == "gpt-5-codex"
        assert gw.metrics.get("ei_gateway_ignored_fields_total", api="openai", field="frobnicate") == 1
        r = await client.post("/v1/chat/completions", json={**body, "max_tokens": "2"})
        assert r.status == 400 and (await r.json())["error"]["param"] == "max_tokens"
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "zz": 1})
        assert r.status == 200
        assert gw.metrics.get("ei_gateway_ignored_fields_total", api="openai", field="zz") == 1


async def test_ignored_field_labels_are_bounded(partition):
    gw = Gateway(InMemoryBus(partition), MemoryTokens(partition), GatewayConfig(partition=partition))
    gw._note_ignored("openai", [f"f{i}" for i in range(gw.MAX_IGNORED_LABELS + 50)] + ["k" * 10_000])
    assert gw.metrics.get("ei_gateway_ignored_fields_total", api="openai", field="(other)") == 51
    assert len(gw._ignored_logged) == gw.MAX_IGNORED_LABELS + 1  # (other) logged once too


async def test_any_model_name_is_served_and_listed_in_both_shapes(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition), model="org/glm-5") as (_gw, client):
        for name in ("claude-opus-4-8", "claude-haiku-4-5-20251001", "org/glm-5"):
            r = await client.post("/v1/messages", json={"model": name, "max_tokens": 1,
                                                        "messages": [{"role": "user", "content": "x"}]})
            assert r.status == 200 and (await r.json())["model"] == name
        r = await client.get("/v1/models")
        listing = await r.json()
        ModelList(**{**listing, "data": [ModelCard(**c) for c in listing["data"]]})
        assert [c["id"] for c in listing["data"]] == ["org/glm-5"]
        assert (listing["has_more"], listing["first_id"], listing["data"][0]["type"]) == (False, "org/glm-5", "model")
        r = await client.get("/v1/models/claude-opus-4-8")
        assert r.status == 200 and (await r.json())["id"] == "claude-opus-4-8"
        # a client's name never makes a new metrics series: the frontend metrics say --model
        text = await (await client.get("/metrics")).text()
        assert 'model="claude-opus-4-8"' not in text and 'model="org/glm-5"' in text
        doc = await (await client.get("/openapi.json")).json()
        assert "enum" not in doc["components"]["schemas"]["MessagesRequest"]["properties"]["model"]


async def test_served_model_names_restrict_the_names(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition), model="smol",
                       served_model_names=("claude-opus-4-8", "smol")) as (_gw, client):
        ok = {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
        for name in ("smol", "claude-opus-4-8"):
            r = await client.post("/v1/messages", json={**ok, "model": name})
            assert r.status == 200 and (await r.json())["model"] == name
        r = await client.post("/v1/messages", json={**ok, "model": "gpt-4o"})
        assert r.status == 404
        err = await r.json()
        assert err["error"]["type"] == "not_found_error" and "'claude-opus-4-8'" in err["error"]["message"]
        r = await client.post("/v1/chat/completions", json={**ok, "model": "gpt-4o"})
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        assert [c["id"] for c in (await (await client.get("/v1/models")).json())["data"]] == ["smol", "claude-opus-4-8"]
        assert (await client.get("/v1/models/gpt-4o")).status == 404
        doc = await (await client.get("/openapi.json")).json()
        assert doc["components"]["schemas"]["MessagesRequest"]["properties"]["model"]["enum"] == \
            ["smol", "claude-opus-4-8"]
        text = await (await client.get("/metrics")).text()
        assert 'model="claude-opus-4-8"' in text  # a listed name is its own series


async def test_prompt_too_long_is_anthropics_wording(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition), context_length=300) as (_gw, client):
        r = await client.post("/v1/messages", json={"model": "claude-opus-4-8", "max_tokens": 10,
                                                    "messages": [{"role": "user", "content": "x" * 400}]})
        assert r.status == 400
        body = await r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith("prompt is too long: ") and "> 299 maximum" in body["error"]["message"]


# ----------------------------------------------------------------------------- part 6
def _turns(n: int) -> list[dict]:
    """A conversation of ``n`` user turns, each answered with the sim's reply (``tok `` per token)."""
    out: list[dict] = [{"role": "system", "content": "agent"}]
    for i in range(n):
        out.append({"role": "user", "content": f"step {i} " * 20})
        if i < n - 1:
            out.append({"role": "assistant", "content": "tok tok tok "})
    return out


def _names(evs) -> list[str]:
    return [type(e).__name__ for e in evs]


@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_a_headerless_conversation_is_one_branch(partition, api):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (gw, client):
        branches = set()
        for n in (1, 2, 3):
            msgs = _turns(n)
            if api == "openai":
                r = await client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3})
            else:  # Anthropic's shape: the system prompt apart, the reply sent back as text blocks
                conv = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]
                         if m["role"] == "assistant" else m["content"]} for m in msgs[1:]]
                r = await client.post("/v1/messages", json={"model": "m", "system": "agent", "messages": conv,
                                                            "max_tokens": 3, "stream": n == 2})
            assert r.status == 200, await r.text()
            branches.add(r.headers["x-branch-id"])
        assert len(branches) == 1 and next(iter(branches)).startswith("gw-")
        evs = await _events(bus)
        assert _names(evs) == ["BranchOpened", "RequestSubmitted", "RequestSubmitted", "RequestSubmitted"]
        assert [e.version for e in evs if isinstance(e, RequestSubmitted)] == [0, 0, 0]
        assert gw.metrics.get("ei_gateway_headerless_requests_total") == 3
        assert gw.metrics.get("ei_gateway_conversations_continued_total") == 2


async def test_a_rewritten_conversation_bumps_the_version_and_a_new_one_opens_a_branch(partition):
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (_gw, client):
        post = lambda msgs, **kw: client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3},
                                              **kw)
        first = (await post(_turns(1))).headers["x-branch-id"]
        assert (await post(_turns(2))).headers["x-branch-id"] == first
        # the agent edits its last message (a rewind): the same branch by the shared prefix, and
        # the prompt no longer extends the previous one: the header rule's inferred compaction
        edited = _turns(2)[:-1] + [{"role": "user", "content": "something else " * 20}]
        assert (await post(edited)).headers["x-branch-id"] == first
        # another conversation, and the same first request again, open branches of their own
        other = (await post([{"role": "user", "content": "unrelated " * 20}])).headers["x-branch-id"]
        again = (await post(_turns(1))).headers["x-branch-id"]
        assert len({first, other, again}) == 3
        # headers still win: a header-carrying request that extends the conversation is its own branch
        r = await post(_turns(3), headers={"x-branch-id": "named"})
        assert r.headers["x-branch-id"] == "named"
        evs = await _events(bus)
        ours = [e for e in evs if e.branch == first]
        assert _names(ours) == ["BranchOpened", "RequestSubmitted", "RequestSubmitted", "ContextCompacted",
                                "RequestSubmitted"]
        assert [e.version for e in ours if isinstance(e, RequestSubmitted)] == [0, 0, 1]
        assert not any(isinstance(e, BranchEnded) for e in evs)  # they stay open until idle expiry


async def test_a_headerless_branch_expires_and_its_conversation_starts_a_new_one(partition):
    bus = InMemoryBus(partition)
    now = [100.0]
    gw = Gateway(bus, MemoryTokens(partition), GatewayConfig(partition=partition, branch_ttl_s=60),
                 clock=lambda: now[0])
    async with serving(gw, fake_cluster(bus, gw.tokens)) as client:
        post = lambda n: client.post("/v1/chat/completions", json={"messages": _turns(n), "max_tokens": 3})
        a = (await post(1)).headers["x-branch-id"]
        now[0] += 30
        assert (await post(2)).headers["x-branch-id"] == a
        now[0] += 61  # idle past the TTL: the branch ends; the index forgets it too
        b = (await post(3)).headers["x-branch-id"]
        assert b != a
        evs = await _events(bus, (BranchOpened, BranchEnded, ContextCompacted))
        assert _names(evs) == ["BranchOpened", "BranchEnded", "BranchOpened"]
        assert evs[1].reason == "idle" and evs[1].branch == a


async def test_an_overlong_model_name_is_a_404_even_when_any_name_is_served(partition):
    """The response repeats the name asked for: a 7 MB one would come back whole."""
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (_gw, client):
        ok = {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
        assert (await client.post("/v1/messages", json={**ok, "model": "m" * 256})).status == 200
        r = await client.post("/v1/messages", json={**ok, "model": "m" * 257})
        assert r.status == 404 and "at most 256 characters" in (await r.json())["error"]["message"]


# ----------------------------------------------------------------------------- side requests
#: What ``opencode run "say hi"`` 1.18.33 sent (the logging proxy's record, cut to the method,
#: path, its headers and the body; its working directory replaced): the title request (no tools,
#: "You are a title generator ...") and the agent's turn (10 tools), both under one x-session-id.
OPENCODE = [json.loads(line) for line in
            (Path(__file__).parents[1] / "fixtures" / "clients" / "opencode-1.18.33-run.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("order", ["title_first", "turn_first"])
async def test_opencodes_title_request_is_a_side_branch_not_a_compaction(partition, order):
    """opencode sends its title request and the agent's turn at once, under the same session id,
    and the two share no prefix: whichever comes first, the title request runs on a side branch
    of the session (opened, one request, ended) and the session's prompt is the turn's - no
    ContextCompacted; the turn's next request extends it (branches.is_side)."""
    title, turn = OPENCODE
    assert not title["body"].get("tools") and len(turn["body"]["tools"]) == 10
    session = turn["headers"]["x-session-id"]
    assert title["headers"]["x-session-id"] == session
    bus = InMemoryBus(partition)
    async with gateway(bus, MemoryTokens(partition)) as (gw, client):
        async def send(rec, **over):
            body = {**rec["body"], "max_tokens": 3, **over}  # streamed, as opencode asks
            r = await client.post(rec["path"], json=body, headers={"x-session-id": session})
            assert r.status == 200 and "[DONE]" in await r.text()
            return r.headers["x-branch-id"]
        got = [await send(r) for r in ((title, turn) if order == "title_first" else (turn, title))]
        side = got[0] if order == "title_first" else got[1]
        assert side.startswith(f"{session}:side-") and session in got
        # the next turn (the reply, then a user message) extends the first turn: no compaction
        nxt = [*turn["body"]["messages"], {"role": "assistant", "content": "tok tok tok"},
               {"role": "user", "content": "and now?"}]
        assert await send(turn, messages=nxt) == session
        evs = await _events(bus)
    opened = {e.branch: (e.parent, e.mode, e.session) for e in evs if isinstance(e, BranchOpened)}
    assert opened == {session: (None, "root", session), side: (session, "subagent", session)}
    assert not [e for e in evs if isinstance(e, ContextCompacted)]
    subs = [(e.branch, e.version) for e in evs if isinstance(e, RequestSubmitted)]
    assert sorted(subs) == sorted([(session, 0), (session, 0), (side, 0)])
    assert [e.branch for e in evs if isinstance(e, BranchEnded)] == [side]
    assert gw.metrics.get("ei_gateway_side_requests_total") == 1
    assert gw.metrics.get("ei_gateway_compactions_total", reason="inferred") == 0


async def test_a_side_request_needs_an_agent_native_branch_a_tool_less_call_and_no_shared_prefix(partition):
    """Not side requests: ours (x-branch-id: a client that names its branches), a tool-less request
    that extends the session's prompt (a plain chat turn), one that shares the first block (a
    rewrite: compaction), a completions request. A tool-less client's first request on a new
    session is one, its second opens the session's own context."""
    bus = InMemoryBus(partition)
    sys_a = {"role": "system", "content": "You are agent A. " * 8}
    async with gateway(bus, MemoryTokens(partition)) as (_gw, client):
        async def chat(headers, msgs, tools=None):
            body = {"messages": msgs, "max_tokens": 2, **({"tools": tools} if tools else {})}
            r = await client.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status == 200, await r.text()
            return r.headers["x-branch-id"]
        ours = {"x-branch-id": "named"}
        assert await chat(ours, [sys_a, {"role": "user", "content": "x"}]) == "named"
        assert await chat(ours, [{"role": "system", "content": "Another thing entirely. " * 8}]) == "named"
        plain = {"x-session-id": "ses_plain"}  # a tool-less client using OpenCode's header
        first = await chat(plain, [sys_a, {"role": "user", "content": "one"}])
        assert first.startswith("ses_plain:side-")
        assert await chat(plain, [sys_a, {"role": "user", "content": "one"}]) == "ses_plain"
        two = [sys_a, {"role": "user", "content": "one"}, {"role": "assistant", "content": "ok"},
               {"role": "user", "content": "two"}]
        assert await chat(plain, two) == "ses_plain"  # extends: the session's turn
        assert await chat(plain, [sys_a, {"role": "user", "content": "rewritten " * 30}]) == "ses_plain"  # compaction
        r = await client.post("/v1/completions", json={"prompt": "z" * 200, "max_tokens": 2},
                              headers={"x-session-id": "ses_c"})
        assert r.headers["x-branch-id"] == "ses_c"
        evs = await _events(bus)
    assert [e.branch for e in evs if isinstance(e, ContextCompacted)] == ["named", "ses_plain"]
