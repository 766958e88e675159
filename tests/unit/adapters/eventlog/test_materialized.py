"""The named views stored as tables when a writer closes: a reader answers from them only while
they hold this log's rows as it is (same position, same row count, same version of the views),
and gets the same rows it would compute."""

from __future__ import annotations

import sys
from pathlib import Path

import duckdb
import pytest

from services.adapters.eventlog import DuckDbEventLog
from services.adapters.eventlog.views import NAMED_VIEWS

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


def _rows(path) -> dict[str, list]:
    ro = DuckDbEventLog(path, read_only=True)
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
                                  "UPDATE log_meta SET value = 'other' WHERE key = 'materialized_views'"])
def test_a_file_changed_by_another_tool_is_computed_again(tmp_path, edit):
    path = tmp_path / "run.duckdb"
    _write(path)
    con = duckdb.connect(str(path))
    con.execute(edit)
    con.close()
    assert not _uses_tables(path)
