"""``evolving experiments``: a tiny version of the matrix runs end to end through the CLI
(one DuckDB log per run, tables with ratios against Evolving Infra, PNG plots, a summary),
and a row whose piece is missing says so instead of running something else."""

from __future__ import annotations

import json
import re
from pathlib import Path

import duckdb
import pytest

from replay.experiments.cli import _window_arg
from replay.experiments.matrix import CALIBRATION_BUNDLED, PRESSURE_PROFILE, Run, _third_split, matrix
from replay.experiments.plots import max_rate_within_slo
from replay.experiments.run import Result, ScheduleSource, execute, missing_piece, run_parser
from replay.sim.figures import RunMetrics
from services.drivers.cli import main


def test_a_tiny_matrix_writes_logs_tables_plots_and_a_summary(tmp_path, capsys):
    out = tmp_path / "exp"
    rc = main(["experiments", "--tiny", "--only", "start-split,putnam-224", "--out-dir", str(out),
               "--no-progress", "--jobs", "1"])
    text = capsys.readouterr().out
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    names = [e["name"] for e in summary["experiments"]]
    assert names == ["start-split", "putnam-224"]  # in the order asked, not the matrix's
    runs = [r for e in summary["experiments"] for r in e["runs"]]
    assert runs and all(r["status"] == "ok" for r in runs)
    for r in runs:  # one real event log per run, with the run's stack in its config
        con = duckdb.connect(r["log"], read_only=True)
        try:
            n = con.execute("SELECT count(*) FROM events WHERE type = 'RequestFinished'").fetchone()[0]
        finally:
            con.close()
        assert n > 0, r["label"]
        assert r["metrics"]["throughput_rps"] > 0
    assert "(ratio vs first)" in text and "TINY" in text and "paper: M §5" in text
    for e in summary["experiments"]:
        assert e["plots"] and all(Path(p).exists() for p in e["plots"])


def test_the_whole_tiny_matrix_runs_in_worker_processes_and_identical_rows_run_once(tmp_path, capsys):
    """Every experiment of the quick matrix, at test size, in two worker processes (``--jobs 2``):
    every row ok with a real DuckDB event log; tables (cc-126, on the pressure profile), sweeps
    (kv-capacity: its evolving and dynamo rows at the pressure profile are cc-126's runs, reused, not
    simulated again), the objective curve, the shifting
    schedule's report, each with its ratios, KV demand and idle GPU columns, and plots."""
    out = tmp_path / "exp"
    rc = main(["experiments", "--tiny", "--out-dir", str(out), "--jobs", "2", "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["jobs"] == 2 and summary["cpu_s"] > 0 and summary["complete"]
    by = {e["name"]: e for e in summary["experiments"]}
    assert list(by) == [e.name for e in matrix(True)]
    cc, kv, obj = by["cc-126"], by["kv-capacity"], by["objective"]
    assert [r["label"] for r in cc["runs"]] == ["evolving", "dynamo", "arrow", "static:4P5D"]
    runs = [r for e in summary["experiments"] for r in e["runs"]]
    assert [r["label"] for r in by["calib-126"]["runs"]] == ["evolving", "dynamo"]
    calib = next(e for e in matrix(True, tiny=True) if e.name == "calib-126")  # the bundled sessions, recorded pace
    assert all(r.argv[r.argv.index("--trace") + 1] == str(CALIBRATION_BUNDLED) and PRESSURE_PROFILE in r.argv
               and "agent" in r.argv for r in calib.runs)
    assert [r["status"] for r in runs] == ["ok"] * 32
    # each row's line once: printed when its worker finished, or when its experiment was reported
    tags = re.findall(r"\[(\d+)/32\] ", text)
    assert sorted(map(int, tags)) == list(range(1, 33)), tags
    for r in runs:  # one real event log per simulation
        con = duckdb.connect(r["log"], read_only=True)
        try:
            n = con.execute("SELECT count(*) FROM events WHERE type = 'RequestFinished'").fetchone()[0]
        finally:
            con.close()
        assert n > 0 and r["metrics"]["throughput_rps"] > 0, r["label"]
    assert "highest swept rate with P95 TTFT" in text and "sessions started per phase" in text
    flat = " ".join(text.split())  # titles wrap
    assert flat.count("[QUICK: 1 min after a 1 min warm-up, subset of rows") == 10
    assert flat.count("on 3 nodes, a third of") == 2 and "same load per node" in flat
    assert [Path(p).name for p in obj["plots"]] == ["objective.png"]
    from engine.profiles import load_profile

    pressure = load_profile(PRESSURE_PROFILE).l1_capacity_tokens / 1e6  # the calibrated 86% demand
    reused = [r for r in kv["runs"] if r["same_as"]]
    assert [(r["label"], r["same_as"]) for r in reused] == [(f"evolving @ {pressure:g}M", "cc-126 / evolving"),
                                                            (f"dynamo @ {pressure:g}M", "cc-126 / dynamo")]
    for r, c in zip(reused, cc["runs"][:2]):
        assert r["log"] == c["log"] and r["metrics"] == {**c["metrics"], "stack": r["label"]}
    assert [r["x"] for r in kv["runs"]] == [pressure, pressure, pressure, 5.0, 5.0]
    assert [r["stack"] for r in kv["runs"]][:3] == ["evolving", "evolving+lru", "dynamo"]
    assert kv["runs"][0]["metrics"]["kv_gpu_capacity_tokens"] == round(9 * pressure * 1e6)  # the profile's, 9 nodes
    for col in ("KV demand peak / GPU KV", "idle prefill GPU time", "(ratio vs first)", "vs evolving"):
        assert col in text, col  # tables: ratios against ours, KV demand and idle GPU beside them
    sweep_rows = re.findall(rf"│ +(?:{pressure:g}|5) │ +evolving(?:\+lru)? │.*", text)
    assert len(sweep_rows) == 4 and all(re.search(r"\d+\.\d% / \d+\.\d%", row) for row in sweep_rows)  # idle P / D
    assert all(Path(p).exists() for e in summary["experiments"] for p in e["plots"])
    assert "(same run as cc-126 / evolving)" in text and "(same run as cc-126 / dynamo)" in text
    assert "calibration sessions (calibration), 126 agents at agent pace" in flat


def test_every_row_of_the_matrix_is_available_and_a_failing_row_does_not_stop_it(tmp_path):
    parser = run_parser()
    for quick in (True, False):
        missing = [(e.name, r.label, missing_piece(r, parser)) for e in matrix(quick) for r in e.runs]
        assert [m for m in missing if m[2]] == []
    bad = Run("bad trace", "evolving", ["--trace", f"mooncake:{tmp_path / 'none.jsonl'}",
                                        "--warmup", "10", "--duration", "10"])
    r = execute(bad, str(tmp_path / "bad.duckdb"))
    assert r.metrics is None and r.status.startswith("failed: SystemExit: error: ") and "none.jsonl" in r.status


def test_the_shifting_source_follows_its_schedule():
    src = ScheduleSource([(0.0, "putnam"), (100.0, "mixed"), (200.0, "osworld")], seed=0)
    now = [0.0]
    src.bind_clock(lambda: now[0])
    kinds = []
    for k, t in enumerate([0, 50, 150, 151, 250]):
        now[0] = float(t)
        s = src.get(k)
        kinds.append(s.id.split("-")[0])
    assert kinds == ["putnam", "putnam", "putnam", "osworld", "osworld"]  # mixed alternates by k
    assert [m for _, m in src.started] == kinds


def test_open_arrivals_credit_only_rates_below_the_first_failure():
    def res(stack, x, p95):
        m = RunMetrics(stack=stack, ttft_p95_s=p95)
        return Result(Run(f"{stack}@{x}", stack, [], x=x), m, "ok")

    got = max_rate_within_slo([res("a", 1, 1.0), res("a", 2, 50.0), res("a", 3, 2.0),
                               res("b", 1, 99.0), res("c", 1, 1.0), res("c", 2, float("nan"))])
    assert got == {"a": 1, "b": None, "c": 1}


def test_a_row_whose_piece_is_missing_says_what_it_needs(monkeypatch):
    parser = run_parser()
    assert missing_piece(Run("x", "evolving", ["--warmup", "60"]), parser) == ""
    assert missing_piece(Run("x", "evolving", ["--no-such-flag", "1"]), parser) == "needs --no-such-flag"
    why = missing_piece(Run("x", "static:4P5D+no_such_part", []), parser)
    assert why.startswith("needs data plane as a stack choice")
    from replay.sim.simulation import Simulation

    monkeypatch.delattr(Simulation, "bind_source_clock")
    run = Run("x", "evolving", [], schedule=[(0.0, "cc")])
    assert missing_piece(run, parser).startswith("needs the simulator's session-clock hook")


@pytest.mark.parametrize("quick", [True, False])
def test_the_matrix_has_every_experiment_of_the_paper(quick):
    names = {e.name for e in matrix(quick)}
    assert {"cc-126", "putnam-224", "osworld-128", "ablation-4p5d", "start-split", "shifting", "open-arrivals",
            "kv-capacity", "objective"} <= names
    assert ({"cc-90", "cc-108"} <= names) is not quick
    for e in matrix(quick):
        tables = [r for r in e.runs if not r.planner_args and r.stack != "evolving"]
        assert e.runs[0].stack.startswith("evolving") or tables == e.runs  # ratios are against ours


def test_quick_rows_on_a_third_of_the_cluster_keep_the_split_and_say_so():
    assert _third_split("static:6P3D") == "static:2P1D"
    assert _third_split("evolving") == "evolving"
    with pytest.raises(ValueError, match="not a split of 9 nodes"):
        _third_split("static:4P5D")
    for e in matrix(True):
        nodes = {r.argv[r.argv.index("--nodes") + 1] if "--nodes" in r.argv else "9" for r in e.runs}
        assert (nodes == {"3"}) == bool(e.quick_note), e.name  # every 3-node quick row says it in its title
        assert "same load per node" in e.quick_note or not e.quick_note
    for e in matrix(False):  # the full matrix runs the paper's 9 nodes
        assert not e.quick_note and all("--nodes" not in r.argv or "9" in r.argv for r in e.runs)


def test_window_overrides_every_run_and_the_shifting_phases():
    import argparse

    assert _window_arg("1m,90s") == (60.0, 90.0)
    for bad in ("1m", "1m,0", "x,1m"):
        with pytest.raises(argparse.ArgumentTypeError):
            _window_arg(bad)
    for e in matrix(True, window=(60.0, 90.0)):
        for r in e.runs:
            assert r.argv[r.argv.index("--warmup") + 1] == "60" and r.argv[r.argv.index("--duration") + 1] == "90"
        if e.name == "shifting":
            assert e.runs[0].schedule == [(0.0, "putnam"), (90.0, "mixed"), (120.0, "osworld")]


def test_rows_run_alone_and_resume_reads_them_back_from_their_logs(tmp_path, capsys):
    """``--rows`` runs some rows of an experiment; ``--resume`` later completes the table, reading
    the rows already run back from their logs (metrics recomputed from the log, equal to the run's)
    and running only the rest. A row whose log holds another simulation runs again."""
    out = tmp_path / "exp"
    base = ["experiments", "--tiny", "--only", "start-split", "--out-dir", str(out), "--no-progress", "--jobs", "1"]
    assert main([*base, "--rows", "start 1P8D"]) == 0
    first = json.loads((out / "summary.json").read_text())["experiments"][0]["runs"]
    assert [r["label"] for r in first] == ["start 1P8D"]
    capsys.readouterr()
    assert main([*base, "--resume"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    runs = json.loads((out / "summary.json").read_text())["experiments"][0]["runs"]
    assert [r["label"] for r in runs] == ["start 1P8D", "start 8P1D"]
    assert text.count("(read back from an earlier run's log)") == 1
    assert runs[0]["metrics"] == first[0]["metrics"] and runs[0]["cpu_s"] == first[0]["cpu_s"]
    key = out / "start-split" / "start_8P1D.duckdb.key"
    doc = json.loads(key.read_text())
    key.write_text(json.dumps({**doc, "key": "another simulation"}))
    capsys.readouterr()
    assert main([*base, "--resume"]) == 0
    assert " ".join(capsys.readouterr().out.split()).count("(read back from an earlier run's log)") == 1
    assert main([*base, "--rows", "no such row"]) == 2
