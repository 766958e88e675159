"""The recorder's DuckDB connection caps its buffer pool (the soak saw the recorder's RSS grow with
the log under DuckDB's default of 80% of RAM)."""

from __future__ import annotations

import argparse

from services.adapters.eventlog import DuckDbEventLog
from services.drivers.services import SERVICES


def _limit(log) -> str:
    return log.con.execute("SELECT current_setting('memory_limit')").fetchone()[0]


def test_a_memory_limit_caps_the_connection_and_none_keeps_duckdbs(tmp_path):
    with DuckDbEventLog(tmp_path / "a.duckdb", memory_limit="64MB") as log:
        capped = _limit(log)
    with DuckDbEventLog(tmp_path / "b.duckdb") as log:
        default = _limit(log)
    assert capped.startswith(("61", "64")), capped  # DuckDB prints MiB
    assert capped != default


def test_the_recorder_service_defaults_to_a_bounded_pool():
    p = argparse.ArgumentParser()
    for o in SERVICES["recorder"].options:
        p.add_argument(*o.flags, **o.kwargs)
    args = p.parse_args(["--db", "x.duckdb"])
    assert args.memory_limit == "512MB"
    assert p.parse_args(["--db", "x", "--memory-limit", ""]).memory_limit == ""
