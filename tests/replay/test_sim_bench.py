"""``evolving bench sim``: each size's rows beside the baseline (two directories), as dicts."""

from __future__ import annotations

import json

import pytest

from services.adapters.eventlog.columnar import FORMAT
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
    format 1 written inline (the baseline), the current format full and decisions; the same simulation."""
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
    assert cal["before"]["baseline"] and cal["before"]["log_format"] == "1" and cal["full"]["log_format"] == FORMAT
    assert cal["full"]["run"] == f"calib log v{FORMAT} full"  # the label names the format written
    for name in ("before", "full"):
        assert cal[name]["log_events"] == cal[name]["events"]  # every event stored
        assert cal[name]["log_bytes_per_sim_min"] == pytest.approx(cal[name]["log_bytes"] / 0.5)
    assert cal["decisions"]["log_events"] < cal["full"]["log_events"]
    assert cal["full"]["log_bytes"] > 0  # (sizes: a benchmark figure; a 30 s log is its 256 KB blocks)
    assert "log_bytes" not in cal["nolog"] and cal["nolog"]["vs_nolog_wall"] == pytest.approx(1.0)
    assert all(r["target"] == ">= 100x real time" and r["import_cpu_s"] >= 0 for r in cal.values())
    assert cal["full"]["meets_log_target"] == (cal["full"]["log_bytes_per_sim_hour"] <= 50e6
                                               and cal["full"]["vs_nolog_wall"] <= 1.10)
    assert "log_target" not in cal["before"]


def test_a_size_can_carry_its_own_span_and_the_targets_are_marked(capsys):
    """``NODES:AGENTS@WARMUP+DURATION`` (every target in one run, each size its own
    span); the evolving row of a size with a target says what it is measured against."""
    assert main(["bench", "sim", "--calibration", "", "--sizes", "9:4@5s+10s,3:4", "--runs", "evolving,baseline",
                 "--warmup", "10s", "--duration", "10s", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["nodes"], r["run"], r["simulated_s"]) for r in rows] == [
        (9, "evolving", 15.0), (9, "evolving, two directories (before)", 15.0),
        (3, "evolving", 20.0), (3, "evolving, two directories (before)", 20.0)]
    assert rows[0]["target"] == ">= 150x real time" and rows[0]["meets_target"] == (rows[0]["x_real_time"] >= 150)
    assert "target" not in rows[1] and "target" not in rows[2]  # the baseline; a size without a target
    assert rows[0]["x_real_time_with_gen"] <= rows[0]["x_real_time"] + 1e-9  # generation reported apart
    for bad in ("9@5s", "9:4@5s+", "9:4@x+5s"):
        with pytest.raises(SystemExit, match="bad size"):
            main(["bench", "sim", "--calibration", "", "--sizes", bad, "--warmup", "5s", "--duration", "5s"])


def test_partition_rows_take_their_own_span_and_extrapolate_an_hour(capsys):
    assert main(["bench", "sim", "--calibration", "", "--only-partitions", "--partitions", "2", "--partition-nodes", "4",
                 "--no-partition-baseline", "--jobs", "1", "--json", "--duration", "1m", "--warmup", "1m",
                 "--partition-warmup", "5s", "--partition-duration", "10s"]) == 0
    (r,) = json.loads(capsys.readouterr().out)
    assert r["simulated_s"] == 15.0 and r["extrapolated_from_s"] == 15.0
    assert r["extrapolated_hour_wall_s"] == pytest.approx(r["wall_s"] * 240)
    assert r["extrapolated_hour_cpu_s"] == pytest.approx(r["cpu_s"] * 240)
    assert "target" not in r  # the target is the 768-node run in 8 partitions


def test_calibration_rows_take_a_profile_and_count_the_import_as_replay_does(capsys):
    """--calibration-profile runs the rows on that profile (the experiments' pressure one), and
    each row carries x real time with the sessions' import counted, as `evolving replay --out`
    runs it."""
    args = ["bench", "sim", "--sizes", "3:4", "--runs", "evolving", "--agents", "6", "--calibration-runs", "nolog",
            "--calibration", "tests/fixtures/traces/weka-claude-code", "--warmup", "10s", "--duration", "20s", "--json"]
    assert main(args + ["--calibration-profile", "gb300-glm52-pressure"]) == 0
    (row,) = json.loads(capsys.readouterr().out)[1:]
    assert row["profile"] == "gb300-glm52-pressure"
    assert row["x_real_time_with_import"] == pytest.approx(row["simulated_s"] / (row["wall_s"] + row["import_s"]))
    assert row["x_real_time_cpu_with_import"] == pytest.approx(
        row["simulated_s"] / (row["cpu_s"] + row["import_cpu_s"]))
    assert main(args) == 0
    (default,) = json.loads(capsys.readouterr().out)[1:]
    assert default["profile"] == "(the trace's)"
    assert default["digest"] != row["digest"]  # another profile, another run
