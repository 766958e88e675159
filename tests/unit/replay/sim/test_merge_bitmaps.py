"""merge_logs (replay/sim/partitioned.py) over format-3 partition logs whose evictions are
stored as bitmaps: ids shifted by multiples of 64, every event read back exactly."""

from __future__ import annotations

import random

from events.catalog import KvEvicted, RequestSubmitted
from events.codec import to_json
from replay.sim.partitioned import merge_logs
from services.adapters.eventlog import DuckDbEventLog


def test_merged_bitmaps_decode_to_the_partitions_evictions(tmp_path):
    parts, expected = [], []
    for p in range(3):
        rng = random.Random(p)
        chain = [rng.getrandbits(64) for _ in range(37 + 50 * p)]  # sizes not multiples of 64
        evs = [RequestSubmitted(ts=float(p), request=f"r{p}", branch="b", blocks=chain),
               KvEvicted(ts=10.0 + p, node=f"n{p}", tier="L1", blocks=sorted(rng.sample(chain, len(chain) // 2)))]
        path = tmp_path / f"p{p}.duckdb"
        log = DuckDbEventLog(path)
        log.append([(i + 1, "ei.default.x", e) for i, e in enumerate(evs)])
        (bm,) = log.con.execute("SELECT count(bitmap_bits) FROM event_rows").fetchone()
        assert bm == 1  # the eviction is a bitmap
        log.close()
        parts.append(path)
        expected += evs
    expected.sort(key=lambda e: e.ts)
    assert merge_logs(parts, tmp_path / "merged.duckdb", {}) == 6
    ro = DuckDbEventLog(tmp_path / "merged.duckdb", read_only=True)
    assert [e for _, _, e in ro.read()] == expected
    sql = ro.con.execute("SELECT payload::VARCHAR FROM events ORDER BY seq").fetchall()
    assert sql == [(to_json(e).decode(),) for e in expected]
    ro.close()
