"""Branch headers -> signals, and the branch table's harness events (pure, exact)."""

from __future__ import annotations

import json

import pytest

from events.catalog import BranchOpened, ContextCompacted
from services.cores.branches import BranchSignals, BranchStateError, BranchTable, extends
from services.drivers.gateway.headers import HeaderError, parse_branch_headers


@pytest.mark.parametrize("headers, expected", [
    ({}, BranchSignals(branch=None)),
    ({"x-branch-id": "b1"}, BranchSignals(branch="b1", source="ei")),
    ({"x-branch-id": "b2", "x-parent-branch-id": "b1", "x-branch-mode": "fork"},
     BranchSignals(branch="b2", parent="b1", mode="fork", source="ei")),
    ({"x-branch-id": "b2", "x-parent-branch-id": "b1", "x-branch-mode": "SubAgent"},
     BranchSignals(branch="b2", parent="b1", mode="subagent", source="ei")),
    ({"x-branch-id": "b2", "x-parent-branch-id": "b1"},
     BranchSignals(branch="b2", parent="b1", mode="subagent", source="ei")),
    ({"x-branch-id": "b1", "x-branch-end": "true", "x-context-compacted": "1"},
     BranchSignals(branch="b1", end=True, compacted=True, source="ei")),
    ({"x-dynamo-session-id": "run:r", "x-dynamo-parent-session-id": "run",
      "x-dynamo-session-final": "TRUE"},
     BranchSignals(branch="run:r", parent="run", mode="subagent", end=True, source="dynamo")),
    # ours win over Dynamo's, and a Dynamo parent is not mixed into our branch
    ({"x-branch-id": "b1", "x-dynamo-session-id": "d1", "x-dynamo-parent-session-id": "d0"},
     BranchSignals(branch="b1", source="ei")),
    ({"x-branch-end": "yes"}, BranchSignals(branch=None, end=True)),
    ({"x-branch-id": "b1", "x-branch-end": "false"}, BranchSignals(branch="b1", source="ei")),
])
def test_parse(headers, expected):
    assert parse_branch_headers(headers) == expected


@pytest.mark.parametrize("headers, field", [
    ({"x-branch-id": "b2", "x-parent-branch-id": "b1", "x-branch-mode": "clone"}, "x-branch-mode"),
    ({"x-branch-id": "b2", "x-branch-mode": "fork"}, "x-branch-mode"),
    ({"x-branch-id": "b1", "x-branch-end": "maybe"}, "x-branch-end"),
    ({"x-branch-id": "b1", "x-context-compacted": "2"}, "x-context-compacted"),
    ({"x-branch-id": ""}, "x-branch-id"),
    ({"x-branch-id": "b" * 300}, "x-branch-id"),
    ({"x-branch-id": "b1", "x-parent-branch-id": "b1"}, "x-parent-branch-id"),
    ({"x-parent-branch-id": "b1"}, "x-parent-branch-id"),
    ({"x-branch-mode": "fork"}, "x-branch-mode"),
    ({"x-dynamo-session-final": "nope", "x-dynamo-session-id": "s"}, "x-dynamo-session-final"),
])
def test_parse_errors_name_the_header(headers, field):
    with pytest.raises(HeaderError) as ei:
        parse_branch_headers(headers)
    assert ei.value.field == field


def test_extends():
    assert extends([], [1, 2])
    assert extends([1, 2], [1, 2])
    assert extends([1, 2], [1, 2, 3])
    assert not extends([1, 2], [1, 3, 4])
    assert not extends([1, 2, 3], [1, 2])


def _admit(t: BranchTable, sig: BranchSignals, blocks, n: int = 0, ts: float = 1.0):
    branch = sig.branch or f"anon{n}"
    return t.admit(sig, branch, f"{branch}/{n}", blocks, len(blocks) * 64 + 5, 10, 64, ts)


def test_first_request_opens_the_branch_and_later_ones_do_not():
    t = BranchTable(src="gw")
    sig = BranchSignals(branch="root", source="ei")
    a = _admit(t, sig, [1, 2], 0)
    assert a.before == [BranchOpened(ts=1.0, src="gw", branch="root", parent=None, mode="root", session="root")]
    assert a.opened and not a.end_after and a.compaction == ""
    assert (a.request.request, a.request.version, a.request.blocks, a.request.prompt_tokens) == (
        "root/0", 0, [1, 2], 133)
    b = _admit(t, sig, [1, 2, 3], 1)
    assert b.before == [] and not b.opened and b.request.version == 0


def test_child_joins_the_parent_session_with_its_mode():
    t = BranchTable(src="gw")
    _admit(t, BranchSignals(branch="root", source="ei"), [1])
    a = _admit(t, BranchSignals(branch="kid", parent="root", mode="fork", source="ei"), [1, 2])
    assert a.before == [BranchOpened(ts=1.0, src="gw", branch="kid", parent="root", mode="fork", session="root")]
    grand = _admit(t, BranchSignals(branch="g", parent="kid", mode="subagent", source="ei"), [9])
    assert grand.before[0].session == "root" and grand.before[0].mode == "subagent"


@pytest.mark.parametrize("second_blocks, header, reason", [
    ([1, 2, 3], False, ""),          # grew: no compaction
    ([1, 2], False, ""),             # same prompt (a retry): no compaction
    ([7, 8], False, "inferred"),     # rewritten
    ([1], False, "inferred"),        # shrank
    ([1, 2, 3], True, "header"),     # the header wins even when the prompt grew
])
def test_compaction_rule(second_blocks, header, reason):
    t = BranchTable(src="gw")
    _admit(t, BranchSignals(branch="b", source="ei"), [1, 2])
    a = _admit(t, BranchSignals(branch="b", compacted=header, source="ei"), second_blocks, 1, ts=2.0)
    assert a.compaction == reason
    if reason:
        assert a.before == [ContextCompacted(ts=2.0, src="gw", branch="b", version=1, blocks=second_blocks)]
        assert a.request.version == 1
    else:
        assert a.before == [] and a.request.version == 0


def test_compaction_compares_with_the_latest_prompt():
    t = BranchTable()
    sig = BranchSignals(branch="b", source="ei")
    _admit(t, sig, [1, 2])
    assert _admit(t, sig, [5], 1).compaction == "inferred"
    assert _admit(t, sig, [5, 6], 2).compaction == ""
    assert _admit(t, sig, [5, 6, 7], 3).request.version == 1


def test_header_on_first_request_does_not_compact():
    t = BranchTable()
    a = _admit(t, BranchSignals(branch="b", compacted=True, source="ei"), [1])
    assert a.compaction == "" and a.request.version == 0


def test_end_and_refusal_of_an_ended_branch():
    t = BranchTable(src="gw")
    sig = BranchSignals(branch="b", end=True, source="ei")
    a = _admit(t, sig, [1])
    assert a.end_after
    ev = t.end("b", 3.0)
    assert ev is not None and (ev.branch, ev.ts, ev.src) == ("b", 3.0, "gw")
    assert t.end("b", 4.0) is None
    with pytest.raises(BranchStateError):
        _admit(t, BranchSignals(branch="b", source="ei"), [1])


def test_headerless_request_is_a_one_request_branch():
    t = BranchTable()
    a = _admit(t, BranchSignals(branch=None), [1], 7)
    assert a.end_after and a.before[0].mode == "root" and a.before[0].branch == "anon7"


def test_ended_memory_is_bounded():
    t = BranchTable(max_ended=2)
    for i in range(3):
        _admit(t, BranchSignals(branch=f"b{i}", source="ei"), [1])
        t.end(f"b{i}", 1.0)
    assert list(t.ended) == ["b1", "b2"]


def test_scaled_clock():
    import time

    from services.drivers.gateway.config import scaled_clock

    assert scaled_clock(1.0, None) is time.time
    e = time.time() - 100.0
    c = scaled_clock(10.0, e)
    assert c() - e >= 1000.0  # 100 wall seconds since the epoch are >= 1000 model seconds


# Found by bad input at the gateway (docs/gateway.md, "OpenAPI description and fuzzing"): aiohttp
# keeps header bytes that are not UTF-8 as lone surrogates ("\xff\xfe" -> "\udcff\udcfe"); such
# an id reached events.wire.token_key (500) or the bus encoder (503) instead of being a 400.
@pytest.mark.parametrize("headers, field", [
    ({"x-branch-id": "\udcff\udcfe"}, "x-branch-id"),
    ({"x-claude-code-session-id": "\udc80"}, "x-claude-code-session-id"),
    ({"session-id": "\udcff"}, "session-id"),
    ({"x-branch-id": "a", "x-parent-branch-id": "\udcc3"}, "x-parent-branch-id"),
    ({"x-claude-code-session-id": "s", "x-claude-code-agent-id": "a\udcff"}, "x-claude-code-agent-id"),
])
def test_regression_ids_that_are_not_utf8_are_refused(headers, field):
    with pytest.raises(HeaderError, match="not valid UTF-8") as ei:
        parse_branch_headers(headers)
    assert ei.value.field == field


def test_utf8_ids_are_fine():
    assert parse_branch_headers({"x-branch-id": "é/ü"}).branch == "é/ü"


# ----------------------------------------------------------------------------- Codex's sub-agents
def _codex(thread: str, parent: str | None = None, session: str = "s1") -> dict:
    meta = {"agent_name": "/root" if parent is None else "/root/x", "thread_id": thread}
    if parent is not None:
        meta["parent_thread_id"] = parent
    return {"session-id": session, "thread-id": thread, "x-codex-turn-metadata": json.dumps(meta)}


@pytest.mark.parametrize("headers, expected", [
    # the root agent: its thread is the session
    (_codex("s1"), BranchSignals(branch="s1", source="codex")),
    ({"session-id": "s1"}, BranchSignals(branch="s1", source="codex")),
    # a sub-agent (Codex 0.171, measured): its own thread, the parent thread in the turn metadata
    (_codex("t2", parent="s1"), BranchSignals(branch="t2", parent="s1", mode="subagent", source="codex")),
    # a sub-agent of a sub-agent
    (_codex("t3", parent="t2"), BranchSignals(branch="t3", parent="t2", mode="subagent", source="codex")),
    # no (readable) metadata: under the session
    ({"session-id": "s1", "thread-id": "t2"}, BranchSignals(branch="t2", parent="s1", mode="subagent", source="codex")),
    ({"session-id": "s1", "thread-id": "t2", "x-codex-turn-metadata": "not json"},
     BranchSignals(branch="t2", parent="s1", mode="subagent", source="codex")),
    ({"session-id": "s1", "thread-id": "t2", "x-codex-turn-metadata": '{"parent_thread_id": "a\\u0001b"}'},
     BranchSignals(branch="t2", parent="s1", mode="subagent", source="codex")),
    # a lone thread-id is no sign of Codex (another client's generic header): no branch, no error
    ({"thread-id": "t2"}, BranchSignals(branch=None)),
])
def test_codexs_threads(headers, expected):
    assert parse_branch_headers(headers) == expected


def test_a_codex_sub_agent_joins_the_session_under_its_parent():
    t = BranchTable(src="gw")
    _admit(t, parse_branch_headers(_codex("s1")), [1, 2], 0)
    a = _admit(t, parse_branch_headers(_codex("t2", parent="s1")), [7], 1)
    assert a.before == [BranchOpened(ts=1.0, src="gw", branch="t2", parent="s1", mode="subagent", session="s1")]
    assert a.compaction == ""  # its own context: the session's prompt is not rewritten


# ----------------------------------------------------------------------------- side requests
def test_side_requests_run_on_their_own_branch_and_leave_the_sessions_context_alone():
    t = BranchTable(src="gw")
    cc = BranchSignals(branch="cc", source="claude-code")
    # Claude Code's first request is its turn, with or without tools (only OpenCode sends a side call first)
    first = t.admit(cc, "cc", "cc/i-1", [1, 2, 3], 200, 10, 64, 1.0, tools=False)
    assert not first.side and first.request.branch == "cc"
    # a tool-less call sharing no first block: a side branch, no compaction, ended after its answer
    side = t.admit(cc, "cc", "cc/i-2", [9, 8], 130, 10, 64, 2.0, tools=False)
    assert side.side and side.end_after and side.compaction == "" and side.branch == "cc:side-i-2"
    assert side.before == [BranchOpened(ts=2.0, src="gw", branch="cc:side-i-2", parent="cc", mode="subagent",
                                        session="cc")]
    assert (side.request.branch, side.request.version) == ("cc:side-i-2", 0)
    assert t.open["cc"].blocks == [1, 2, 3] and t.open["cc"].version == 0
    # the session's next turn extends its own prompt: no compaction
    assert t.admit(cc, "cc", "cc/i-3", [1, 2, 3, 4], 260, 10, 64, 3.0, tools=True).compaction == ""
    # not side requests: with tools (a rewrite: compaction), a shared first block, a completions request
    assert t.admit(cc, "cc", "cc/i-4", [7], 70, 10, 64, 4.0, tools=True).compaction == "inferred"
    assert t.admit(cc, "cc", "cc/i-5", [7, 5], 130, 10, 64, 5.0, tools=False).compaction == ""
    assert t.admit(cc, "cc", "cc/i-6", [6], 70, 10, 64, 6.0, tools=None).compaction == "inferred"
    # OpenCode: a tool-less first request is a side request of the session it opens
    oc = BranchSignals(branch="ses", source="opencode")
    a = t.admit(oc, "ses", "ses/i-7", [3], 70, 10, 64, 7.0, tools=False)
    assert a.side and a.opened and [type(e).__name__ for e in a.before] == ["BranchOpened", "BranchOpened"]
    b = t.admit(oc, "ses", "ses/i-8", [4, 5], 130, 10, 64, 8.0, tools=True)
    assert not b.side and b.compaction == "" and not b.before  # the session's first turn
    # ours and Dynamo's never
    ei = BranchSignals(branch="e", source="ei")
    t.admit(ei, "e", "e/1", [1], 70, 10, 64, 9.0, tools=True)
    assert t.admit(ei, "e", "e/2", [2], 70, 10, 64, 9.0, tools=False).compaction == "inferred"
