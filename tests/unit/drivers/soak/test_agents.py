"""The agent load's pure parts (services/drivers/soak/agents.py): a session cut to its first
requests is still a valid session with the trace's structure, and the liveness watcher's
silences are refolded from a log's rows exactly."""

from __future__ import annotations

from replay.traces.format import Branch, End, Fork, Request, Session, Spawn, cut_session, validate_session
from services.drivers.soak.agents import agent_sessions, request_count, silences, summarize_silence
from services.drivers.up.testing import REPO


def _req(k: int) -> Request:
    return Request(blocks=list(range(k + 1)), output_tokens=10 + k)


def _session() -> Session:
    return Session(id="s", branches=[
        Branch(id="main", steps=[_req(0), Fork(branch="f"), _req(1), Spawn(branch="a"), _req(2), End()]),
        Branch(id="f", parent="main", mode="fork", steps=[_req(10), End()]),
        Branch(id="a", parent="main", mode="subagent", steps=[_req(20), _req(21), End()]),
    ])


def test_a_cut_keeps_the_first_requests_in_session_order_and_drops_children_cut_off():
    s = _session()
    assert [(b.id, b.steps) for b in cut_session(s, 2).branches] == [
        ("main", [_req(0), _req(1), End()])]  # no request left for the fork: gone with its Fork; the spawn too
    c = cut_session(s, 4)  # main's 3 requests, then the fork's
    assert [(b.id, [type(x).__name__ for x in b.steps]) for b in c.branches] == [
        ("main", ["Request", "Fork", "Request", "Request", "End"]), ("f", ["Request", "End"])]
    assert [(b.id, len(b.steps)) for b in cut_session(s, 9).branches] == [("main", 6), ("f", 2), ("a", 3)]
    for n in range(1, 8):
        assert validate_session(cut_session(s, n)) == []
        assert request_count([cut_session(s, n)])[0] == min(n, 6)


def test_the_bundled_load_fits_the_context_and_is_valid():
    ss = agent_sessions(str(REPO / "deploy" / "traces" / "calibration"), 30, 8)
    assert len(ss) == 30 and all(validate_session(s) == [] for s in ss)
    assert request_count(ss) == (223, 14_044_176)


def test_silences_are_what_the_watcher_sees_at_each_tick():
    rows = [("NodeRegistered", 0.0, "n1", "n1"), ("Tick", 1.0, None, "planner"),
            ("NodeHeartbeat", 0.5, "n1", "n1"), ("Tick", 2.0, None, "planner"),  # late by 0.5 s
            ("NodeHeartbeat", 2.5, "n1", "n1"), ("IterationDone", 3.0, "n1", "n1"),
            ("Tick", 6.0, None, "planner"), ("NodeRemoved", 6.0, "n1", "liveness"),
            ("Tick", 7.0, None, "planner"), ("NodeHeartbeat", 7.0, "n1", "n1")]  # unwatched once removed
    s = silences(rows)
    assert s.at_tick == {"n1": [1.0, 1.5, 3.0]}
    assert s.hb_late == {"n1": [0.5, 0.0]} and s.hb_gap == {"n1": [2.0]}
    out = summarize_silence(s)
    assert out["silence_at_tick_s"] == {"n": 3, "p50": 1.5, "p99": 3.0, "max": 3.0}
    assert out["silence_max_by_node_s"] == {"n1": 3.0}
