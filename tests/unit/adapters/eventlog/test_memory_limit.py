"""The recorder's DuckDB connection caps its buffer pool (the soak saw the recorder's RSS grow with
the log under DuckDB's default of 80% of RAM)."""

from __future__ import annotations

import argparse
import random

from events.catalog import RequestSubmitted
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


def _batches(n_batches: int, per_batch: int, seed: int = 7):
    rnd = random.Random(seed)
    seq = 0
    for _ in range(n_batches):
        batch = []
        for _ in range(per_batch):
            seq += 1
            batch.append((seq, "ei.default.req.gateway", RequestSubmitted(
                ts=float(seq), src="gateway", request=f"req-{seq:08d}-{rnd.getrandbits(64):016x}",
                branch=f"branch-{seq // 6:06d}", blocks=[rnd.getrandbits(63) for _ in range(24)],
                prompt_tokens=3000, max_tokens=32)))
        yield batch


def _in_memory_mb(log) -> float:
    (b,) = log.con.execute("SELECT coalesce(sum(memory_usage_bytes), 0) FROM duckdb_memory() "
                           "WHERE tag = 'IN_MEMORY_TABLE'").fetchone()
    return b / 2**20


def test_a_streaming_writer_checkpoints_small_so_few_rows_wait_in_memory(tmp_path):
    """Small batches, as the recorder appends them: with a memory limit the WAL is folded into
    the file every ~2 MB, so the rows waiting in memory stay under ~2 MB (DuckDB's 16 MiB default
    let them reach ~12 MB in the soak); without one (a replay's writer) DuckDB's default stays."""
    path = tmp_path / "s.duckdb"
    peak_wal = peak_mem = 0.0
    with DuckDbEventLog(path, memory_limit="256MB") as log:
        for batch in _batches(120, 50):
            log.append(batch)
            wal = path.with_name(path.name + ".wal")
            peak_wal = max(peak_wal, wal.stat().st_size / 2**20 if wal.exists() else 0.0)
            peak_mem = max(peak_mem, _in_memory_mb(log))
        assert log.last_seq() == 6000
    with DuckDbEventLog(path, read_only=True) as log:  # every row is in the file, in order
        assert [r[0] for r in log.read()] == list(range(1, 6001))
    assert peak_wal < 3.0, peak_wal
    assert peak_mem < 3.0, peak_mem
    with DuckDbEventLog(tmp_path / "r.duckdb") as log:
        assert log.con.execute("SELECT current_setting('checkpoint_threshold')").fetchone()[0] == "16.0 MiB"
