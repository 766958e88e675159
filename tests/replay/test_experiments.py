"""``evolving experiments``: a tiny version of the matrix runs end to end through the CLI
(one DuckDB log per run, tables with ratios against Evolving Infra, PNG plots, a summary),
and a row whose piece is missing says so instead of running something else."""

from __future__ import annotations

import json

import duckdb
import pytest

from replay import experiments
from services.cli import main


def test_a_tiny_matrix_writes_logs_tables_plots_and_a_summary(tmp_path, capsys):
    out = tmp_path / "exp"
    rc = main(["experiments", "--tiny", "--only", "cc-126,open-arrivals,shifting", "--out-dir", str(out),
               "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    names = [e["name"] for e in summary["experiments"]]
    assert names == ["cc-126", "open-arrivals", "shifting"]  # in the order asked
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
    cc = summary["experiments"][0]
    assert [r["label"] for r in cc["runs"]] == ["evolving", "dynamo", "arrow", "static:4P5D"]
    assert "(ratio vs first)" in text and "TINY" in text and "paper: M §5" in text
    for e in summary["experiments"]:
        assert e["plots"] and all((out / p).exists() or __import__("pathlib").Path(p).exists() for p in e["plots"])
    assert "highest swept rate with P95 TTFT" in text


def test_the_shifting_source_follows_its_schedule():
    src = experiments.ScheduleSource([(0.0, "putnam"), (100.0, "mixed"), (200.0, "osworld")], seed=0)
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
        m = experiments.RunMetrics(stack=stack, ttft_p95_s=p95)
        return experiments.Result(experiments.Run(f"{stack}@{x}", stack, [], x=x), m, "ok")

    got = experiments.max_rate_within_slo([res("a", 1, 1.0), res("a", 2, 50.0), res("a", 3, 2.0),
                                           res("b", 1, 99.0), res("c", 1, 1.0), res("c", 2, float("nan"))])
    assert got == {"a": 1, "b": None, "c": 1}


def test_a_row_whose_piece_is_missing_says_what_it_needs(monkeypatch):
    parser = experiments._parser()
    assert experiments.missing_piece(experiments.Run("x", "evolving", ["--warmup", "60"]), parser) == ""
    assert experiments.missing_piece(experiments.Run("x", "evolving", ["--no-such-flag", "1"]), parser) == \
        "needs --no-such-flag"
    why = experiments.missing_piece(experiments.Run("x", "static:4P5D+no_such_part", []), parser)
    assert why.startswith("needs data plane as a stack choice")
    from replay.sim import Simulation

    monkeypatch.delattr(Simulation, "bind_source_clock")
    run = experiments.Run("x", "evolving", [], schedule=[(0.0, "cc")])
    assert experiments.missing_piece(run, parser).startswith("needs the simulator's session-clock hook")


@pytest.mark.parametrize("quick", [True, False])
def test_the_matrix_has_every_experiment_of_the_paper(quick):
    names = {e.name for e in experiments.matrix(quick)}
    assert {"cc-126", "putnam-224", "osworld-128", "ablation-4p5d", "start-split", "shifting", "open-arrivals",
            "kv-capacity", "objective"} <= names
    assert ({"cc-90", "cc-108"} <= names) is not quick
    for e in experiments.matrix(quick):
        tables = [r for r in e.runs if not r.planner_args and r.stack != "evolving"]
        assert e.runs[0].stack.startswith("evolving") or tables == e.runs  # ratios are against ours
