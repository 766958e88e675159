"""Importers on real data as people keep it: gzipped kv-cache-tester sessions, missing fields,
sub-agent spawns without a wait flag; and clear one-line errors for empty/binary/gzip input."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from replay.traces.format import Request, Spawn, TraceFormatError, validate_session
from replay.traces.importers.claude_code import import_claude_code
from replay.traces.importers.mooncake import import_mooncake
from replay.traces.importers.weka import import_weka
from services.drivers.cli import main

ROOT = Path(__file__).resolve().parents[4]
CAL = ROOT / "tests" / "fixtures" / "traces" / "weka-claude-code-calibration"
WEKA = ROOT / "tests" / "fixtures" / "traces" / "weka-claude-code"
# a few calibration sessions: sub-agents (0003), requests without think_time (0058, 0214)
FEW = ["trace_0003.json.gz", "trace_0058.json.gz", "trace_0214.json.gz"]


def _doc(requests):
    return {"id": "t", "block_size": 64, "hash_id_scope": "local", "requests": requests}


def _req(t, n_blocks, **kw):
    r = {"t": t, "type": "n", "in": n_blocks * 64 + 5, "out": 10, "hash_ids": list(range(1, n_blocks + 1)),
         "input_types": ["tool_result"], "api_time": 1.0, "think_time": 2.0}
    r.update(kw)
    return r


def _write(tmp_path, doc, name="t.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


# --------------------------------------------------------------------------- gzip
def test_gz_file_imports_exactly_like_its_plain_text(tmp_path):
    src = WEKA / "trace_0291.json"
    gz = tmp_path / "trace_0291.json.gz"
    gz.write_bytes(gzip.compress(src.read_bytes()))
    a, b = import_weka(src).sessions, import_weka(gz).sessions
    assert a[0].branches == b[0].branches and b[0].id == "trace_0291"
    assert b[0].source == "weka:trace_0291.json.gz"
    odd = tmp_path / "renamed.json"  # gzip told by content, not by name
    odd.write_bytes(gz.read_bytes())
    assert import_weka(odd).sessions[0].branches == a[0].branches


def test_a_directory_of_real_gz_sessions(tmp_path):
    for f in FEW:
        shutil.copy(CAL / f, tmp_path / f)
    shutil.copy(CAL / "LICENSE", tmp_path / "LICENSE")  # not a trace: ignored
    res = import_weka(tmp_path)  # strict: real sessions must import without --skip-bad
    assert not res.skipped and [s.id for s in res.sessions] == ["trace_0003", "trace_0058", "trace_0214"]
    for s in res.sessions:
        assert validate_session(s) == []
    docs = {f: json.loads(gzip.decompress((CAL / f).read_bytes())) for f in FEW}
    for s, f in zip(res.sessions, FEW):
        n_src = sum(1 for r in docs[f]["requests"] if r.get("type") != "subagent") + sum(
            len(r["requests"]) for r in docs[f]["requests"] if r.get("type") == "subagent")
        assert sum(1 for _ in s.requests()) == n_src
    assert sum(isinstance(st, Spawn) for b in res.sessions[0].branches for st in b.steps) == 2


def test_missing_think_time_is_the_gap_since_the_previous_response():
    doc = json.loads(gzip.decompress((CAL / "trace_0214.json.gz").read_bytes()))
    s = import_weka(CAL / "trace_0214.json.gz").sessions[0]
    reqs = [r for _b, _i, r in s.requests()]
    src = doc["requests"]
    assert "think_time" not in src[1] and "api_time" not in src[0]
    assert reqs[1].pause_s == pytest.approx(src[1]["t"] - src[0]["t"])  # no api_time: counts from t
    assert reqs[4].pause_s == src[4]["think_time"]


def test_pause_kind_from_input_types(tmp_path):
    doc = _doc([_req(0, 3, input_types=["text"], think_time=0.0), _req(5, 4),
                _req(60, 5, input_types=["text"]), _req(70, 6, input_types=["text", "tool_result", "tool_use"]),
                {k: v for k, v in _req(80, 7).items() if k != "input_types"}])
    s = import_weka(_write(tmp_path, doc)).sessions[0]
    assert [r.pause_kind for _b, _i, r in s.requests()] == ["human", "tool", "human", "tool", ""]


# --------------------------------------------------------------------------- spawns without a wait flag
def _sub(t, agent, reqs, **kw):
    d = {"t": t, "type": "subagent", "agent_id": agent, "subagent_type": "Explore", "requests": reqs}
    d.update(kw)
    return d


@pytest.mark.parametrize("skip_bad", [False, True])
def test_spawns_without_duration_or_next_request_import(tmp_path, skip_bad):
    doc = _doc([
        _req(0, 3),
        _sub(10, "a1", [_req(0, 2), _req(5, 3)]),                    # no duration_ms: ends at its last response
        _sub(11, "a2", [_req(0, 2)], duration_ms=None),              # null duration_ms
        _req(30, 6),
        _sub(40, "a3", [_req(0, 2)], duration_ms=1000),              # the last entry: no next request
    ])
    res = import_weka(_write(tmp_path, doc), skip_bad=skip_bad)
    assert not res.skipped
    (s,) = res.sessions
    assert validate_session(s) == []
    spawns = [st for st in s.branches[0].steps if isinstance(st, Spawn)]
    # a1 ends at 10 + 5 + 1 (api) = 16 and a2 at 11 + 0 + 1 = 12, both before t=30: waited;
    # a3 has no later parent request: the parent ends after it
    assert [(x.branch, x.wait) for x in spawns] == [("a1", True), ("a2", True), ("a3", True)]


def test_background_spawn_is_not_waited(tmp_path):
    doc = _doc([_req(0, 3), _sub(10, "bg", [_req(0, 2)], duration_ms=500_000), _req(30, 6)])
    (s,) = import_weka(_write(tmp_path, doc)).sessions
    assert [x.wait for x in s.branches[0].steps if isinstance(x, Spawn)] == [False]


def test_a_subagent_whose_requests_are_all_bad(tmp_path):
    bad = {k: v for k, v in _req(0, 2).items() if k != "out"}
    doc = _doc([_req(0, 3), _sub(10, "a1", [bad], duration_ms=100), _req(30, 6)])
    p = _write(tmp_path, doc)
    with pytest.raises(TraceFormatError) as ei:
        import_weka(p)
    assert ei.value.field == "requests[1].requests[0].out"
    res = import_weka(p, skip_bad=True)  # skipped: the sub-agent (and its spawn) go, the session stays
    (s,) = res.sessions
    assert validate_session(s) == [] and [b.id for b in s.branches] == ["main"]
    assert [e.field for e in res.skipped] == ["requests[1].requests[0].out", "requests"]
    assert "sub-agent 'a1' kept no usable request" in res.skipped[1].message


def test_bad_duration_is_a_clean_error_not_a_crash(tmp_path):
    doc = _doc([_req(0, 3), _sub(10, "a1", [_req(0, 2)], duration_ms="soon"), _req(30, 6)])
    p = _write(tmp_path, doc)
    with pytest.raises(TraceFormatError, match="duration_ms"):
        import_weka(p)
    res = import_weka(p, skip_bad=True)
    assert len(res.skipped) == 1 and all(isinstance(r, Request) for _b, _i, r in res.sessions[0].requests())


# --------------------------------------------------------------------------- one-line errors
@pytest.mark.parametrize(("content", "why"), [
    (b"", "empty file"),
    (b"\n  \n", "empty file"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary data"),
    (b"\xff\xfe{\x00\"\x00", "binary data"),
])
@pytest.mark.parametrize("importer", [import_weka, import_mooncake, import_claude_code])
def test_empty_and_binary_input_is_one_clear_error(tmp_path, importer, content, why):
    p = tmp_path / "in.jsonl"
    p.write_bytes(content)
    with pytest.raises(TraceFormatError) as ei:
        importer(p)
    assert (ei.value.field, ei.value.line) == ("(file)", 0) and why in ei.value.message
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("importer", [import_mooncake, import_claude_code])
def test_gzip_where_text_is_expected(tmp_path, importer):
    p = tmp_path / "m.jsonl.gz"
    p.write_bytes(gzip.compress(b'{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}\n'))
    with pytest.raises(TraceFormatError, match="gzip-compressed data, not JSONL text"):
        importer(p)


def test_corrupt_gzip(tmp_path):
    p = tmp_path / "t.json.gz"
    p.write_bytes(gzip.compress((WEKA / "trace_0504.json").read_bytes())[:200])
    with pytest.raises(TraceFormatError, match="corrupt gzip data"):
        import_weka(p)


@pytest.mark.parametrize("fmt", ["weka", "mooncake", "claude-code"])
def test_cli_empty_input_exits_non_zero_with_one_line(tmp_path, capsys, fmt):
    p = tmp_path / "empty.jsonl"
    p.write_bytes(b"")
    out = tmp_path / "o.jsonl"
    assert main(["trace", "import", fmt, str(p), "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "empty file" in err[0] and str(p) in err[0]
    # with --skip-bad the file is skipped, and importing nothing at all is still an error
    assert main(["trace", "import", fmt, str(p), "-o", str(out), "--skip-bad"]) == 1
    cap = capsys.readouterr()
    assert "wrote 0" not in cap.out and "no session imported" in cap.err
    assert not out.exists()


def test_cli_gz_and_binary_one_line(tmp_path, capsys):
    gz = tmp_path / "m.jsonl"
    gz.write_bytes(gzip.compress(b"{}\n"))
    assert main(["trace", "import", "mooncake", str(gz), "-o", str(tmp_path / "o.jsonl")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gzip-compressed" in err[0]
    assert main(["trace", "stats", "--from", "mooncake", str(gz)]) == 1
    assert "gzip-compressed" in capsys.readouterr().err
