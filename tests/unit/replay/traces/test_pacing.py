"""Pacing: recorded pauses kept, agent pacing caps human pauses (tool time kept), scale:X."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.traces.format import Branch, End, Request, Session, Spawn, validate_session
from replay.traces.pacing import HUMAN_CAP_S, TOOL_CAP_S, Pace, pace_session, parse_pace
from services.drivers.cli import main
from tests.hyp import examples


def _session(pauses, at=None):
    steps = [Request(blocks=[i + 1], output_tokens=5, pause_s=p, pause_kind=k,
                     at_s=None if at is None else at[i]) for i, (p, k) in enumerate(pauses)]
    return Session(id="s", branches=[
        Branch(id="main", steps=[*steps, Spawn(branch="a", pause_s=500.0), End()]),
        Branch(id="a", parent="main", mode="subagent", steps=[Request(blocks=[9], output_tokens=1, pause_s=0.0)])])


def _pauses(s):
    return [r.pause_s for _b, _i, r in s.requests()]


def test_parse():
    assert parse_pace("recorded") == Pace()
    assert parse_pace("agent") == Pace("agent", tool_cap_s=TOOL_CAP_S, human_cap_s=HUMAN_CAP_S)
    assert parse_pace("agent:30:5") == Pace("agent", tool_cap_s=30, human_cap_s=5)
    assert parse_pace("agent:5") == Pace("agent", tool_cap_s=5, human_cap_s=5)
    assert parse_pace("scale:0.5") == Pace("scale", factor=0.5)
    assert str(parse_pace("agent")) == "agent:60:10"
    for bad in ("fast", "scale", "scale:-1", "scale:x", "agent:1:2:3", "agent:-3"):
        with pytest.raises(ValueError, match="bad pace"):
            parse_pace(bad)


def test_agent_keeps_tool_time_and_caps_human_pauses():
    s = _session([(0.0, "human"), (8.0, "tool"), (300.0, "tool"), (1200.0, "human"), (4.0, "human"),
                  (90.0, "")])
    got = pace_session(s, parse_pace("agent"))
    assert _pauses(got)[:6] == [0.0, 8.0, TOOL_CAP_S, HUMAN_CAP_S, 4.0, TOOL_CAP_S]
    assert got.branches[0].steps[-2].pause_s == TOOL_CAP_S  # harness (spawn) time capped like a tool
    assert validate_session(got) == []
    assert pace_session(s, parse_pace("recorded")) is s


def test_scale_scales_pauses_and_pinned_times():
    s = _session([(0.0, "human"), (10.0, "tool")], at=[0.0, 40.0])
    got = pace_session(s, parse_pace("scale:0.5"))
    assert _pauses(got)[:2] == [0.0, 5.0]
    assert [r.at_s for _b, _i, r in got.requests()][:2] == [0.0, 20.0]
    assert pace_session(s, parse_pace("agent")).branches[0].steps[1].at_s == 40.0  # agent: pinned times kept


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1e5, allow_nan=False), st.sampled_from(["", "tool", "human"])),
                min_size=1, max_size=20),
       st.floats(0, 600), st.floats(0, 600))
def test_agent_pacing_invariants(pauses, tool_cap, human_cap):
    s = _session(pauses)
    got = pace_session(s, Pace("agent", tool_cap_s=tool_cap, human_cap_s=human_cap))
    for (p, kind), q in zip(pauses, _pauses(got)):
        cap = human_cap if kind == "human" else tool_cap
        assert q == pytest.approx(min(p, cap), abs=1e-3)  # never longer than recorded, below the cap kept
    # only pauses change: blocks, outputs and the branch tree stay
    assert [(r.blocks, r.output_tokens) for _b, _i, r in got.requests()] == \
        [(r.blocks, r.output_tokens) for _b, _i, r in s.requests()]


def test_replay_cli_takes_pace(capsys):
    assert main(["replay", "--stack", "static:4P5D", "--duration", "1m", "--warmup", "1m", "--agents", "20",
                 "--pace", "agent", "--no-progress"]) == 0
    assert "(pace agent:60:10)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["replay", "--pace", "bogus"])
    assert "bad pace 'bogus'" in capsys.readouterr().err


def test_agent_pace_keeps_unchanged_steps_and_changes_the_rest():
    """Steps whose pause the pace leaves as it is are kept (not copied); the others are the
    recorded pause capped, as before."""
    short = Request(blocks=[1], output_tokens=1, pause_s=5.0, pause_kind="tool")
    long = Request(blocks=[1, 2], output_tokens=1, pause_s=500.0, pause_kind="tool")
    human = Request(blocks=[1, 2, 3], output_tokens=1, pause_s=30.0, pause_kind="human")
    spawn = Spawn(branch="sub", pause_s=1.5)
    s = Session(id="s", branches=[Branch(id="main", steps=[short, spawn, long, human, End()]),
                                  Branch(id="sub", parent="main", mode="subagent", steps=[short])])
    got = pace_session(s, parse_pace("agent"))
    steps = got.branches[0].steps
    assert steps[0] is short and steps[1] is spawn
    assert steps[2].pause_s == 60.0 and steps[3].pause_s == 10.0 and steps[2].blocks == [1, 2]
