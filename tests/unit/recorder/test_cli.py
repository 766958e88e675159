"""`evolving sql`, `evolving verify` and `evolving bench recorder`, run in process."""

from __future__ import annotations

import json

import msgspec

from events.catalog import RouteDecided
from services.cli import main
from services.recorder.eventlog import DuckDbEventLog
from tests.unit.recorder.fakecores import FakePlanner, FakeRouter, inputs, live_log

FAKES = {
    "cores": ["router", "planner"],
    "router": {"class": "tests.unit.recorder.fakecores:FakeRouter", "kwargs": {"name": "fake"}},
    "planner": {"class": "tests.unit.recorder.fakecores:FakePlanner"},
}


def make_run(path, tamper_route: int | None = None):
    rows = live_log(inputs(), [FakeRouter(), FakePlanner()], delay=1)
    if tamper_route is not None:
        seq, subj, ev = [r for r in rows if isinstance(r[2], RouteDecided)][tamper_route]
        rows[seq - 1] = (seq, subj, msgspec.structs.replace(ev, t_uc=ev.t_uc + 1))
    log = DuckDbEventLog(path)
    log.append(rows)
    log.set_run_config(FAKES)
    log.close()
    return rows


def test_sql_json_lines(tmp_path, capsys):
    make_run(tmp_path / "run.duckdb")
    rc = main(["sql", str(tmp_path / "run.duckdb"), "--json",
               "SELECT request, prefill_node FROM route_decisions ORDER BY seq LIMIT 2"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rc == 0 and lines == [{"request": "r0", "prefill_node": "n1"}, {"request": "r1", "prefill_node": "n2"}]


def test_sql_table(tmp_path, capsys):
    make_run(tmp_path / "run.duckdb")
    rc = main(["sql", str(tmp_path / "run.duckdb"), "SELECT type, count(*) AS n FROM events GROUP BY type"])
    out = capsys.readouterr().out
    assert rc == 0 and "RouteDecided" in out and "8 row(s)" in out


def test_sql_errors_are_clear(tmp_path, capsys):
    assert main(["sql", str(tmp_path / "missing.duckdb"), "SELECT 1"]) == 2
    assert "no event log" in capsys.readouterr().err
    make_run(tmp_path / "run.duckdb")
    assert main(["sql", str(tmp_path / "run.duckdb"), "SELECT nope FROM events"]) == 1
    assert "nope" in capsys.readouterr().err


def test_verify_ok(tmp_path, capsys):
    make_run(tmp_path / "run.duckdb")
    assert main(["verify", str(tmp_path / "run.duckdb")]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "RouteDecided=12" in out


def test_verify_tampered_prints_the_first_divergence_with_both_versions(tmp_path, capsys):
    rows = make_run(tmp_path / "run.duckdb", tamper_route=4)
    assert main(["verify", str(tmp_path / "run.duckdb"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    first = out["first_divergence"]
    seq = [s for s, _, e in rows if isinstance(e, RouteDecided)][4]
    assert (out["ok"], first["seq"], first["core"], first["kind"]) == (False, seq, "router", "mismatch")
    assert first["recorded"]["t_uc"] == first["predicted"]["t_uc"] + 1
    assert main(["verify", str(tmp_path / "run.duckdb")]) == 1
    text = capsys.readouterr().out
    assert f"first at seq {seq}" in text and "recorded:" in text and "predicted:" in text


def test_verify_unknown_core_is_exit_2(tmp_path, capsys):
    make_run(tmp_path / "run.duckdb")
    assert main(["verify", str(tmp_path / "run.duckdb"), "--cores", "router,nope"]) == 2
    assert "no core named 'nope'" in capsys.readouterr().err


def test_bench_recorder_json(capsys):
    assert main(["bench", "recorder", "--requests", "30", "--blocks", "20", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["events"] == 30 * 12 and res["eventlog_events_per_s"] > 0 and res["ratio_vs_ndjson"] > 0


def test_sql_over_parquet_segments(tmp_path, capsys):
    make_run(tmp_path / "run.duckdb")
    log = DuckDbEventLog(tmp_path / "run.duckdb")
    log.export_parquet(tmp_path / "a.parquet", 1, 10)
    log.export_parquet(tmp_path / "b.parquet", 11)
    log.close()
    rc = main(["sql", str(tmp_path / "a.parquet"), "--with", str(tmp_path / "b.parquet"), "--json",
               "SELECT count(*) AS n FROM route_decisions"])
    assert rc == 0 and json.loads(capsys.readouterr().out) == {"n": 12}


def test_verify_names_an_unreadable_row(tmp_path, capsys):
    make_run(tmp_path / "run.duckdb")
    log = DuckDbEventLog(tmp_path / "run.duckdb")
    log.con.execute("""UPDATE events SET payload = '{"type":"NoSuchEvent","ts":1.0}' WHERE seq = 7""")
    log.close()
    assert main(["verify", str(tmp_path / "run.duckdb")]) == 2
    assert "seq=7" in capsys.readouterr().err
