"""Export to Mooncake JSONL and Dynamo's agentic Mooncake rows, and back: export then import gives
the same sessions as far as the target format can express them (docs/traces.md §3, "Export"),
checked on generated session trees (hypothesis), the bundled Mooncake trace and a Dynamo-style
agentic trace written by hand; plus --block-tokens and the rows' field names."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.traces.export import agentic_rows, export_sessions, mooncake_rows
from replay.traces.format import Branch, Compact, End, Fork, Request, Session, Spawn, validate_session
from replay.traces.importers.agentic import import_agentic_mooncake
from replay.traces.importers.mooncake import import_mooncake
from replay.traces.importers.spec import detect_format
from services.drivers.cli import main
from tests.hyp import examples

FIX = Path(__file__).resolve().parents[3] / "fixtures" / "traces"
MOON = FIX / "mooncake" / "synthetic_trace_head300.jsonl"


# --------------------------------------------------------------------------- canonical form
def _bfs(s: Session) -> list[Branch]:
    order = [s.branches[0].id]
    for bid in order:
        order += [x.branch for x in s.branch(bid).steps if isinstance(x, (Fork, Spawn))]
    return [s.branch(b) for b in order]


def canonical(sessions: list[Session]) -> list:
    """Sessions with block hashes renamed by first appearance, branches breadth first, trailing
    ``end`` steps dropped, times rounded to the microsecond and ``source`` left out (and a first
    request pinned at ``at_s = 0`` written as unpinned: both start with the session)."""
    names: dict[int, int] = {}

    def ren(blocks):
        return [names.setdefault(h, len(names)) for h in blocks]

    def t(x):
        return None if x is None else round(x, 6)

    out = []
    for s in sessions:
        branches = []
        for b in _bfs(s):
            steps = []
            for i, x in enumerate(b.steps):
                if isinstance(x, Request):
                    at = x.at_s
                    if i == 0 and b.mode == "root" and at == 0.0 and x.pause_s == 0.0:
                        at = None  # the session's first request at its start either way
                    steps.append(("req", ren(x.blocks), x.tail_tokens, x.output_tokens, t(x.pause_s), t(at),
                                  x.pause_kind))
                elif isinstance(x, Compact):
                    steps.append(("compact", ren(x.blocks)))
                elif isinstance(x, (Fork, Spawn)):
                    steps.append((type(x).__name__, x.branch, x.wait, t(x.pause_s)))
            branches.append((b.id, b.parent, b.mode, steps))
        out.append((s.id, s.block_tokens, t(s.start_s), branches))
    return out


# --------------------------------------------------------------------------- generated trees
BT = 16


@st.composite
def session_trees(draw, sid: str, *, tree: bool = True) -> Session:
    """A session the agentic format expresses exactly: forks/spawns after a request, with pause 0
    (the format folds spawn pauses into the child's first request); compactions between requests,
    naming the next prompt's blocks; tool or unknown pause kinds (no ``human``: not in the rows);
    the root's first request without pause when the session has a start time."""
    counter = iter(range(10**6))
    start = draw(st.one_of(st.none(), st.integers(0, 10**7).map(lambda ms: ms / 1000)))
    branches: list[Branch] = []

    def branch(bid: str, parent: str | None, mode: str, depth: int, base: list[int]) -> None:
        steps = []
        ctx = list(base)
        n = draw(st.integers(1, 4))
        kids = []
        for i in range(n):
            ctx = ctx + [next(counter) + 1 for _ in range(draw(st.integers(0 if i else 1, 3)))]
            if i and draw(st.booleans()) and draw(st.booleans()):
                ctx = [next(counter) + 1 for _ in range(draw(st.integers(1, 3)))]
                steps.append(Compact(blocks=list(ctx)))
            kind = draw(st.sampled_from(["", "tool"]))
            pause = 0.0 if (i == 0 and (parent is not None or start is not None)) else draw(
                st.integers(0, 10**6)).__truediv__(1000)
            if i == 0 and parent is not None:
                pause = draw(st.integers(0, 10**6)) / 1000
            steps.append(Request(blocks=list(ctx), tail_tokens=draw(st.integers(0, BT - 1)),
                                 output_tokens=draw(st.integers(0, 500)), pause_s=pause, pause_kind=kind))
            if tree and depth < 2:
                for _ in range(draw(st.integers(0, 2 if depth == 0 else 1))):
                    cid = f"b{next(counter)}"
                    sub = draw(st.booleans())
                    steps.append((Spawn if sub else Fork)(branch=cid, wait=draw(st.booleans()), pause_s=0.0))
                    kids.append((cid, "subagent" if sub else "fork", [] if sub else list(ctx)))
        steps.append(End())
        branches.append(Branch(id=bid, parent=parent, mode=mode, steps=steps))  # type: ignore[arg-type]
        for cid, m, b in kids:
            branch(cid, bid, m, depth + 1, b)

    branch("main", None, "root", 0, [])
    s = Session(id=sid, block_tokens=BT, start_s=start, branches=branches)
    s = msgspec.structs.replace(s, branches=_bfs(s))
    assert validate_session(s) == []
    return s


def _many(tree: bool):
    return st.integers(1, 4).flatmap(lambda n: st.tuples(*(session_trees(f"s{k}", tree=tree) for k in range(n))))


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sessions=_many(tree=True))
def test_agentic_export_then_import_gives_the_same_sessions(tmp_path, sessions):
    out = tmp_path / "a.jsonl"
    res = export_sessions(out, list(sessions), "agentic-mooncake")
    assert res.notes == [] and res.block_tokens == BT
    back = import_agentic_mooncake(out, block_tokens=BT)
    assert back.skipped == [] and back.notes == []
    assert canonical(back.sessions) == canonical(list(sessions))


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sessions=_many(tree=False))
def test_mooncake_export_then_import_gives_the_same_chains(tmp_path, sessions):
    """One-branch sessions without compactions: Mooncake rows keep everything but the pause
    kind (and the first pause of a session without a start time)."""
    def plain(s: Session) -> Session:
        steps = [x for x in s.branches[0].steps if not isinstance(x, Compact)]
        steps = [msgspec.structs.replace(x, pause_kind="", pause_s=0.0 if i == 0 else x.pause_s)
                 if isinstance(x, Request) else x for i, x in enumerate(steps)]
        return msgspec.structs.replace(s, branches=[msgspec.structs.replace(s.branches[0], steps=steps)])

    sessions = [plain(s) for s in sessions]
    out = tmp_path / "m.jsonl"
    export_sessions(out, sessions, "mooncake")
    back = import_mooncake(out, block_tokens=BT)
    assert back.skipped == []
    assert canonical(back.sessions) == canonical(sessions)


def test_the_bundled_mooncake_trace_survives_export_and_import(tmp_path):
    """299 inferred open-loop sessions: labelled rows come back as the same sessions (ids, blocks
    up to renaming, arrivals); the second import no longer infers (the rows say session_id)."""
    sessions = import_mooncake(MOON).sessions
    for fmt, imp in (("mooncake", import_mooncake), ("agentic-mooncake", import_agentic_mooncake)):
        out = tmp_path / f"{fmt}.jsonl"
        export_sessions(out, sessions, fmt)
        assert canonical(imp(out).sessions) == canonical(sessions), fmt


def test_multi_branch_sessions_in_plain_mooncake_are_one_chain_each():
    s = Session(id="x", block_tokens=4, start_s=2.0, branches=[
        Branch(id="main", steps=[Request(blocks=[1], output_tokens=3), Spawn(branch="k", wait=True),
                                 Request(blocks=[1, 2], tail_tokens=1, output_tokens=5, pause_s=1.5)]),
        Branch(id="k", parent="main", mode="subagent",
               steps=[Request(blocks=[9], output_tokens=1, pause_s=0.25)])])
    res = mooncake_rows([s])
    assert [(r.get("timestamp"), r.get("delay"), r["hash_ids"], r["input_length"]) for r in res.rows] == [
        (2000.0, None, [0], 4), (None, 250.0, [1], 4), (None, 1500.0, [0, 2, 3], 9)]
    assert any("serialized" in n for n in res.notes)


def test_agentic_rows_follow_dynamos_field_names_and_dependencies():
    s = Session(id="x", block_tokens=4, start_s=1.0, branches=[
        Branch(id="main", steps=[Request(blocks=[1], output_tokens=3), Spawn(branch="k", wait=True),
                                 Request(blocks=[1, 2], output_tokens=5, pause_s=2.0, pause_kind="tool")]),
        Branch(id="k", parent="main", mode="subagent",
               steps=[Request(blocks=[9], tail_tokens=2, output_tokens=1, pause_s=0.5),
                      Request(blocks=[9, 8], output_tokens=1, pause_s=0.1)])])
    rows = agentic_rows([s]).rows
    assert rows == [
        {"request_id": "x/main/0", "session_id": "x", "timestamp": 1000.0, "input_length": 4, "output_length": 3,
         "hash_ids": [0], "prefix_reset": True, "request_kind": "foreground", "branches": ["x/k/0"]},
        {"request_id": "x/main/2", "session_id": "x", "delay": 0.0, "tool_wait_ms": 2000.0, "input_length": 8,
         "output_length": 5, "hash_ids": [0, 1], "wait_for": ["x/main/0", "x/k/1"], "prefix_reset": False,
         "request_kind": "foreground"},
        {"request_id": "x/k/0", "session_id": "x/k", "delay": 500.0, "input_length": 6, "output_length": 1,
         "hash_ids": [2, 3], "wait_for": ["x/main/0"], "prefix_reset": True, "request_kind": "agent"},
        {"request_id": "x/k/1", "session_id": "x/k", "delay": 100.0, "input_length": 8, "output_length": 1,
         "hash_ids": [2, 4], "wait_for": ["x/k/0"], "prefix_reset": False, "request_kind": "agent"}]


def test_a_dynamo_agentic_trace_imports_as_a_session_tree(tmp_path):
    """Rows as Dynamo's lowering writes them (request_trace/agentic.rs): one session_id per agent
    thread, every first row prefix_reset, the sub-agent's first row waiting for the spawning
    request, the parent's join waiting for the sub-agent's last row, tool time apart."""
    rows = [
        {"request_id": "r1", "session_id": "main-agent", "input_length": 40, "output_length": 5,
         "hash_ids": [0, 1, 2], "request_kind": "foreground", "timestamp": 0.0, "branches": ["r2"],
         "prefix_reset": True},
        {"request_id": "r2", "session_id": "sub-1", "input_length": 20, "output_length": 7, "hash_ids": [7, 8],
         "request_kind": "agent", "timestamp": 900.0, "delay": 100.0, "wait_for": ["r1"], "prefix_reset": True},
        {"request_id": "r3", "session_id": "sub-1", "input_length": 36, "output_length": 2, "hash_ids": [7, 8, 9],
         "request_kind": "agent", "timestamp": 1900.0, "delay": 50.0, "tool_wait_ms": 250.0, "wait_for": ["r2"],
         "prefix_reset": False, "tool_events": [{"tool_call_id": "t", "tool_class": "bash", "started_at_unix_ms": 1,
                                                  "ended_at_unix_ms": 2, "duration_ms": 1.0, "status": "ok"}]},
        {"request_id": "r4", "session_id": "main-agent", "input_length": 48, "output_length": 3,
         "hash_ids": [0, 1, 2, 3], "request_kind": "foreground", "timestamp": 3000.0, "delay": 400.0,
         "wait_for": ["r1", "r3"], "prefix_reset": False},
    ]
    p = tmp_path / "dyn.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = import_agentic_mooncake(p, block_tokens=16)
    assert res.skipped == [] and res.notes == []
    (s,) = res.sessions
    assert (s.id, s.start_s, [b.id for b in s.branches]) == ("main-agent", 0.0, ["main", "sub-1"])
    main_steps, sub_steps = s.branches[0].steps, s.branches[1].steps
    assert isinstance(main_steps[1], Spawn) and main_steps[1].branch == "sub-1" and main_steps[1].wait
    r4 = main_steps[2]
    assert isinstance(r4, Request) and r4.pause_s == pytest.approx(0.4) and r4.tail_tokens == 0
    r2, r3 = sub_steps[0], sub_steps[1]
    assert r2.pause_s == pytest.approx(0.1) and r2.tail_tokens == 4 and len(r2.blocks) == 1
    assert r3.pause_s == pytest.approx(0.3) and r3.pause_kind == "tool"
    assert s.branches[1].mode == "subagent" and s.branches[1].parent == "main"
    # a wait_for naming no row is a bad record: skipped with --skip-bad, and so is what waits for it
    rows[1]["wait_for"] = ["nope"]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = import_agentic_mooncake(p, skip_bad=True, block_tokens=16)
    assert [(e.line, e.field) for e in res.skipped] == [(2, "wait_for"), (3, "wait_for"), (4, "wait_for")]
    assert [sum(1 for _ in x.requests()) for x in res.sessions] == [1]


def test_block_tokens_option_and_detection(tmp_path, capsys):
    rec = {"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1, 2, 3]}
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps(rec) + "\n")
    out = tmp_path / "o.jsonl"
    assert main(["trace", "import", "mooncake", str(p), "-o", str(out)]) == 1  # 3 ids at 512 tokens: bad
    assert "expect 0 or 1" in capsys.readouterr().err
    assert main(["trace", "import", "mooncake", str(p), "-o", str(out), "--block-tokens", "16"]) == 0
    (s,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert s["block_tokens"] == 16 and s["branches"][0]["steps"][0]["tail_tokens"] == 8
    assert main(["trace", "import", "weka", str(p), "-o", str(out), "--block-tokens", "16"]) == 1
    assert "block size is only given for mooncake" in capsys.readouterr().err
    ag = tmp_path / "a.jsonl"
    assert main(["trace", "export", "agentic-mooncake", str(out), "-o", str(ag)]) == 0
    assert "blocks of 16 tokens" in capsys.readouterr().out
    assert detect_format(ag) == "agentic-mooncake"  # told by content (request_id, wait_for, prefix_reset)
    assert main(["trace", "export", "mooncake", str(out), "-o", str(ag), "--block-tokens", "4"]) == 0
    assert "blocks of 4 tokens" in capsys.readouterr().out
    assert len(json.loads(ag.read_text().splitlines()[0])["hash_ids"]) == 10
