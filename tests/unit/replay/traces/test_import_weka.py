"""kv-cache-tester (weka) importer on the real fixtures: counts, blocks, pauses, rewrites."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from events.hashing import namespaced_hash
from replay.traces.format import (
    Compact,
    Fork,
    Request,
    Spawn,
    TraceFormatError,
    load_sessions,
    save_sessions,
    validate_session,
)
from replay.traces.importers.weka import import_weka

WEKA = Path(__file__).resolve().parents[3] / "fixtures" / "traces" / "weka-claude-code"


def _one(name: str):
    res = import_weka(WEKA / name)
    assert len(res.sessions) == 1 and not res.skipped
    s = res.sessions[0]
    assert validate_session(s) == []
    return s


def _source_threads(doc: dict) -> dict[str, list[dict]]:
    """Main-thread requests and each sub-agent's requests, straight from the JSON."""
    out: dict[str, list[dict]] = {"main": []}
    for r in doc["requests"]:
        if r["type"] == "subagent":
            out[r["agent_id"]] = list(r["requests"])
        else:
            out["main"].append(r)
    return out


def _imported_threads(s) -> dict[str, list[Request]]:
    out: dict[str, list[Request]] = {}
    for b in s.branches:
        out.setdefault(b.id.split("~")[0], []).extend(st for st in b.steps if isinstance(st, Request))
    return out


@pytest.mark.parametrize("name", ["trace_0504.json", "trace_0291.json", "trace_0202.json"])
def test_blocks_tokens_and_pauses_equal_the_source(name):
    doc = json.loads((WEKA / name).read_text())
    s = _one(name)
    src, got = _source_threads(doc), _imported_threads(s)
    assert set(src) == set(got)
    after_spawn = set()
    prev_sub = False
    for r in doc["requests"]:  # the first main request after sub-agents has a re-anchored pause
        if r["type"] == "subagent":
            prev_sub = True
        elif prev_sub:
            after_spawn.add(id(r))
            prev_sub = False
    for thread, reqs in src.items():
        assert len(got[thread]) == len(reqs)
        for r, q in zip(reqs, got[thread]):
            assert q.blocks == [namespaced_hash(f"weka:{doc['id']}", h) for h in r["hash_ids"]]
            assert len(q.blocks) * 64 + q.tail_tokens == r["in"]
            assert q.output_tokens == r["out"]
            if id(r) not in after_spawn:
                assert q.pause_s == r["think_time"]


def test_trace_0504_three_requests_and_a_resume():
    s = _one("trace_0504.json")
    assert sum(1 for _ in s.requests()) == 3
    main, resumed = s.branches
    assert [type(x).__name__ for x in main.steps] == ["Request", "Request", "Fork", "End"]
    assert (resumed.id, resumed.parent, resumed.mode) == ("main~1", "main", "fork")
    assert [x.pause_s for x in resumed.steps if isinstance(x, Request)] == [3058.0]


def test_trace_0291_main_thread_and_two_explore_subagents():
    s = _one("trace_0291.json")
    main = s.branches[0]
    assert sum(isinstance(x, Request) for x in main.steps) == 20
    spawns = [x for x in main.steps if isinstance(x, Spawn)]
    assert [x.branch for x in spawns] == ["agent_001", "agent_002"]
    subs = {b.id: b for b in s.branches if b.mode == "subagent"}
    assert {k: (b.label, sum(isinstance(x, Request) for x in b.steps)) for k, b in subs.items()} == {
        "agent_001": ("Explore", 5), "agent_002": ("Explore", 7)}
    # agent_001 ends at 1148.013 + 46.656 s, before the next main request (t=1209): waited;
    # agent_002 ends at 1180.553 + 79.184 s, after it: it ran in the background.
    assert [x.wait for x in spawns] == [True, False]
    assert spawns[0].pause_s == pytest.approx(1148.013 - (1085.0 + 15.64))
    assert spawns[1].pause_s == pytest.approx(1180.553 - 1148.013)
    reqs = [x for x in main.steps if isinstance(x, Request)]
    assert reqs[16].pause_s == pytest.approx(1209.0 - (1148.013 + 46.656))
    assert not any(isinstance(x, (Compact, Fork)) for b in s.branches for x in b.steps)


def test_trace_0202_compaction_at_3437_s():
    doc = json.loads((WEKA / "trace_0202.json").read_text())
    s = _one("trace_0202.json")
    assert sum(1 for _ in s.requests()) == 55
    comps = [(b.id, i) for b in s.branches for i, x in enumerate(b.steps) if isinstance(x, Compact)]
    assert len(comps) == 1
    bid, i = comps[0]
    steps = s.branch(bid).steps
    nxt, prev = steps[i + 1], [x for x in steps[:i] if isinstance(x, Request)][-1]
    assert len(prev.blocks) * 64 + prev.tail_tokens == 71099
    assert len(nxt.blocks) * 64 + nxt.tail_tokens == 19292
    assert steps[i].blocks == nxt.blocks
    src = next(r for r in doc["requests"] if r["t"] == 3437.0)
    assert nxt.blocks == [namespaced_hash("weka:trace_0202", h) for h in src["hash_ids"]]


def test_round_trip_through_the_session_format(tmp_path):
    res = import_weka(WEKA)
    assert [s.id for s in res.sessions] == ["trace_0202", "trace_0291", "trace_0504"]
    save_sessions(tmp_path / "w.jsonl", res.sessions)
    assert load_sessions(tmp_path / "w.jsonl") == res.sessions


def _mutated(tmp_path, mutate) -> Path:
    doc = json.loads((WEKA / "trace_0291.json").read_text())
    mutate(doc)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    return p


def _drop_subagent_requests(doc):
    next(r for r in doc["requests"] if r["type"] == "subagent")["requests"] = []


@pytest.mark.parametrize(("mutate", "field", "skipped_requests"), [
    (lambda d: d["requests"][3].pop("out"), "requests[3].out", 1),
    (lambda d: d["requests"][5].update(hash_ids="x"), "requests[5].hash_ids", 1),
    (_drop_subagent_requests, "requests[16].requests", 5),
])
def test_malformed_input_names_file_line_and_field(tmp_path, mutate, field, skipped_requests):
    p = _mutated(tmp_path, mutate)
    with pytest.raises(TraceFormatError) as ei:
        import_weka(p)
    assert (ei.value.file, ei.value.line, ei.value.field) == (str(p), 1, field)
    res = import_weka(p, skip_bad=True)
    assert [e.field for e in res.skipped] == [field]
    assert sum(1 for _ in res.sessions[0].requests()) == 32 - skipped_requests


def test_truncated_file(tmp_path):
    p = tmp_path / "cut.json"
    p.write_text((WEKA / "trace_0504.json").read_text()[:1000])
    with pytest.raises(TraceFormatError) as ei:
        import_weka(p)
    assert (ei.value.line, ei.value.field) == (1, "(json)")
    res = import_weka(tmp_path, skip_bad=True)
    assert res.sessions == [] and len(res.skipped) == 1
