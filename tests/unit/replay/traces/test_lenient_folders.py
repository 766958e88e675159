"""A folder with empty or broken files: every command that takes a trace imports the rest and
lists what it skipped and why (replay/traces/importers/spec.py, ``load_workload``); an entirely
broken folder is still a one-line error with a nonzero exit. Fixtures written here, in tmp_path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from replay.traces.format import save_sessions
from replay.traces.importers.spec import WorkloadSpecError, load_workload
from replay.traces.workloads import generate
from services.drivers.cli import main

WEKA = Path(__file__).resolve().parents[3] / "fixtures" / "traces" / "weka-claude-code"


@pytest.fixture
def weka_dir(tmp_path) -> Path:
    """Two good kv-cache-tester sessions, an empty file (sorted first), a binary file and a
    truncated JSON document."""
    d = tmp_path / "weka"
    d.mkdir()
    for name in ("trace_0504.json", "trace_0291.json"):
        shutil.copy(WEKA / name, d / name)
    (d / "trace_0088.json").write_bytes(b"")
    (d / "trace_0100.json").write_bytes(b"\x00\x01\x02binary\xff")
    (d / "trace_0700.json").write_text((WEKA / "trace_0202.json").read_text()[:2000])
    return d


REASONS = {"trace_0088.json": "empty file", "trace_0100.json": "binary data", "trace_0700.json": "not valid JSON"}


def _check_listing(err: str, d: Path) -> None:
    assert "skipped 3 bad file(s) and 0 bad record(s) (the rest is served):" in err
    for name, why in REASONS.items():
        (line,) = [x for x in err.splitlines() if str(d / name) in x]
        assert why in line, line


def test_load_workload_serves_the_good_files_and_lists_the_rest(weka_dir):
    w = load_workload(str(weka_dir))
    assert w.fmt == "weka" and sorted(s.id for s in w.sessions) == ["trace_0291", "trace_0504"]
    assert sorted((Path(e.file).name, e.line, e.field) for e in w.skipped) == [
        ("trace_0088.json", 0, "(file)"), ("trace_0100.json", 0, "(file)"), ("trace_0700.json", 1, "(json)")]
    # the same sessions as the good files alone
    good = weka_dir.parent / "good"
    good.mkdir()
    for name in ("trace_0504.json", "trace_0291.json"):
        shutil.copy(weka_dir / name, good / name)
    assert w.sessions == load_workload(str(good)).sessions


def test_trace_import_and_stats_list_what_they_skipped(weka_dir, tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    assert main(["trace", "import", "weka", str(weka_dir), "-o", str(out)]) == 0
    cap = capsys.readouterr()
    assert "wrote 2 session(s)" in cap.out
    _check_listing(cap.err, weka_dir)
    assert main(["trace", "stats", str(weka_dir)]) == 0
    cap = capsys.readouterr()
    assert "sessions 2 " in cap.out
    _check_listing(cap.err, weka_dir)


def test_replay_serves_the_rest_of_a_folder(weka_dir, capsys):
    assert main(["replay", "--trace", str(weka_dir), "--stack", "static:1P1D", "--nodes", "2", "--agents", "2",
                 "--warmup", "0", "--duration", "30", "--no-progress", "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)
    _check_listing(cap.err, weka_dir)


def test_session_jsonl_folders_skip_broken_files_too(tmp_path, capsys):
    d = tmp_path / "s"
    d.mkdir()
    sessions = generate("putnam", seed=0, agents=3)
    save_sessions(d / "a.jsonl", sessions[:2])
    save_sessions(d / "c.jsonl", sessions[2:])
    (d / "b.jsonl").write_text("")
    text = (d / "c.jsonl").read_text()
    (d / "d.jsonl").write_text(text[: len(text) // 2])  # a truncated line
    w = load_workload(str(d))
    assert [s.id for s in w.sessions] == [s.id for s in sessions]
    assert [(Path(e.file).name, e.line, e.field) for e in w.skipped] == [("b.jsonl", 0, "(file)"),
                                                                          ("d.jsonl", 1, "(json)")]
    assert w.skipped[1].message.endswith("(file skipped)")
    # with --skip-bad the bad line is one record, not a whole file
    w = load_workload(str(d), skip_bad=True)
    assert len(w.sessions) == 3 and [e.line for e in w.skipped] == [0, 1]


def test_an_entirely_broken_folder_is_a_clear_error(weka_dir, capsys):
    for name in ("trace_0504.json", "trace_0291.json"):
        (weka_dir / name).unlink()
    with pytest.raises(WorkloadSpecError, match=r"no session \(weka format; 3 bad file\(s\)/record\(s\) skipped"):
        load_workload(str(weka_dir))
    assert main(["trace", "stats", str(weka_dir)]) == 1
    cap = capsys.readouterr()
    _check_listing(cap.err, weka_dir)
    assert "no session" in cap.err
    assert main(["trace", "import", "weka", str(weka_dir), "-o", str(weka_dir / "o.jsonl")]) == 1
    assert "no session imported" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        main(["replay", "--trace", str(weka_dir), "--no-progress", "--duration", "10", "--warmup", "0"])
    assert "no session" in str(ei.value.code)
    _check_listing(capsys.readouterr().err, weka_dir)
    assert main(["drive", str(weka_dir), "--wait-s", "0"]) == 2
    cap = capsys.readouterr()
    assert "evolving drive: no sessions" in cap.err and "trace_0088.json:0: (file): empty file" in cap.err


def test_a_mooncake_folder_imports_file_by_file(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    rec = {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}
    (d / "a.jsonl").write_text(json.dumps(rec) + "\n")
    (d / "b.jsonl").write_bytes(b"\x1f\x8b\x08\x00gzip")
    w = load_workload(str(d))
    assert w.fmt == "mooncake" and len(w.sessions) == 1
    assert [(Path(e.file).name, e.field) for e in w.skipped] == [("b.jsonl", "(file)")]
    assert "gzip-compressed" in w.skipped[0].message
