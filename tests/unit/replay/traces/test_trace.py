"""The session format: round trip, validation errors, closed-loop event cursor."""

from __future__ import annotations

import pytest

from events.catalog import BranchEnded, BranchOpened, ContextCompacted, RequestSubmitted
from replay.traces.format import (
    Branch,
    Compact,
    End,
    Fork,
    Request,
    Session,
    SessionCursor,
    Spawn,
    TraceFormatError,
    decode_session,
    encode_session,
    load_sessions,
    save_sessions,
    session_events,
)


def _session() -> Session:
    return Session(id="s1", branches=[
        Branch(id="main", steps=[
            Request(blocks=[1, 2], tail_tokens=3, output_tokens=10),
            Spawn(branch="a", wait=True, pause_s=2.0),
            Spawn(branch="b", wait=False, pause_s=1.0),
            Request(blocks=[1, 2, 3], output_tokens=5, pause_s=4.0),
            Fork(branch="f", pause_s=0.5),
            Compact(blocks=[9]),
            Request(blocks=[9, 10], output_tokens=5, pause_s=1.0),
            End(),
        ]),
        Branch(id="a", parent="main", mode="subagent", steps=[
            Request(blocks=[7], output_tokens=1), Request(blocks=[7, 8], output_tokens=1, pause_s=3.0)]),
        Branch(id="b", parent="main", mode="subagent", steps=[Request(blocks=[5], output_tokens=1)]),
        Branch(id="f", parent="main", mode="fork", steps=[Request(blocks=[1, 2, 3, 4], output_tokens=2)]),
    ])


def test_round_trip_file_and_directory(tmp_path):
    s = _session()
    assert decode_session(encode_session(s)) == s
    save_sessions(tmp_path / "d" / "a.jsonl", [s, s])
    save_sessions(tmp_path / "d" / "b.jsonl", [s])
    assert load_sessions(tmp_path / "d" / "a.jsonl") == [s, s]
    assert len(load_sessions(tmp_path / "d")) == 3


def test_closed_loop_timing_waits_and_ids():
    evs = session_events(_session(), 1.0)
    got = [(type(e).__name__, e.ts, getattr(e, "request", None) or e.branch) for e in evs]
    assert got == [
        ("BranchOpened", 0.0, "s1/main"),
        ("RequestSubmitted", 0.0, "s1/main/0"),
        ("BranchOpened", 3.0, "s1/a"),            # response done at 1 + pause 2
        ("RequestSubmitted", 3.0, "s1/a/0"),
        ("BranchOpened", 4.0, "s1/b"),            # 1 s after the previous spawn
        ("RequestSubmitted", 4.0, "s1/b/0"),
        ("BranchEnded", 5.0, "s1/b"),
        ("RequestSubmitted", 7.0, "s1/a/1"),
        ("BranchEnded", 8.0, "s1/a"),
        ("RequestSubmitted", 12.0, "s1/main/3"),  # waited for a (ended 8) + pause 4
        ("BranchOpened", 13.5, "s1/f"),
        ("RequestSubmitted", 13.5, "s1/f/0"),
        ("ContextCompacted", 13.5, "s1/main"),
        ("RequestSubmitted", 14.5, "s1/main/6"),
        ("BranchEnded", 14.5, "s1/f"),
        ("BranchEnded", 15.5, "s1/main"),
    ]
    sub = [e for e in evs if isinstance(e, RequestSubmitted)]
    assert sub[0].prompt_tokens == 2 * 64 + 3 and sub[0].max_tokens == 10
    assert [e.version for e in sub if e.branch == "s1/main"] == [0, 0, 1]
    comp = [e for e in evs if isinstance(e, ContextCompacted)]
    assert comp[0].version == 1 and comp[0].blocks == [9]
    modes = {e.branch: e.mode for e in evs if isinstance(e, BranchOpened)}
    assert modes == {"s1/main": "root", "s1/a": "subagent", "s1/b": "subagent", "s1/f": "fork"}
    assert sum(isinstance(e, BranchEnded) for e in evs) == 4


def test_slower_serving_stretches_the_session():
    fast = session_events(_session(), 1.0)[-1].ts
    slow = session_events(_session(), 5.0)[-1].ts
    assert slow > fast


def test_cursor_driver_api():
    cur = SessionCursor(_session(), prefix="run1:")
    evs = cur.start(100.0)
    assert [type(e).__name__ for e in evs] == ["BranchOpened", "RequestSubmitted"]
    assert cur.in_flight == ["run1:s1/main/0"]
    with pytest.raises(KeyError):
        cur.on_finished("nope", 101.0)
    evs = cur.on_finished("run1:s1/main/0", 101.0)
    assert evs[0].ts == 103.0 and not cur.done


def test_open_loop_at_s_never_overlaps_previous_response():
    s = Session(id="m", start_s=5.0, branches=[Branch(id="main", steps=[
        Request(blocks=[1], output_tokens=1, at_s=0.0),
        Request(blocks=[1, 2], output_tokens=1, at_s=2.0)])])
    ts = [e.ts for e in session_events(s, 1.0) if isinstance(e, RequestSubmitted)]
    assert ts == [5.0, 7.0]
    ts = [e.ts for e in session_events(s, 10.0) if isinstance(e, RequestSubmitted)]
    assert ts == [5.0, 15.0]


@pytest.mark.parametrize(("line", "field"), [
    (b'{"id":"x","branches":[{"id":"m","steps":[{"kind":"request","blocks":[1]}]}]}',
     "branches[0].steps[0]"),
    (b'{"id":"x","branches":[{"id":"m","steps":[{"kind":"request","blocks":[-1],"output_tokens":1}]}]}',
     "branches[0].steps[0].blocks"),
    ((b'{"id":"x","branches":[{"id":"m","steps":[{"kind":"request","blocks":[1],"output_tokens":1,'
     b'"tail_tokens":64}]}]}'), "branches[0].steps[0].tail_tokens"),
    ((b'{"id":"x","branches":[{"id":"m","steps":[{"kind":"request","blocks":[],"output_tokens":1},'
     b'{"kind":"spawn","branch":"c"}]},{"id":"c","parent":"m","mode":"subagent","steps":[]}]}'),
     "branches[1].steps"),
    (b'{"id":"x","branches":[{"id":"m","steps":[{"kind":"request","blocks":[1],"out', "(json)"),
])
def test_errors_name_file_line_field(tmp_path, line, field):
    p = tmp_path / "t.jsonl"
    good = encode_session(_session())
    p.write_bytes(good + b"\n" + line + b"\n" + good + b"\n")
    with pytest.raises(TraceFormatError) as ei:
        load_sessions(p)
    assert (ei.value.file, ei.value.line, ei.value.field) == (str(p), 2, field)
    assert f"{p}:2: {field}:" in str(ei.value)
    errors: list[TraceFormatError] = []
    assert len(load_sessions(p, errors)) == 2 and len(errors) == 1
