"""``evolving bench sim``: each size's rows beside the baseline (two directories), as dicts."""

from __future__ import annotations

import json

import pytest

from services.drivers.cli import main


def test_bench_rows_beside_the_two_directory_baseline(capsys):
    assert main(["bench", "sim", "--calibration", "", "--agents", "6", "--big-nodes", "5", "--big-agents", "4", "--runs",
                 "evolving,baseline,fast", "--warmup", "20s", "--duration", "20s", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)  # progress lines go to stderr with --json
    assert [(r["nodes"], r["agents"], r["run"]) for r in rows] == [
        (n, a, run) for n, a in ((9, 6), (5, 4))
        for run in ("evolving", "evolving, two directories (before)", "evolving --fast")]
    for r in rows:
        assert r["simulated_s"] == 40.0 and r["events"] > 50 and r["finished"] >= 0
        assert r["x_real_time"] == pytest.approx(r["simulated_s"] / r["wall_s"])
        assert r["x_real_time_cpu"] == pytest.approx(r["simulated_s"] / r["cpu_s"])
        assert r["events_per_s"] == pytest.approx(r["events"] / r["wall_s"])
        assert r["cpu_s"] > 0 and r["vs_baseline_cpu"] > 0
    for size in (rows[:3], rows[3:]):
        new, base, fast = size
        assert base["baseline"] and not new["baseline"] and base["vs_baseline_cpu"] == pytest.approx(1.0)
        # the shared directory is pure speed: the very log of the two-directory path
        assert new["same_log_as_baseline"] is True and new["digest"] == base["digest"]
        assert "same_log_as_baseline" not in fast  # --fast drops the directory's anomalies: not compared
        assert new["gen_s"] >= 0 and base["gen_cpu_s"] <= new["gen_cpu_s"] + 1e-9  # generated once, first run


def test_unknown_run_is_one_line(capsys):
    with pytest.raises(SystemExit, match="unknown run 'nope'"):
        main(["bench", "sim", "--calibration", "", "--runs", "evolving,nope", "--warmup", "5s", "--duration", "5s"])


def test_sizes_replace_the_default_sizes(capsys):
    assert main(["bench", "sim", "--calibration", "", "--sizes", "3:4,4", "--runs", "evolving", "--warmup", "10s", "--duration", "10s",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["nodes"], r["agents"], r["run"]) for r in rows] == [(3, 4, "evolving"), (4, 8, "evolving")]
    assert all("vs_baseline_cpu" not in r for r in rows)  # no baseline run: no ratio
    with pytest.raises(SystemExit, match="bad size '3x'"):
        main(["bench", "sim", "--calibration", "", "--sizes", "3x", "--warmup", "5s", "--duration", "5s"])


def test_calibration_rows_measure_the_log_beside_the_path_before(capsys):
    """Recorded sessions (here the three bundled ones) at agent pace on 9 nodes: no log, log
    format 1 written inline (the baseline), format 2 full and decisions; the same simulation."""
    assert main(["bench", "sim", "--sizes", "3:4", "--runs", "evolving", "--agents", "6",
                 "--calibration", "tests/fixtures/traces/weka-claude-code", "--warmup", "10s", "--duration", "20s",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["run"] == "evolving" and "calibration" not in rows[0]
    cal = {r["calibration"]: r for r in rows[1:]}
    assert list(cal) == ["nolog", "before", "full", "decisions"]
    for r in cal.values():
        assert (r["nodes"], r["agents"], r["simulated_s"]) == (9, 6, 30.0) and r["events"] > 50
        assert r["same_log_as_baseline"] is True  # writing the log does not change the run
        assert r["x_real_time"] == pytest.approx(r["simulated_s"] / r["wall_s"]) and r["cpu_s"] > 0
    assert cal["before"]["baseline"] and cal["before"]["log_format"] == "1" and cal["full"]["log_format"] == "2"
    for name in ("before", "full"):
        assert cal[name]["log_events"] == cal[name]["events"]  # every event stored
        assert cal[name]["log_bytes_per_sim_min"] == pytest.approx(cal[name]["log_bytes"] / 0.5)
    assert cal["decisions"]["log_events"] < cal["full"]["log_events"]
    assert cal["full"]["log_bytes"] > 0  # (sizes: a benchmark figure; a 30 s log is its 256 KB blocks)
    assert "log_bytes" not in cal["nolog"] and cal["nolog"]["vs_nolog_wall"] == pytest.approx(1.0)
