"""The snapshot behind `evolving sql --live`: consistent, self-contained, reused while fresh."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import types

import duckdb

from services.adapters.eventlog import DuckDbEventLog
from services.drivers.recorder.live import sidecar_path, snapshot_path, snapshot_subject
from services.drivers.recorder.service import LiveSnapshots
from tests.unit.drivers.recorder.fakecores import FakePlanner, FakeRouter, inputs, live_log


def _rows():
    return live_log(inputs(), [FakeRouter(), FakePlanner()], delay=1)


def _count(path) -> int:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.sql("SELECT count(*) FROM events").fetchall()[0][0]
    finally:
        con.close()


def test_names():
    assert snapshot_path("/r/run.duckdb") == "/r/run.snapshot.duckdb"
    assert snapshot_path("/r/log") == "/r/log.snapshot.duckdb"
    assert sidecar_path("/r/run.duckdb") == "/r/run.duckdb.live.json"
    assert snapshot_subject("a.b") == "eictl.a_b.recorder.snapshot"  # outside the stream's ei.<p>.>


def test_a_copy_without_the_wal_misses_rows_the_snapshot_has_them_all(tmp_path):
    rows = _rows()
    log = DuckDbEventLog(tmp_path / "run.duckdb")
    log.append(rows[:10])
    log.con.execute("CHECKPOINT")
    log.append(rows[10:])  # in the WAL only: DuckDB checkpoints on its own past 16 MB
    # the user's copy, from another process (a copy from this one would drop the writer's fcntl lock)
    subprocess.run([sys.executable, "-c", "import shutil, sys; shutil.copyfile(*sys.argv[1:])",
                    str(tmp_path / "run.duckdb"), str(tmp_path / "copy.duckdb")], check=True)
    (tmp_path / "snap.duckdb.wal").write_bytes(b"stale wal of an older snapshot")
    res = log.snapshot(tmp_path / "snap.duckdb")
    assert _count(tmp_path / "copy.duckdb") == 10  # the trap --live avoids
    assert res["applied_seq"] == len(rows) and res["bytes"] > 0
    assert _count(tmp_path / "snap.duckdb") == len(rows)
    assert not (tmp_path / "snap.duckdb.wal").exists() and not (tmp_path / "snap.duckdb.tmp").exists()
    log.append([(len(rows) + 1, rows[0][1], rows[0][2])])  # the writer goes on after a snapshot
    assert log.last_seq() == len(rows) + 1
    other = subprocess.run([sys.executable, "-c", "import duckdb, sys; duckdb.connect(sys.argv[1])",
                            str(tmp_path / "run.duckdb")], capture_output=True, text=True, check=False)
    assert other.returncode != 0 and "lock" in other.stderr  # the snapshot did not drop the writer's lock
    log.close()


def test_a_reader_of_the_previous_snapshot_keeps_it_while_a_new_one_replaces_it(tmp_path):
    rows = _rows()
    log = DuckDbEventLog(tmp_path / "run.duckdb")
    log.append(rows[:20])
    log.snapshot(tmp_path / "snap.duckdb")
    reader = duckdb.connect(str(tmp_path / "snap.duckdb"), read_only=True)
    log.append(rows[20:])
    log.snapshot(tmp_path / "snap.duckdb")
    assert reader.sql("SELECT count(*) FROM events").fetchall()[0][0] == 20
    reader.close()
    assert _count(tmp_path / "snap.duckdb") == len(rows)
    log.close()


async def test_live_snapshots_reuse_the_last_copy_while_it_is_fresh(tmp_path):
    rows = _rows()
    log = DuckDbEventLog(tmp_path / "run.duckdb")
    log.append(rows[:20])
    live = LiveSnapshots(types.SimpleNamespace(partition="p"), log, min_interval_s=0.3)
    first = await live.take()
    assert (first["ok"], first["applied_seq"], first["file"]) == (True, 20, "run.snapshot.duckdb")
    again = await live.take()  # the log has not moved: the same copy
    assert again["applied_seq"] == 20 and live.copies == 1
    log.append(rows[20:30])
    assert (await live.take())["applied_seq"] == 20 and live.copies == 1  # younger than min_interval_s
    await asyncio.sleep(0.35)
    fresh = await live.take()
    assert fresh["applied_seq"] == 30 and fresh["age_s"] == 0.0 and live.copies == 2
    assert _count(tmp_path / "run.snapshot.duckdb") == 30
    both = await asyncio.gather(live.take(), live.take(), live.take())  # one at a time, one copy
    assert {b["applied_seq"] for b in both} == {30} and live.copies == 2
    log.close()
