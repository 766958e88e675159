"""Raw Claude Code transcript importer on a small hand-written fixture in that format."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from replay.traces.format import Compact, Fork, Request, Spawn, TraceFormatError, validate_session
from replay.traces.importers._common import common_prefix
from replay.traces.importers.claude_code import approx_tokens, import_claude_code

CC = Path(__file__).resolve().parents[3] / "fixtures" / "traces" / "claude-code"
SID = "5f0c2a1e-7d3b-4c55-9a61-2f8e0b6c1d42"
MAIN = CC / "-home-dev-shop" / f"{SID}.jsonl"


def _session(src=CC):
    res = import_claude_code(src)
    assert not res.skipped and len(res.sessions) == 1
    s = res.sessions[0]
    assert validate_session(s) == [] and s.approximate and s.id == SID
    return s, res


def _records():
    return [json.loads(x) for x in MAIN.read_text().splitlines()]


def test_one_request_per_api_response_and_outputs_counted_once():
    s, _ = _session()
    recs = _records()
    ids = {r["message"]["id"] for r in recs if r["type"] == "assistant" and r["message"]["model"] != "<synthetic>"}
    main = [q for b in s.branches if b.mode != "subagent" for q in b.steps if isinstance(q, Request)]
    assert len(main) == len(ids) == 6
    # msg_01 is split over two records (thinking, tool_use): one request, output = max, not sum
    assert main[0].output_tokens == 120
    assert [q.output_tokens for q in main] == [120, 80, 200, 90, 70, 100]


def test_subagent_compaction_resume_and_pauses():
    s, _ = _session()
    ids = [(b.id, b.parent, b.mode) for b in s.branches]
    assert ids == [("main", None, "root"), ("main~1", "main", "fork"), ("agent-a1b2c3", "main", "subagent")]
    main, resumed, sub = s.branches
    kinds = [type(x).__name__ for x in main.steps]
    assert kinds == ["Request", "Request", "Spawn", "Request", "Request", "Fork", "End"]
    spawn = main.steps[2]
    assert isinstance(spawn, Spawn) and spawn.wait and spawn.pause_s == 1.0  # spawned 10:00:13
    # pauses from timestamps: submit = parent record's time, previous finish = last record's time
    assert [x.pause_s for x in main.steps if isinstance(x, Request)] == [0.0, 2.0, 1.0, 40.0]
    assert [type(x).__name__ for x in resumed.steps] == ["Request", "Compact", "Request", "End"]
    assert [x.pause_s for x in resumed.steps if isinstance(x, Request)] == [20.0, 36.0]
    assert resumed.steps[1].blocks == resumed.steps[2].blocks
    assert [x.pause_s for x in sub.steps if isinstance(x, Request)] == [0.0, 1.0]
    assert sum(isinstance(x, Compact) for b in s.branches for x in b.steps) == 1
    assert sum(isinstance(x, Fork) for b in s.branches for x in b.steps) == 1


def test_approximate_blocks_are_prefix_stable_and_sized_from_usage():
    s, res = _session()
    main = [x for x in s.branches[0].steps if isinstance(x, Request)]
    # the first prompt is sized to the real usage total (hidden prefix + visible text)
    assert len(main[0].blocks) * 64 + main[0].tail_tokens == 3 + 15000
    for a, b in itertools.pairwise(main):  # each continuation keeps the whole previous prefix
        assert common_prefix(a.blocks, b.blocks) == len(a.blocks)
    resumed = [x for x in s.branches[1].steps if isinstance(x, Request)]
    # the redo shares the prefix up to the older response, not the abandoned turn
    assert common_prefix(main[3].blocks, resumed[0].blocks) < len(main[3].blocks)
    assert common_prefix(main[2].blocks, resumed[0].blocks) == len(main[2].blocks)
    sub = [x for x in s.branches[2].steps if isinstance(x, Request)]
    assert common_prefix(main[0].blocks, sub[0].blocks) == 0  # fresh context, other model
    assert any("approximate tokenisation" in n for n in res.notes)
    assert len(approx_tokens("abcdefghi")) == 2


def _copy(tmp_path) -> Path:
    dst = tmp_path / "cc"
    shutil.copytree(CC, dst)
    return dst


def _edit(path: Path, lineno: int, fn) -> None:
    lines = path.read_text().splitlines()
    lines[lineno - 1] = fn(lines[lineno - 1])
    path.write_text("\n".join(lines) + "\n")


def _drop_usage(line: str) -> str:
    d = json.loads(line)
    del d["message"]["usage"]
    return json.dumps(d)


def _drop_uuid(line: str) -> str:
    d = json.loads(line)
    del d["uuid"]
    return json.dumps(d)


@pytest.mark.parametrize(("lineno", "fn", "field"), [
    (8, lambda line: line[: len(line) // 2], "(json)"),
    (10, _drop_usage, "message.usage"),
    (9, _drop_uuid, "uuid"),
])
def test_malformed_lines(tmp_path, lineno, fn, field):
    root = _copy(tmp_path)
    main = root / "-home-dev-shop" / f"{SID}.jsonl"
    _edit(main, lineno, fn)
    with pytest.raises(TraceFormatError) as ei:
        import_claude_code(root)
    assert (ei.value.file, ei.value.line, ei.value.field) == (str(main), lineno, field)
    res = import_claude_code(root, skip_bad=True)
    assert [(e.line, e.field) for e in res.skipped] == [(lineno, field)]
    assert len(res.sessions) == 1


def test_subagent_without_requests(tmp_path):
    root = _copy(tmp_path)
    sub = root / "-home-dev-shop" / SID / "subagents" / "agent-a1b2c3.jsonl"
    sub.write_text(sub.read_text().splitlines()[0] + "\n")  # only the task prompt, no response
    with pytest.raises(TraceFormatError) as ei:
        import_claude_code(root)
    assert (ei.value.file, ei.value.line, ei.value.field) == (str(sub), 1, "agentId")
    res = import_claude_code(root, skip_bad=True)
    assert len(res.skipped) == 1 and not any(isinstance(x, Spawn) for x in res.sessions[0].branches[0].steps)


def test_inline_sidechains_without_agent_id_are_told_apart(tmp_path):
    recs = _records()
    sub = [json.loads(x) for x in (CC / "-home-dev-shop" / SID / "subagents" / "agent-a1b2c3.jsonl")
           .read_text().splitlines()]
    second = []
    for r in sub:  # a second inline sidechain: same shape, other uuids and message ids
        r2 = json.loads(json.dumps(r).replace('"s-', '"t-').replace("msg_s", "msg_t"))
        second.append(r2)
    for r in sub + second:
        r.pop("agentId")
    path = tmp_path / f"{SID}.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs + sub + second) + "\n")
    res = import_claude_code(path)
    subs = [b for b in res.sessions[0].branches if b.mode == "subagent"]
    assert sorted(b.id for b in subs) == ["agent-s-1", "agent-t-1"]
    assert all(sum(isinstance(x, Request) for x in b.steps) == 2 for b in subs)
