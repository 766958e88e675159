"""`evolving bench sql`: the documented queries timed through the views beside the same queries
on plain tables; both must return the same rows (else the bound is of another query). And
`evolving sql ... | head` ends quietly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.adapters.eventlog import DuckDbEventLog, open_sources
from services.adapters.eventlog.views import NAMED_VIEWS
from services.drivers.bench import sql as sql_bench

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def log_path(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tests" / "unit" / "adapters" / "eventlog"))
    try:
        from test_views import scenario  # the hand-built run every documented query is checked on
    finally:
        sys.path.pop(0)
    path = str(tmp_path_factory.mktemp("sqlbench") / "run.duckdb")
    log = DuckDbEventLog(path)
    log.append(scenario())
    log.close()
    return path


def test_every_documented_query_is_timed_and_gives_the_same_rows_on_plain_tables(log_path):
    result = sql_bench.run([log_path], repeats=1)
    names = [q["query"] for q in result["queries"]]
    assert "count requests" in names and sum(n.startswith("docs #") for n in names) >= 7
    con = open_sources([log_path])
    try:
        for q in result["queries"]:
            assert q["view_s"] > 0 and q["table_s"] > 0
            rows = con.sql(q["sql"]).fetchall()
            assert q["rows"] == len(rows)
    finally:
        con.close()
    assert result["max_view_s"] == max(q["view_s"] for q in result["queries"])


def test_the_cli_prints_json_and_a_table(log_path):
    cmd = [sys.executable, "-m", "services.drivers.cli", "bench", "sql", log_path, "--repeats", "1"]
    out = subprocess.run(cmd + ["--json"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout)["events"] > 0
    out = subprocess.run(cmd + ["--no-bound"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert "count requests" in out.stdout and "slowest through the views" in out.stdout


@pytest.mark.parametrize("fmt", ["table", "csv", "json"])
def test_sql_into_a_pipe_that_closes_ends_without_a_traceback(log_path, fmt):
    cmd = [sys.executable, "-m", "services.drivers.cli", "sql", log_path,
           "SELECT e.seq, r.i FROM events e, range(5000) r(i)", "--format", fmt,
           "--max-rows", "10000"]  # a table of 10,000 rows: ~250 KB, past any pipe buffer (100,000: 50 s in rich)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(64)  # what `head -c 64` takes, then it leaves
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_the_computed_path_is_timed_and_answers_what_the_tables_answer(log_path):
    result = sql_bench.run([log_path], repeats=1, bound=False, computed=True)
    assert result["answered_from"] == "materialized"  # the writer's close stored them
    assert all(q["computed_s"] > 0 for q in result["queries"])
    assert result["max_computed_s"] == max(q["computed_s"] for q in result["queries"])
    mat, comp = open_sources([log_path]), open_sources([log_path], materialized=False)
    try:
        assert (sql_bench.answered_from(mat), sql_bench.answered_from(comp)) == ("materialized", "computed")
        for q in result["queries"]:
            assert sorted(map(repr, mat.sql(q["sql"]).fetchall())) == sorted(map(repr, comp.sql(q["sql"]).fetchall()))
    finally:
        mat.close()
        comp.close()


def test_a_case_writes_its_log_once_stores_stale_tables_again_and_reports_its_target(tmp_path, monkeypatch):
    log = str(tmp_path / "cases" / "tiny.duckdb")
    make = ("replay", "--nodes", "2", "--agents", "2", "--warmup", "10s", "--duration", "20s", "--no-progress",
            "--out", "{log}")
    monkeypatch.setitem(sql_bench.CASES, "tiny", sql_bench.Case(log, make, "a tiny run", 60.0))
    first = sql_bench.run_case("tiny", repeats=1, bound=False)
    assert first["made_s"] > 0 and first["materialized_s"] is None and first["answered_from"] == "materialized"
    assert first["met"] and first["events"] > 0 and "computed_s" in first["queries"][0]
    DuckDbEventLog(log, materialize_on_close=False).close()  # a writable open: the tables are stale now
    monkeypatch.setitem(sql_bench.CASES, "tiny", sql_bench.Case(log, make, "a tiny run", 0.0))
    again = sql_bench.run_case("tiny", repeats=1, bound=False)
    assert again["made_s"] is None and again["materialized_s"] > 0 and again["answered_from"] == "materialized"
    assert again["refreshed"] == list(NAMED_VIEWS)  # a writer's open made every table stale
    assert not again["met"] and again["events"] == first["events"]
    assert "case tiny: target <= 0 s per query: NOT met" in sql_bench.format_report(again)


def test_a_case_whose_log_cannot_be_made_here_says_how_and_the_cli_lists_the_cases(tmp_path):
    with pytest.raises(sql_bench.CaseError, match="scripts/demo.sh"):
        sql_bench.run_case("demo", str(tmp_path / "none.duckdb"))
    cmd = [sys.executable, "-m", "services.drivers.cli", "bench", "sql", "--case", "demo", str(tmp_path / "none.duckdb")]
    out = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "scripts/demo.sh" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(cmd[:5] + ["--help"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert all(name in out.stdout for name in sql_bench.CASES)


def test_each_case_that_makes_its_log_names_flags_the_simulator_takes():
    from services.drivers.cli import build_parser

    parser = build_parser()
    made = {name: c for name, c in sql_bench.CASES.items() if c.make is not None}
    assert "hour-96" in made
    for case in made.values():
        args = parser.parse_args([a.replace("{log}", "x.duckdb") for a in case.make])
        assert args.out == "x.duckdb"
    hour = parser.parse_args([a.replace("{log}", "x.duckdb") for a in made["hour-96"].make])
    assert (hour.nodes, hour.agents, hour.duration + hour.warmup) == (96, 192, 70 * 60)
