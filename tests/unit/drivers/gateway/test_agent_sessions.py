"""Sessions from the headers agents send: every header family, their precedence,
and the branch table's idle expiry (pure, exact; a hypothesis property for the TTL)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.catalog import BranchEnded, BranchOpened, RequestSubmitted
from services.cores.branches import BranchSignals, BranchStateError, BranchTable
from services.drivers.gateway.headers import FAMILIES, HeaderError, parse_branch_headers
from tests.hyp import examples

CC = {"x-claude-code-session-id": "sess"}


@pytest.mark.parametrize("headers, expected", [
    # Dynamo's trajectory names (newer) and session names (older)
    ({"x-dynamo-trajectory-id": "run:r", "x-dynamo-parent-trajectory-id": "run",
      "x-dynamo-trajectory-final": "true"},
     BranchSignals(branch="run:r", parent="run", mode="subagent", end=True, source="dynamo-trajectory")),
    ({"x-dynamo-trajectory-id": "t"}, BranchSignals(branch="t", source="dynamo-trajectory")),
    ({"x-dynamo-session-id": "s", "x-dynamo-session-final": "1"},
     BranchSignals(branch="s", end=True, source="dynamo")),
    # Claude Code: the session is the root; an agent id makes a sub-agent of the session ...
    (CC, BranchSignals(branch="sess", source="claude-code")),
    ({**CC, "x-claude-code-agent-id": "ag1"},
     BranchSignals(branch="ag1", parent="sess", mode="subagent", source="claude-code")),
    # ... or of its parent agent; an agent id equal to the session is the session itself
    ({**CC, "x-claude-code-agent-id": "ag2", "x-claude-code-parent-agent-id": "ag1"},
     BranchSignals(branch="ag2", parent="ag1", mode="subagent", source="claude-code")),
    ({**CC, "x-claude-code-agent-id": "sess"}, BranchSignals(branch="sess", source="claude-code")),
    ({**CC, "x-claude-code-agent-id": "ag1", "x-claude-code-parent-agent-id": "ag1"},
     BranchSignals(branch="ag1", parent="sess", mode="subagent", source="claude-code")),
    # a parent-agent header on the session's own requests is not a parent
    ({**CC, "x-claude-code-parent-agent-id": "zz"}, BranchSignals(branch="sess", source="claude-code")),
    # OpenCode: session and parent session
    ({"x-session-id": "oc2", "x-parent-session-id": "oc1"},
     BranchSignals(branch="oc2", parent="oc1", mode="subagent", source="opencode")),
    ({"x-session-id": "oc1"}, BranchSignals(branch="oc1", source="opencode")),
    ({"x-session-id": "oc1", "x-parent-session-id": "oc1"}, BranchSignals(branch="oc1", source="opencode")),
    # Codex: one session header
    ({"session-id": "cx"}, BranchSignals(branch="cx", source="codex")),
    # aiperf's multi-turn mode: both, one value per conversation; the affinity header wins
    ({"x-session-affinity": "conv-1", "x-correlation-id": "conv-1x"},
     BranchSignals(branch="conv-1", source="session-affinity")),
    ({"x-correlation-id": "c7", "x-dynamo-session-final": "true"},
     BranchSignals(branch="c7", end=True, source="correlation")),
    # opencode sends x-session-affinity equal to x-session-id: its own family names the branch
    ({"x-session-id": "ses_1", "x-session-affinity": "ses_1"}, BranchSignals(branch="ses_1", source="opencode")),
    # our mode header applies to an agent-native parent; any end header ends any family's branch
    ({"x-session-id": "oc2", "x-parent-session-id": "oc1", "x-branch-mode": "fork"},
     BranchSignals(branch="oc2", parent="oc1", mode="fork", source="opencode")),
    ({**CC, "x-dynamo-session-final": "true"}, BranchSignals(branch="sess", end=True, source="claude-code")),
    ({"session-id": "cx", "x-branch-end": "on", "x-context-compacted": "yes"},
     BranchSignals(branch="cx", end=True, compacted=True, source="codex")),
])
def test_each_family(headers, expected):
    assert parse_branch_headers(headers) == expected


ALL = {  # one branch (and parent) header set per family, in precedence order
    "ei": {"x-branch-id": "ei", "x-parent-branch-id": "ei-p"},
    "dynamo-trajectory": {"x-dynamo-trajectory-id": "dt", "x-dynamo-parent-trajectory-id": "dt-p"},
    "dynamo": {"x-dynamo-session-id": "ds", "x-dynamo-parent-session-id": "ds-p"},
    "claude-code": {"x-claude-code-session-id": "cc", "x-claude-code-agent-id": "cc-a"},
    "opencode": {"x-session-id": "oc", "x-parent-session-id": "oc-p"},
    "codex": {"session-id": "cx"},
    "session-affinity": {"x-session-affinity": "sa"},
    "correlation": {"x-correlation-id": "co"},
}
EXPECTED = {"ei": ("ei", "ei-p"), "dynamo-trajectory": ("dt", "dt-p"), "dynamo": ("ds", "ds-p"),
            "claude-code": ("cc-a", "cc"), "opencode": ("oc", "oc-p"), "codex": ("cx", None),
            "session-affinity": ("sa", None), "correlation": ("co", None)}


def test_the_documented_precedence_order():
    assert [f.source for f in FAMILIES] == list(ALL)


@pytest.mark.parametrize("present", [
    # every pair of families, and all of them, from each starting point
    *[(a, b) for i, a in enumerate(ALL) for b in list(ALL)[i + 1:]],
    *[tuple(list(ALL)[i:]) for i in range(len(ALL))],
])
def test_the_first_family_present_wins_and_the_others_are_ignored(present):
    headers = {k: v for fam in present for k, v in ALL[fam].items()}
    sig = parse_branch_headers(headers)
    winner = present[0]
    assert sig.source == winner
    assert (sig.branch, sig.parent) == EXPECTED[winner]


@pytest.mark.parametrize("headers, field", [
    ({"x-dynamo-parent-trajectory-id": "p"}, "x-dynamo-parent-trajectory-id"),
    ({"x-parent-session-id": "p"}, "x-parent-session-id"),
    ({"x-claude-code-agent-id": "a"}, "x-claude-code-agent-id"),
    ({"x-claude-code-parent-agent-id": "a"}, "x-claude-code-parent-agent-id"),
    ({"x-dynamo-trajectory-id": "t", "x-dynamo-parent-trajectory-id": "t"}, "x-dynamo-parent-trajectory-id"),
    ({"x-dynamo-trajectory-id": "t", "x-dynamo-trajectory-final": "soon"}, "x-dynamo-trajectory-final"),
    ({"x-claude-code-session-id": ""}, "x-claude-code-session-id"),
    ({"session-id": "c\x01x"}, "session-id"),
    ({"session-id": "cx", "x-branch-mode": "fork"}, "x-branch-mode"),
    ({"x-session-affinity": "a" * 257}, "x-session-affinity"),
    ({"x-correlation-id": "sa", "x-branch-mode": "subagent"}, "x-branch-mode"),
])
def test_errors_name_the_header(headers, field):
    with pytest.raises(HeaderError) as ei:
        parse_branch_headers(headers)
    assert ei.value.field == field


def test_lower_families_are_not_validated_when_a_higher_one_wins():
    # Codex's bare `session-id` with junk is ignored when our header names the branch
    assert parse_branch_headers({"x-branch-id": "b", "session-id": ""}).branch == "b"


# --------------------------------------------------------------------------- the table
def _admit(t: BranchTable, branch: str, ts: float, parent: str | None = None, n: int = 0):
    sig = BranchSignals(branch=branch, parent=parent, mode="subagent" if parent else "root", source="ei")
    return t.admit(sig, branch, f"{branch}/{n}", [1, 2], 133, 10, 64, ts)


def test_claude_code_session_with_a_subagent():
    t = BranchTable(src="gw", ttl_s=1800)
    a = t.admit(parse_branch_headers(CC), "sess", "sess/1", [1], 70, 8, 64, 1.0)
    sig = parse_branch_headers({**CC, "x-claude-code-agent-id": "ag"})
    b = t.admit(sig, "ag", "ag/2", [5], 70, 8, 64, 2.0)
    assert a.before == [BranchOpened(ts=1.0, src="gw", branch="sess", mode="root", session="sess")]
    assert b.before == [BranchOpened(ts=2.0, src="gw", branch="ag", parent="sess", mode="subagent",
                                     session="sess")]


def test_idle_branch_expires_with_one_idle_end_and_comes_back_under_a_new_id():
    t = BranchTable(src="gw", ttl_s=100)
    _admit(t, "root", 0.0)
    _admit(t, "kid", 10.0, parent="root")
    assert t.expire(100.0) == []           # idle exactly the TTL: not longer
    (x,) = t.expire(100.5)
    assert (x.branch, x.session, x.event) == ("root", "root",
                                               BranchEnded(ts=100.5, src="gw", branch="root", reason="idle"))
    assert t.expire(100.5) == []           # never twice
    assert [e.branch for e in t.expire(111.0)] == ["kid"]
    assert not t.open and not t.ended      # expired, not refused
    back = _admit(t, "root", 200.0, n=1)
    assert back.opened and back.before[0] == BranchOpened(ts=200.0, src="gw", branch="root~2", mode="root",
                                                          session="root")
    assert back.request.branch == "root~2" and back.request.version == 0
    kid = _admit(t, "kid2", 201.0, parent="root")
    assert kid.before[0].parent == "root~2" and kid.before[0].session == "root"
    assert t.end("root", 202.0) == BranchEnded(ts=202.0, src="gw", branch="root~2")
    with pytest.raises(BranchStateError):  # an explicit end is still final
        _admit(t, "root", 203.0)
    (y,) = t.expire(400.0)
    assert y.event.branch == "kid2"
    _admit(t, "kid2", 500.0)
    (z,) = t.expire(700.0)
    assert z.event.branch == "kid2~2"


def test_a_request_keeps_its_branch_alive_and_no_ttl_means_never():
    t = BranchTable(ttl_s=100)
    _admit(t, "a", 0.0)
    _admit(t, "b", 50.0)
    _admit(t, "a", 90.0, n=1)
    assert [x.branch for x in t.expire(160.0)] == ["b"]
    assert [x.branch for x in t.expire(191.0)] == ["a"]
    for ttl in (None, 0, -5):
        t = BranchTable(ttl_s=ttl)
        _admit(t, "a", 0.0)
        assert t.expire(1e12) == [] and "a" in t.open


def test_agent_hints_ride_on_request_submitted_and_stay_absent_otherwise():
    t = BranchTable()
    sig = BranchSignals(branch="b", source="ei")
    plain = t.admit(sig, "b", "b/0", [1], 70, 8, 64, 1.0).request
    hinted = t.admit(sig, "b", "b/1", [1], 70, 8, 64, 2.0, priority=3, osl=5).request
    assert plain == RequestSubmitted(ts=1.0, src="gateway", request="b/0", branch="b", blocks=[1],
                                     prompt_tokens=70, max_tokens=8)
    assert (hinted.priority, hinted.osl, hinted.expected_output_tokens(), hinted.queue_priority()) == (3, 5, 5, 3)
    assert plain.expected_output_tokens() == 8 and plain.queue_priority() == 0


# one step: (branch index, time advance in seconds)
steps = st.lists(st.tuples(st.integers(0, 4), st.floats(0, 250, allow_nan=False)), min_size=1, max_size=60)


@settings(max_examples=examples(200), deadline=None)
@given(steps=steps, ttl=st.sampled_from([30.0, 100.0, 200.0]))
def test_ttl_property(steps, ttl):
    """A branch is never expired while its requests arrive within the TTL of each other, and
    every expired branch (event id) gets exactly one end."""
    t = BranchTable(ttl_s=ttl)
    now = 0.0
    last: dict[str, float] = {}  # header id -> time of its latest request
    ends: list[str] = []
    for idx, dt in steps:
        now += dt
        branch = f"b{idx}"
        for x in t.expire(now):   # what the gateway does before each request
            assert now - last[x.branch] > ttl          # only branches idle past the TTL
            assert x.event.reason == "idle" and x.event.ts == now
            ends.append(x.event.branch)
        for b, seen in last.items():  # a branch whose latest request is within the TTL is open
            if now - seen <= ttl:
                assert b in t.open
        _admit(t, branch, now)
        last[branch] = now
    for x in t.expire(now + ttl + 1):  # the periodic tick, long after: the rest expire
        ends.append(x.event.branch)
    assert not t.open
    assert len(ends) == len(set(ends))  # exactly one end per expired event id
    assert {e.split("~")[0] for e in ends} == set(last)
