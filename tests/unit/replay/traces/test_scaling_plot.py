"""replay/sim/scaling_plot.py: bench sim --json rows -> the scaling plot."""

from __future__ import annotations

import json

import pytest

from replay.sim.scaling_plot import load_rows, main, series

ROWS = [
    {"nodes": 9, "agents": 126, "run": "evolving", "simulated_s": 360.0, "wall_s": 5.0, "x_real_time": 72.0,
     "events": 20000, "finished": 900, "gen_s": 1.0},
    {"nodes": 9, "agents": 126, "run": "static:6P3D", "simulated_s": 360.0, "wall_s": 5.0, "x_real_time": 72.0,
     "events": 20000, "finished": 900, "gen_s": 1.0},
    {"nodes": 96, "agents": 1344, "run": "evolving", "simulated_s": 360.0, "wall_s": 90.0, "x_real_time": 4.0,
     "events": 90000, "finished": 900, "gen_s": 9.0},
    {"nodes": 96, "agents": 192, "run": "evolving, 8 partitions (2 processes)", "partitions": 8, "processes": 2,
     "simulated_s": 120.0, "wall_s": 60.0, "x_real_time": 2.0, "events": 30000, "events_per_s": 500.0,
     "finished": 100, "gen_s": 3.0},
    {"nodes": 768, "agents": 1536, "run": "evolving, 8 partitions (2 processes)", "partitions": 8, "processes": 2,
     "simulated_s": 120.0, "wall_s": 240.0, "x_real_time": 0.5, "events": 240000, "events_per_s": 1000.0,
     "finished": 800, "gen_s": 20.0},
]


def test_series_groups_runs_and_drops_static_splits():
    s = series(ROWS)
    assert set(s) == {"evolving (1 process, log in memory)", "8 partitions (2 processes)"}
    assert [r["nodes"] for r in s["evolving (1 process, log in memory)"]] == [9, 96]
    assert [r["nodes"] for r in s["8 partitions (2 processes)"]] == [96, 768]


def test_plot_written_from_bench_json(tmp_path, capsys):
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(ROWS))
    rows = load_rows([src])
    assert rows[0]["events_per_s"] == pytest.approx(4000.0)  # filled in where the row lacks it
    out = tmp_path / "plot.png"
    assert main([str(src), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_bad_input_is_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"nodes": 9}')
    with pytest.raises(SystemExit, match="expected a JSON list of bench sim rows"):
        load_rows([bad])
    with pytest.raises(SystemExit, match="not a `evolving bench sim --json` output"):
        load_rows([tmp_path / "missing.json"])


CALIB = [
    {"nodes": 9, "agents": 126, "run": "calib no log", "calibration": "nolog", "simulated_s": 360.0, "wall_s": 20.0,
     "x_real_time": 18.0, "cpu_s": 18.0, "events": 20000, "finished": 900, "gen_s": 0.0, "target": ">= 100x real time"},
    {"nodes": 9, "agents": 126, "run": "calib log v2 full", "calibration": "full", "simulated_s": 360.0,
     "wall_s": 21.0, "x_real_time": 17.0, "cpu_s": 19.0, "events": 20000, "finished": 900, "gen_s": 0.0},
    {"nodes": 9, "agents": 126, "run": "calib log v1 inline (before)", "calibration": "before", "simulated_s": 360.0,
     "wall_s": 22.0, "x_real_time": 16.0, "events": 20000, "finished": 900, "gen_s": 0.0},
]


def test_calibration_rows_are_drawn_beside_the_synthetic_ones():
    s = series(ROWS + CALIB)
    assert [r["run"] for r in s["calibration sessions, no log"]] == ["calib no log"]
    assert [r["run"] for r in s["calibration sessions, full log (DuckDB)"]] == ["calib log v2 full"]
    assert not any("before" in k for k in s)  # the log-format baseline row is not a speed line


def test_several_files_keep_their_lines_apart(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(ROWS[:1]))
    b.write_text(json.dumps(ROWS[:1] + CALIB[:1]))
    s = series(load_rows([a, b], ["before (HEAD)"]))
    assert set(s) == {"evolving (1 process, log in memory) [before (HEAD)]", "evolving (1 process, log in memory) [b]",
                      "calibration sessions, no log [b]"}
    out = tmp_path / "p.png"
    assert main([str(a), str(b), "--label", "before (HEAD)", "--label", "after", "-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
