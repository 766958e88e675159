"""`evolving sql` is a sandbox, not a shell: every attack is refused with a clear one-line
error, and no file changes (the run, another database, the target of a write)."""

from __future__ import annotations

import hashlib
import os

import duckdb
import pytest

from services.adapters.eventlog import DuckDbEventLog, open_sources
from services.adapters.eventlog.sandbox import QueryRefused, check_query
from services.drivers.cli import main
from tests.unit.drivers.recorder.test_cli import make_run


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def run(tmp_path):
    make_run(tmp_path / "run.duckdb")
    other = tmp_path / "other.duckdb"
    con = duckdb.connect(str(other))
    con.execute("CREATE TABLE t AS SELECT 1 AS x")
    con.close()
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    log = DuckDbEventLog(tmp_path / "run.duckdb")
    log.export_parquet(tmp_path / "seg.parquet", 1, 10)
    log.close()
    return tmp_path


def snapshot_dir(d) -> dict[str, str]:
    return {p: digest(os.path.join(d, p)) for p in sorted(os.listdir(d)) if os.path.isfile(os.path.join(d, p))}


def attacks(d) -> list[tuple[str, str]]:
    """(attack, a word the error must contain)."""
    return [
        ("SELECT * FROM read_text('/etc/passwd')", "file system operations are disabled"),
        (f"SELECT * FROM read_csv('{d}/data.csv')", "file system operations are disabled"),
        (f"SELECT * FROM read_blob('{d}/data.csv')", "file system operations are disabled"),
        ("SELECT * FROM glob('/etc/*')", "file system operations are disabled"),
        (f"COPY events TO '{d}/out.csv'", "COPY statement"),
        (f"COPY (SELECT 1) TO '{d}/run.duckdb'", "COPY statement"),
        (f"EXPORT DATABASE '{d}/exported'", "EXPORT statement"),
        (f"IMPORT DATABASE '{d}/exported'", "PRAGMA"),
        (f"ATTACH '{d}/other.duckdb' AS o", "ATTACH statement"),
        (f"ATTACH '{d}/other.duckdb' AS o; INSERT INTO o.t VALUES (2)", "ATTACH statement"),
        (f"ATTACH '{d}/run.duckdb' AS w (READ_ONLY false)", "ATTACH statement"),
        ("DETACH src0", "DETACH statement"),
        ("INSTALL httpfs", "LOAD statement"),
        ("LOAD httpfs", "LOAD statement"),
        ("SET enable_external_access = true", "SET statement"),
        ("RESET enable_external_access", "SET statement"),
        ("SET allowed_directories = ['/']", "SET statement"),
        ("PRAGMA enable_profiling", "introspection PRAGMAs"),
        ("PRAGMA enable_checkpoint_on_shutdown", "introspection PRAGMAs"),
        ("INSERT INTO events SELECT * FROM events", "INSERT statement"),
        ("DELETE FROM events", "DELETE statement"),
        ("DROP VIEW requests", "DROP statement"),
        ("CREATE TABLE x AS SELECT 1", "CREATE statement"),
        ("CREATE SECRET s (TYPE s3)", "CREATE statement"),
        ("SELECT 1; COPY events TO '/tmp/evolving-leak.csv'", "COPY statement"),
        (f"EXPLAIN ANALYZE COPY events TO '{d}/out.csv'", "COPY statement"),
    ]


def test_every_attack_is_refused_through_the_cli_and_nothing_changes(run, capsys):
    before = snapshot_dir(run)
    for sql, why in attacks(run):
        rc = main(["sql", str(run / "run.duckdb"), sql])
        err = capsys.readouterr().err
        assert rc == 2, (sql, err)
        assert why in err, (sql, err)
        assert err.startswith("error: ") and err.count("\n") == 1, (sql, err)
    assert snapshot_dir(run) == before
    assert not os.path.exists("/tmp/evolving-leak.csv")
    assert duckdb.connect(str(run / "other.duckdb")).sql("SELECT count(*) FROM t").fetchall() == [(1,)]


def test_the_duckdb_configuration_refuses_the_attacks_on_its_own(run):
    """The first line of defence: the session refuses every attack even without check_query."""
    before = snapshot_dir(run)
    for sources in ([str(run / "run.duckdb")], [str(run / "seg.parquet"), str(run / "run.duckdb")]):
        con = open_sources(sources)
        settings = dict(con.sql("SELECT name, value FROM duckdb_settings() WHERE name IN "
                                "('enable_external_access', 'lock_configuration', 'autoload_known_extensions', "
                                "'autoinstall_known_extensions', 'access_mode')").fetchall())
        assert settings == {"enable_external_access": "false", "lock_configuration": "true",
                            "autoload_known_extensions": "false", "autoinstall_known_extensions": "false",
                            "access_mode": "read_only"}
        for sql, _ in attacks(run):
            if sql.startswith(("DETACH", "DROP VIEW")):
                continue  # session-only (a read-only source, a TEMP view): DuckDB allows it, check_query refuses it
            with pytest.raises(duckdb.Error):
                con.execute(sql)
        con.close()
    assert snapshot_dir(run) == before


def test_a_detached_source_reattached_stays_read_only(run):
    """DuckDB lets a path attached before the lock be attached again; the instance is read-only,
    so the new attachment is read-only too (and check_query refuses both statements anyway)."""
    before = digest(run / "run.duckdb")
    con = open_sources([str(run / "seg.parquet"), str(run / "run.duckdb")])
    con.execute("DETACH src0")
    con.execute(f"ATTACH '{run}/run.duckdb' AS again")
    with pytest.raises(duckdb.Error, match="read-only"):
        con.execute("INSERT INTO again.log_meta VALUES ('x', 'y')")
    con.close()
    assert digest(run / "run.duckdb") == before


def test_queries_still_work(run, capsys):
    for sql in ["SELECT count(*) FROM events", "SHOW TABLES", "DESCRIBE events", "SUMMARIZE events",
                "EXPLAIN SELECT * FROM requests", "EXPLAIN ANALYZE SELECT count(*) FROM requests", "PRAGMA show_tables", "PRAGMA table_info('events')",
                "CALL pragma_version()", "WITH x AS (SELECT seq FROM events) SELECT max(seq) FROM x",
                "FROM route_decisions LIMIT 1", "PIVOT (SELECT type FROM events) ON type USING count(*)",
                "SELECT json_extract(payload, '$.type') FROM events LIMIT 1"]:
        rc = main(["sql", str(run / "run.duckdb"), "--format", "csv", sql])
        out, err = capsys.readouterr()
        assert rc == 0, (sql, err)
        assert out.strip(), sql


def test_check_query_reads_statements_not_text():
    check_query("SELECT 'COPY x TO y; ATTACH z' AS s")  # keywords inside a string are data
    check_query("SELECT * FROM events WHERE subject LIKE '%attach%'")
    with pytest.raises(QueryRefused, match="ATTACH"):
        check_query("select 1;\n  attach 'x.duckdb' as y")
    with pytest.raises(QueryRefused, match="refused"):
        check_query("UPDATE EXTENSIONS")  # a statement type the binding cannot name


def test_parquet_glob_must_match_and_other_files_stay_closed(run, capsys):
    assert main(["sql", str(run / "nope-*.parquet"), "SELECT 1"]) == 2
    assert "no Parquet file matches" in capsys.readouterr().err
    assert main(["sql", str(run / "seg.parquet"), "--json", "SELECT count(*) AS n FROM events"]) == 0
    assert '{"n": 10}' in capsys.readouterr().out
    assert main(["sql", str(run / "seg.parquet"), f"SELECT * FROM read_csv('{run}/data.csv')"]) == 2
    assert "file system operations are disabled" in capsys.readouterr().err


# --------------------------------------------------------------------------- property
SAFE = ["SELECT count(*) FROM events", "SELECT max(seq) FROM requests", "SHOW TABLES", "DESCRIBE route_decisions",
        "PRAGMA database_size", "WITH a AS (SELECT 1 AS x) SELECT * FROM a", "EXPLAIN SELECT 1"]


def _unsafe(d) -> list[str]:
    return [sql for sql, _ in attacks(d) if ";" not in sql]


@pytest.fixture(scope="module")
def prop_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("sandbox-prop")
    make_run(d / "run.duckdb")
    duckdb.connect(str(d / "other.duckdb")).execute("CREATE TABLE t AS SELECT 1 AS x").close()
    (d / "data.csv").write_text("a,b\n1,2\n")
    return d


def test_any_script_runs_iff_every_statement_is_a_query_and_never_changes_a_file(prop_run, capsys):
    """Hypothesis: scripts of 1-4 statements drawn from safe queries and attacks, in any order
    (an attack after harmless statements included): exit 0 iff all are safe, else exit 2 with one
    line; the run, the other database and the directory never change."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.hyp import examples

    d = prop_run
    before = snapshot_dir(d)
    pool = [(s, True) for s in SAFE] + [(s, False) for s in _unsafe(d)]

    @settings(max_examples=examples(25), deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(st.sampled_from(pool), min_size=1, max_size=4))
    def check(script):
        query = ";\n".join(s for s, _ in script)
        rc = main(["sql", str(d / "run.duckdb"), "--format", "csv", query])
        err = capsys.readouterr().err
        if all(ok for _, ok in script):
            assert rc == 0, (query, err)
        else:
            assert rc == 2 and err.count("\n") == 1, (query, err)
        assert snapshot_dir(d) == before

    check()
