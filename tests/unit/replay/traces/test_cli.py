"""`evolving trace import|stats|generate` end to end on the real fixtures."""

from __future__ import annotations

import json
from pathlib import Path

from replay.traces.format import load_sessions
from replay.traces.importers.weka import import_weka
from replay.traces.stats import trace_stats
from services.drivers.cli import main

FIX = Path(__file__).resolve().parents[3] / "fixtures" / "traces"


def test_import_then_stats_json(tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    assert main(["trace", "import", "weka", str(FIX / "weka-claude-code"), "-o", str(out)]) == 0
    assert "wrote 3 session(s), 90 request(s)" in capsys.readouterr().out
    assert main(["trace", "stats", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = trace_stats(load_sessions(out))
    assert got["requests"] == want.requests == 90
    assert (got["subagents"], got["compactions"], got["sessions"]) == (2, 1, 3)
    assert got["ideal_hit_rate"] == want.ideal_hit_rate


def test_stats_text_on_each_real_fixture(capsys):
    for name, requests, subs, comps in [("trace_0504.json", 3, 0, 0), ("trace_0291.json", 32, 2, 0),
                                        ("trace_0202.json", 55, 0, 1)]:
        assert main(["trace", "stats", "--from", "weka", str(FIX / "weka-claude-code" / name)]) == 0
        text = capsys.readouterr().out
        assert f"requests {requests} " in text and f"sub-agents {subs} " in text
        assert f"compactions {comps}" in text
        st = trace_stats(import_weka(FIX / "weka-claude-code" / name).sessions)
        assert f"= {st.ideal_hit_rate:.1%}" in text
    assert main(["trace", "stats", "--from", "mooncake", str(FIX / "mooncake" / "synthetic_trace_head300.jsonl")]) == 0
    assert "sessions 299   requests 300 " in capsys.readouterr().out


def test_skip_bad_reports_and_error_exit(tmp_path, capsys):
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}\n'
                   '{"timestamp": 1, "input_length": 600}\n')
    assert main(["trace", "import", "mooncake", str(bad), "-o", str(tmp_path / "o.jsonl")]) == 1
    assert f"{bad}:2: output_length: missing field" in capsys.readouterr().err
    assert main(["trace", "import", "mooncake", str(bad), "-o", str(tmp_path / "o.jsonl"), "--skip-bad"]) == 0
    cap = capsys.readouterr()
    assert "wrote 1 session(s), 1 request(s)" in cap.out and "skipped 1 bad record(s)" in cap.err


def test_generate(tmp_path, capsys):
    out = tmp_path / "g.jsonl"
    assert main(["trace", "generate", "osworld", "--seed", "3", "--agents", "4", "-o", str(out)]) == 0
    assert len(load_sessions(out)) == 4
