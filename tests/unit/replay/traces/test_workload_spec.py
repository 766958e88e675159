"""One workload-spec parser for every command that takes a trace (replay/traces/importers/spec.py):
``FORMAT:PATH``, ``gen:NAME``, plain paths told by content; one-line errors naming the file and
line; a Mooncake trace replayed end to end with its 512-token blocks charged as such."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from events.catalog import RequestStarted
from replay.sim.inputs import load_trace
from replay.traces.importers.spec import WorkloadSpecError, detect_format, load_workload, parse_spec
from services.adapters.eventlog import DuckDbEventLog
from services.drivers.cli import main

FIX = Path(__file__).resolve().parents[3] / "fixtures" / "traces"


def _line(ts_ms, ids, tail=100, out=20):
    return {"timestamp": ts_ms, "input_length": len(ids) * 512 + tail, "output_length": out,
            "hash_ids": list(ids) + ([10**9 + ts_ms] if tail else [])}


@pytest.fixture
def mooncake(tmp_path) -> Path:
    """Two interleaved conversations in Mooncake's format (512-token blocks, no session ids):
    A: 4 blocks + 300, then the same 4 blocks + 2 more; B: 2 blocks + 50, then 3 blocks."""
    p = tmp_path / "moon.jsonl"
    recs = [_line(0, [1, 2, 3, 4], tail=300), _line(1_000, [20, 21], tail=50),
            _line(5_000, [1, 2, 3, 4, 5, 6]), _line(8_000, [20, 21, 22], tail=0)]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return p


def test_parse_spec_forms_and_one_line_errors(tmp_path):
    assert parse_spec("mooncake:t.jsonl").fmt == "mooncake" and parse_spec("mooncake:t.jsonl").path == "t.jsonl"
    assert parse_spec("sessions:a/b.jsonl").fmt == "sessions"
    assert parse_spec("runs/x.jsonl").fmt is None
    g = parse_spec("gen:cc:agents=4:pace=scale:2")
    assert (g.kind, g.name, dict(g.options)) == ("gen", "cc", {"agents": "4", "pace": "scale:2"})
    for bad, msg in [("foo:t.jsonl", "unknown trace format 'foo' in 'foo:t.jsonl'; known: sessions, weka"),
                     ("mooncake:", "no path after mooncake:"), ("", "empty workload spec"),
                     ("gen:cc:pace=nope", "bad workload spec"), ("gen:osworld:params=p.json", "gen:cc only")]:
        with pytest.raises(WorkloadSpecError, match=msg) as ei:
            parse_spec(bad)
        assert "\n" not in str(ei.value)
    with pytest.raises(WorkloadSpecError, match="--from says 'weka'"):
        parse_spec("mooncake:t.jsonl", fmt="weka")
    odd = tmp_path / "foo:bar.jsonl"  # an existing path with a colon is a path, not a format
    odd.write_text("")
    assert parse_spec(str(odd)).fmt is None


def test_formats_told_by_content(tmp_path, mooncake):
    assert detect_format(FIX / "weka-claude-code") == "weka"
    assert detect_format(FIX / "weka-claude-code-calibration") == "weka"  # gzipped documents
    assert detect_format(FIX / "mooncake" / "synthetic_trace_head300.jsonl") == "mooncake"
    assert detect_format(FIX / "claude-code") == "claude-code"
    assert detect_format(mooncake) == "mooncake"
    sessions = tmp_path / "s.jsonl"
    assert main(["trace", "import", "mooncake", str(mooncake), "-o", str(sessions)]) == 0
    assert detect_format(sessions) == "sessions"
    assert load_trace(mooncake) == load_trace(f"mooncake:{mooncake}") == load_workload(str(sessions)).sessions
    assert len(load_trace(mooncake)) == 2  # A and B, told apart by prefix continuation
    with pytest.raises(WorkloadSpecError, match="no such file"):
        load_workload(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(WorkloadSpecError, match="no trace file"):
        load_workload(str(tmp_path / "empty"))


def _prefill_cached(log_path: Path) -> dict[str, list[int]]:
    """Cached tokens of every prefill start, by request position (``<session>/main/<i>``, every
    pass of the cycled source together)."""
    log = DuckDbEventLog(str(log_path), read_only=True)
    try:
        out: dict[str, list[int]] = {}
        for _seq, _subject, ev in log.read():
            if isinstance(ev, RequestStarted) and ev.phase == "prefill":
                key = re.sub(r"~\d+/", "/", ev.request.split(":", 1)[1])  # pass c >= 1: "<session>~c/"
                out.setdefault(key, []).append(ev.cached_tokens)
        return out
    finally:
        log.close()


def test_replay_of_a_mooncake_trace_end_to_end_charges_512_token_blocks(tmp_path, mooncake, capsys):
    """``evolving replay --trace mooncake:FILE``: the DuckDB log's second turns find the whole
    previous prompt's full 512-token blocks cached (A: 4 x 512 = 2,048; B: 2 x 512 = 1,024), not
    4 x 64 / 2 x 64 as when a trace block was charged as one 64-token block."""
    out = tmp_path / "moon.duckdb"
    assert main(["replay", "--trace", f"mooncake:{mooncake}", "--stack", "static:1P1D", "--nodes", "2",
                 "--agents", "2", "--warmup", "0", "--duration", "60", "--out", str(out), "--json",
                 "--no-progress"]) == 0
    (fig,) = json.loads(capsys.readouterr().out).values()
    assert fig["throughput_rps"] > 0
    cached = _prefill_cached(out)
    sessions = load_trace(mooncake)
    a, b = (s.id for s in sessions)
    assert set(cached) == {f"{a}/main/0", f"{a}/main/1", f"{b}/main/0", f"{b}/main/1"}
    # each session ran several times in 60 s (the source cycles them, re-salted): every pass the same
    assert len(cached[f"{a}/main/1"]) >= 2
    assert set(cached[f"{a}/main/0"]) == {0} and set(cached[f"{b}/main/0"]) == {0}
    assert set(cached[f"{a}/main/1"]) == {2048}
    assert set(cached[f"{b}/main/1"]) == {1024}


def test_bad_trace_specs_are_one_line_errors_on_every_command(tmp_path, mooncake, capsys):
    bad = tmp_path / "bad.jsonl"
    lines = mooncake.read_text().splitlines()
    lines[2] = lines[2].replace('"hash_ids"', '"hash_idz"')
    bad.write_text("\n".join(lines) + "\n")
    # unknown format: a usage error at parse time (replay/compare/sweep-static share the flag)
    for cmd in (["replay"], ["compare"], ["sweep-static"]):
        with pytest.raises(SystemExit) as ei:
            main([*cmd, "--trace", f"moonkake:{mooncake}", "--no-progress"])
        assert ei.value.code == 2
        err = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
        assert len(err) == 1 and "unknown trace format 'moonkake'" in err[0] and "known: sessions" in err[0]
    # a broken line: one line naming the file and the line, before anything runs
    with pytest.raises(SystemExit) as ei:
        main(["replay", "--trace", f"mooncake:{bad}", "--no-progress", "--duration", "10", "--warmup", "0"])
    msg = str(ei.value.code)
    assert "\n" not in msg and msg.startswith(f"error: {bad}:3: hash_ids: missing")
    # the trace commands and drive read the same specs
    assert main(["trace", "stats", f"mooncake:{mooncake}"]) == 0
    assert "sessions 2 " in capsys.readouterr().out
    assert main(["trace", "stats", str(bad)]) == 1
    assert f"{bad}:3: hash_ids" in capsys.readouterr().err
    assert main(["trace", "stats", "--compare", f"foo:{mooncake}", "gen:cc:agents=2"]) == 1
    assert "unknown trace format 'foo'" in capsys.readouterr().err
    assert main(["drive", f"foo:{mooncake}", "--wait-s", "0"]) == 2
    assert "unknown trace format 'foo'" in capsys.readouterr().err
