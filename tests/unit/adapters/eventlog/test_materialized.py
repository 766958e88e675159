"""The named views stored as tables when a writer closes: a reader answers from a table only while
it holds this log's rows as it is (same position, same row count) as this version defines its
view (the table's own key: the view's SQL and the kind views it reads), and gets the same rows it
would compute. A change to one kind's view stales only the tables that read that kind."""

from __future__ import annotations

import sys
from pathlib import Path

import duckdb
import pytest

from events.catalog import ModelFitted
from services.adapters.eventlog import DuckDbEventLog, refresh_tables
from services.adapters.eventlog import views as views_mod
from services.adapters.eventlog.views import NAMED_VIEWS, catalog_key

sys.path.insert(0, str(Path(__file__).parent))
from test_views import scenario

sys.path.pop(0)


def _write(path, **kw) -> None:
    log = DuckDbEventLog(path, **kw)
    log.append(scenario())
    log.close()


def _uses_tables(path) -> bool:
    ro = DuckDbEventLog(path, read_only=True)
    try:
        sql = ro.con.execute("SELECT sql FROM duckdb_views() WHERE view_name = 'requests' AND temporary").fetchall()
        return "mat_requests" in sql[0][0]
    finally:
        ro.close()


def _from_tables(path) -> set[str]:
    """The named views a reader answers from their ``mat_*`` table."""
    ro = DuckDbEventLog(path, read_only=True)
    try:
        rows = ro.con.execute("SELECT view_name, sql FROM duckdb_views() WHERE temporary").fetchall()
        return {name for name, sql in rows if name in NAMED_VIEWS and f"mat_{name}" in sql}
    finally:
        ro.close()


def _rows(path, **kw) -> dict[str, list]:
    ro = DuckDbEventLog(path, read_only=True, **kw)
    try:
        return {v: ro.con.execute(f"SELECT * FROM {v} ORDER BY ALL").fetchall() for v in NAMED_VIEWS}
    finally:
        ro.close()


def test_a_closed_log_is_read_from_its_tables_with_the_same_rows(tmp_path):
    computed, stored = tmp_path / "computed.duckdb", tmp_path / "stored.duckdb"
    _write(computed, materialize_on_close=False)
    _write(stored)
    assert not _uses_tables(computed) and _uses_tables(stored)
    assert _rows(stored) == _rows(computed) and any(_rows(stored).values())


def test_rows_appended_after_the_tables_make_the_reader_compute(tmp_path):
    path = tmp_path / "run.duckdb"
    _write(path)
    log = DuckDbEventLog(path, materialize_on_close=False)  # a writer that stops without storing them
    log.close()
    assert not _uses_tables(path)  # a writer was here: the tables may not hold what it changed
    DuckDbEventLog(path).close()
    assert _uses_tables(path)


@pytest.mark.parametrize("edit", ["DELETE FROM event_rows WHERE seq = (SELECT max(seq) FROM event_rows)",
                                  "UPDATE log_meta SET value = 'other' WHERE key LIKE 'materialized_view.%'"])
def test_a_file_changed_by_another_tool_is_computed_again(tmp_path, edit):
    path = tmp_path / "run.duckdb"
    _write(path)
    con = duckdb.connect(str(path))
    con.execute(edit)
    con.close()
    assert not _uses_tables(path)


def _one_kind_changed(monkeypatch) -> None:
    """This version's view of ModelFitted differs from the writer's (same rows: the test reads
    what the key and the reader do with it, not a new column)."""
    plain = views_mod.event_view_sql

    def changed(event_type, stored=None):
        sql = plain(event_type, stored)
        return sql + " WHERE true" if event_type is ModelFitted else sql

    monkeypatch.setattr(views_mod, "event_view_sql", changed)


def test_a_change_to_one_kinds_view_leaves_the_other_tables_fresh(tmp_path, monkeypatch):
    path = tmp_path / "run.duckdb"
    _write(path)
    assert _from_tables(path) == set(NAMED_VIEWS)
    before = _rows(path)
    _one_kind_changed(monkeypatch)
    assert _from_tables(path) == set(NAMED_VIEWS) - {"model_fits"}  # only model_fits reads ModelFitted
    ro = DuckDbEventLog(path, read_only=True)
    assert ro.stale_views == ("model_fits",) and not ro.materialized
    ro.close()
    assert _rows(path) == before
    # refreshed: the stale table alone is stored again, the others kept
    assert refresh_tables(path) == ("model_fits",)
    assert refresh_tables(path) == ()
    assert _from_tables(path) == set(NAMED_VIEWS)
    # a writer's close stores every table (it may have changed any row, through its connection too)
    log = DuckDbEventLog(path)
    assert log.materialize() == tuple(NAMED_VIEWS)
    log.close()
    assert _from_tables(path) == set(NAMED_VIEWS)


def test_a_stale_table_is_never_read(tmp_path):
    path = tmp_path / "run.duckdb"
    _write(path)
    computed = _rows(path, use_materialized=False)
    assert computed["requests"]
    con = duckdb.connect(str(path))  # rows a reader would print if it read the table
    con.execute("DELETE FROM mat_requests WHERE request <> (SELECT min(request) FROM mat_requests)")
    con.execute("UPDATE log_meta SET value = 'other' WHERE key = 'materialized_view.requests'")
    con.close()
    assert _from_tables(path) == set(NAMED_VIEWS) - {"requests"}
    assert _rows(path) == computed
    ro = DuckDbEventLog(path, read_only=True)
    assert ro.stale_views == ("requests",)
    ro.close()


def test_a_missing_table_is_computed_until_refreshed(tmp_path):
    path = tmp_path / "run.duckdb"
    _write(path)
    con = duckdb.connect(str(path))
    con.execute("DROP TABLE mat_route_scores")
    con.close()
    assert _from_tables(path) == set(NAMED_VIEWS) - {"route_scores"}
    assert refresh_tables(path) == ("route_scores",)
    assert _from_tables(path) == set(NAMED_VIEWS)


def test_tables_stored_under_the_single_key_of_before_stay_current(tmp_path):
    path = tmp_path / "run.duckdb"
    _write(path)
    con = duckdb.connect(str(path))
    con.execute("DELETE FROM log_meta WHERE key LIKE 'materialized_view.%'")
    con.execute("INSERT INTO log_meta VALUES ('materialized_views', ?)", [catalog_key()])
    con.close()
    assert _from_tables(path) == set(NAMED_VIEWS)
    con = duckdb.connect(str(path))
    con.execute("UPDATE log_meta SET value = 'other' WHERE key = 'materialized_views'")
    con.close()
    assert _from_tables(path) == set()
