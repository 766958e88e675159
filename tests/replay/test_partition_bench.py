"""``evolving bench sim --partitions N``: the partition rows (replay/sim/partitioned.py bench_rows)."""

from __future__ import annotations

import json

import duckdb
import pytest

from services.drivers.cli import main

SHORT = ["--duration", "30s", "--warmup", "15s"]


def test_partition_rows_measure_the_partitioned_run(tmp_path, capsys):
    assert main(["bench", "sim", "--calibration", "", "--only-partitions", "--partitions", "2", "--partition-nodes", "4",
                 "--partition-agents-per-node", "2", "--jobs", "1", "--json", *SHORT]) == 0
    rows = json.loads(capsys.readouterr().out)  # progress lines go to stderr with --json
    assert [r["partitions"] for r in rows] == [1, 2]
    assert all(r["nodes"] == 4 and r["agents"] == 8 and r["simulated_s"] == 45.0 for r in rows)
    for r in rows:
        assert r["events"] > 50 and r["finished"] > 0
        assert r["x_real_time"] == pytest.approx(r["simulated_s"] / r["wall_s"])
        assert r["events_per_s"] == pytest.approx(r["events"] / r["wall_s"])
        assert r["cpu_s"] > 0 and r["peak_rss_mb"] > 50
    # the 2-partition row is the run `evolving replay --partitions 2` makes: same merged log length
    out = tmp_path / "p2.duckdb"
    assert main(["replay", "--workload", "cc", "--nodes", "4", "--agents", "8", "--partitions", "2", "--jobs", "1",
                 "--no-progress", "--json", "--out", str(out), *SHORT]) == 0
    con = duckdb.connect(str(out), read_only=True)
    try:
        (n,) = con.execute("SELECT count(*) FROM events").fetchone()
    finally:
        con.close()
    assert rows[1]["events"] == n


def test_no_partition_baseline_leaves_only_the_partitioned_row(capsys):
    assert main(["bench", "sim", "--calibration", "", "--only-partitions", "--partitions", "2", "--partition-nodes", "4",
                 "--no-partition-baseline", "--jobs", "1", "--json", "--duration", "10s", "--warmup", "5s"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["partitions"], r["nodes"], r["agents"]) for r in rows] == [(2, 4, 8)]
    assert rows[0]["simulated_s"] == 15.0 and rows[0]["events"] > 0


def test_size_rows_stay_single_process_beside_partition_rows(capsys):
    """--sizes with --partitions: the size rows are plain runs (they once went through the
    partitioned path and crashed), the partition rows come after them."""
    assert main(["bench", "sim", "--calibration", "", "--sizes", "4:8", "--runs", "evolving", "--partitions", "2", "--partition-nodes",
                 "4", "--no-partition-baseline", "--jobs", "1", "--json", "--duration", "10s", "--warmup", "5s"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert (rows[0]["run"], rows[0].get("partitions")) == ("evolving", None)
    assert rows[0]["events"] > 0 and rows[0]["cpu_s"] > 0
    assert [r.get("partitions") for r in rows[1:]] == [2]
