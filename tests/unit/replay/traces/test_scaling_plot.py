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
