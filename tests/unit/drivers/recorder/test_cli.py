"""`evolving sql`, `evolving verify` and `evolving bench recorder`, run in process."""

from __future__ import annotations

import json

import msgspec

from events.catalog import RouteDecided
from services.adapters.eventlog import DuckDbEventLog
from services.drivers.cli import main
from tests.unit.drivers.recorder.fakecores import FakePlanner, FakeRouter, inputs, live_log

FAKES = {
    "cores": ["router", "planner"],
    "router": {"class": "tests.unit.drivers.recorder.fakecores:FakeRouter", "kwargs": {"name": "fake"}},
    "planner": {"class": "tests.unit.drivers.recorder.fakecores:FakePlanner"},
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
    log.con.execute("""UPDATE event_rows SET payload = '{"type":"NoSuchEvent","ts":1.0}' WHERE seq = 7""")
    log.close()
    assert main(["verify", str(tmp_path / "run.duckdb")]) == 3  # named and counted, the rest replayed
    out = capsys.readouterr().out
    assert "UNREADABLE: 1 row(s)" in out and "seq 7 on ei.default.agent.b" in out and "NoSuchEvent" in out
    assert "INCOMPLETE" in out


# --------------------------------------------------------------------------- output formats
def _wide_run(path):
    """A run whose RouteDecided scores make long values (a few hundred characters)."""
    make_run(path)
    log = DuckDbEventLog(path)
    long_id = "r-" + "x" * 400 + "-end"
    log.con.execute(f"UPDATE event_rows SET payload = json_merge_patch(payload, '{{\"request\": \"{long_id}\"}}') "
                    "WHERE seq = (SELECT min(seq) FROM event_rows WHERE type = 'RouteDecided')")
    log.close()
    return long_id


def test_sql_table_prints_values_in_full(tmp_path, capsys):
    long_id = _wide_run(tmp_path / "run.duckdb")
    rc = main(["sql", str(tmp_path / "run.duckdb"), ("SELECT request, '[red]x[/red]' AS markup, NULL AS nothing, "
               "[{'node': 'n1', 'score': 1.5}] AS scores FROM route_decisions ORDER BY seq LIMIT 1")])
    out = capsys.readouterr().out
    assert rc == 0
    assert long_id in out  # one line, not cut, not folded (piped output takes its natural width)
    assert "[red]x[/red]" in out and "NULL" in out and "…" not in out
    assert '"node": "n1"' in out  # nested values as JSON


def test_sql_csv(tmp_path, capsys):
    import csv
    import io

    long_id = _wide_run(tmp_path / "run.duckdb")
    rc = main(["sql", str(tmp_path / "run.duckdb"), "--format", "csv",
               ("SELECT request, prefill_node, NULL AS nothing, [{'node': prefill_node}] AS scores "
               "FROM route_decisions ORDER BY seq LIMIT 2")])
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rc == 0 and rows[0] == ["request", "prefill_node", "nothing", "scores"]
    assert rows[1][:3] == [long_id, "n1", ""] and rows[2][:2] == ["r1", "n2"]
    assert json.loads(rows[1][3])[0]["node"] == "n1"
    assert len(rows) == 3


def test_sql_format_json_is_json_lines_and_json_flag_is_the_same(tmp_path, capsys):
    make_run(tmp_path / "run.duckdb")
    sql = "SELECT request, prefill_node FROM route_decisions ORDER BY seq LIMIT 3"
    assert main(["sql", str(tmp_path / "run.duckdb"), "--format", "json", sql]) == 0
    a = capsys.readouterr().out
    assert main(["sql", str(tmp_path / "run.duckdb"), "--json", sql]) == 0
    assert a == capsys.readouterr().out and len(a.splitlines()) == 3


def test_sql_max_rows_caps_the_table_only(tmp_path, capsys):
    make_run(tmp_path / "run.duckdb")
    sql = "SELECT seq FROM events ORDER BY seq"
    with DuckDbEventLog(tmp_path / "run.duckdb", read_only=True) as log:
        n = log.last_seq()
    assert main(["sql", str(tmp_path / "run.duckdb"), "--max-rows", "3", sql]) == 0
    assert f"{n} row(s), first 3 shown" in capsys.readouterr().out
    assert main(["sql", str(tmp_path / "run.duckdb"), "--max-rows", "3", "--format", "csv", sql]) == 0
    assert len(capsys.readouterr().out.splitlines()) == n + 1


def test_sql_on_a_file_held_by_a_writer_says_to_use_live(tmp_path, capsys):
    import subprocess
    import sys

    make_run(tmp_path / "run.duckdb")
    holder = subprocess.Popen([sys.executable, "-c", ("import duckdb, sys; c = duckdb.connect(sys.argv[1]); "
                               "print('held', flush=True); sys.stdin.read()"), str(tmp_path / "run.duckdb")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["sql", str(tmp_path / "run.duckdb"), "SELECT 1"]) == 2
        err = capsys.readouterr().err
        assert "held by a running writer" in err and "--live" in err and err.count("\n") == 1
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


# --------------------------------------------------------------------------- verify: unreadable files
def _bad_files(tmp_path) -> dict[str, object]:
    make_run(tmp_path / "run.duckdb")
    data = (tmp_path / "run.duckdb").read_bytes()
    files = {
        "empty": b"",
        "junk": b"this is not a database\n" * 200,
        "gzip": __import__("gzip").compress(data[:8192]),
        "truncated_header": data[:4096],
        "truncated_half": data[: len(data) // 2],
        "zeroed_header": b"\0" * 4096 + data[4096:],
    }
    corrupt = bytearray(data)
    for off in range(3 * 4096, len(data) - 64, 4096):  # a few bytes flipped in every block after the headers
        corrupt[off + 40: off + 48] = bytes(b ^ 0xFF for b in corrupt[off + 40: off + 48])
    files["corrupt_blocks"] = bytes(corrupt)
    out = {}
    for name, content in files.items():
        (tmp_path / f"{name}.duckdb").write_bytes(content)
        out[name] = tmp_path / f"{name}.duckdb"
    return out


def test_verify_on_an_unreadable_file_exits_2_with_one_line(tmp_path, capsys):
    for name, path in _bad_files(tmp_path).items():
        rc = main(["verify", str(path)])
        out, err = capsys.readouterr()
        assert rc == 2, (name, out, err)
        assert err.startswith("error: ") and err.count("\n") == 1 and str(path) in err, (name, err)
        assert out == "", name
        if name in ("empty", "gzip"):
            assert {"empty": "empty (0 bytes)", "gzip": "gzip-compressed"}[name] in err


def test_verify_on_a_log_with_no_events_exits_2(tmp_path, capsys):
    DuckDbEventLog(tmp_path / "empty-log.duckdb").close()
    assert main(["verify", str(tmp_path / "empty-log.duckdb")]) == 2
    err = capsys.readouterr().err
    assert "holds no events" in err and err.count("\n") == 1


def test_verify_on_a_duckdb_file_that_is_not_an_event_log_exits_2(tmp_path, capsys):
    import duckdb

    duckdb.connect(str(tmp_path / "other.duckdb")).execute("CREATE TABLE t AS SELECT 1 AS x").close()
    assert main(["verify", str(tmp_path / "other.duckdb")]) == 2
    err = capsys.readouterr().err
    assert "is not an event log" in err and err.count("\n") == 1


def test_verify_divergence_stays_exit_1(tmp_path, capsys):
    make_run(tmp_path / "run.duckdb", tamper_route=2)
    assert main(["verify", str(tmp_path / "run.duckdb")]) == 1
    assert "DIVERGED" in capsys.readouterr().out


def test_verify_on_corruption_met_while_reading_exits_2_with_one_line(tmp_path, capsys):
    """Flip bytes in each DuckDB block in turn (12 KiB of headers, then blocks of ``BLOCK_SIZE``): a block
    in use fails verify with exit 2 and one line, whether at open or while the events are read;
    a free block changes nothing."""
    from services.adapters.eventlog import EventLogError
    from services.adapters.eventlog.duckdb_log import BLOCK_SIZE

    make_run(tmp_path / "run.duckdb")
    data = (tmp_path / "run.duckdb").read_bytes()
    seen = {"at_open": 0, "while_reading": 0, "unused": 0}
    for start in range(12288, len(data), BLOCK_SIZE):
        bad = bytearray(data)
        bad[start + 40: start + 48] = bytes(b ^ 0xFF for b in bad[start + 40: start + 48])
        path = tmp_path / f"block-{start}.duckdb"
        path.write_bytes(bytes(bad))
        rc = main(["verify", str(path)])
        out, err = capsys.readouterr()
        assert rc in (0, 2), (start, out, err)
        if rc == 0:
            seen["unused"] += 1
            continue
        assert err.startswith("error: ") and err.count("\n") == 1 and "not a readable event log" in err, err
        try:
            DuckDbEventLog(path, read_only=True).close()
            seen["while_reading"] += 1
        except EventLogError:
            seen["at_open"] += 1
    assert seen["at_open"] and seen["while_reading"], seen


def test_sql_on_a_log_with_no_events_says_why_it_may_be_empty(tmp_path, capsys):
    DuckDbEventLog(tmp_path / "empty-log.duckdb").close()
    assert main(["sql", str(tmp_path / "empty-log.duckdb"), "--json", "SELECT count(*) AS n FROM events"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"n": 0} and "holds no events" in err and "--live" in err
    make_run(tmp_path / "run.duckdb")
    assert main(["sql", str(tmp_path / "run.duckdb"), "SELECT 1"]) == 0
    assert capsys.readouterr().err == ""


def test_sql_on_a_stale_table_says_so_in_one_line_and_refresh_stores_it_again(tmp_path, capsys):
    import duckdb

    db = str(tmp_path / "run.duckdb")
    make_run(db)
    assert main(["sql", db, "--json", "SELECT count(*) AS n FROM requests"]) == 0
    want, err = capsys.readouterr()
    assert json.loads(want)["n"] > 1 and err == ""
    con = duckdb.connect(db)  # the table no longer this version's: a reader must not print its rows
    con.execute("DELETE FROM mat_requests WHERE request <> (SELECT min(request) FROM mat_requests)")
    con.execute("UPDATE log_meta SET value = 'other' WHERE key = 'materialized_view.requests'")
    con.close()
    assert main(["sql", db, "--json", "SELECT count(*) AS n FROM requests"]) == 0
    out, err = capsys.readouterr()
    assert out == want and len(err.splitlines()) == 1
    assert "requests" in err and f"evolving sql --refresh {db}" in err
    assert main(["sql", db, "SELECT count(*) FROM route_decisions"]) == 0  # a current table: no note
    assert capsys.readouterr().err == ""
    assert main(["sql", "--refresh", db]) == 0
    assert "stored requests (" in capsys.readouterr().err
    assert main(["sql", "--refresh", db, "--json", "SELECT count(*) AS n FROM requests"]) == 0
    out, err = capsys.readouterr()
    assert out == want and "every table was current" in err and "note" not in err


def test_sql_refresh_writes_only_to_an_event_log(tmp_path, capsys):
    import duckdb

    assert main(["sql", "--refresh", str(tmp_path / "missing.duckdb")]) == 2
    assert "no event log" in capsys.readouterr().err and not (tmp_path / "missing.duckdb").exists()
    other = str(tmp_path / "other.duckdb")
    duckdb.connect(other).execute("CREATE TABLE t (x INT)").close()
    assert main(["sql", "--refresh", other]) == 2
    assert "not an event log" in capsys.readouterr().err
    con = duckdb.connect(other)
    assert [r[0] for r in con.execute("SHOW TABLES").fetchall()] == ["t"]
    con.close()
    assert main(["sql", str(tmp_path / "other.duckdb")]) == 2
    assert "no query" in capsys.readouterr().err
