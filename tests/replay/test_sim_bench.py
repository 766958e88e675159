"""``evolving bench sim``: each size's rows beside the baseline (two directories), as dicts."""

from __future__ import annotations

import json

import pytest

from services.drivers.cli import main


def test_bench_rows_beside_the_two_directory_baseline(capsys):
    assert main(["bench", "sim", "--agents", "6", "--big-nodes", "5", "--big-agents", "4", "--runs",
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
        main(["bench", "sim", "--runs", "evolving,nope", "--warmup", "5s", "--duration", "5s"])


def test_sizes_replace_the_default_sizes(capsys):
    assert main(["bench", "sim", "--sizes", "3:4,4", "--runs", "evolving", "--warmup", "10s", "--duration", "10s",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["nodes"], r["agents"], r["run"]) for r in rows] == [(3, 4, "evolving"), (4, 8, "evolving")]
    assert all("vs_baseline_cpu" not in r for r in rows)  # no baseline run: no ratio
    with pytest.raises(SystemExit, match="bad size '3x'"):
        main(["bench", "sim", "--sizes", "3x", "--warmup", "5s", "--duration", "5s"])
