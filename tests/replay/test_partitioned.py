"""The simulator on partitions (replay/sim/partitioned.py): parallel processes, one merged log."""

from __future__ import annotations

import duckdb
import pytest

from events.codec import to_json
from replay.sim.cli import sim_spec
from replay.sim.figures import split_figures
from replay.sim.partitioned import (
    cluster_map,
    merge_logs,
    merged_events,
    partition_figures,
    simulate_partition,
    split_share,
)
from services.adapters.eventlog import DuckDbEventLog
from services.drivers.cli import build_parser, main

ARGS = ["--nodes", "6", "--partitions", "2", "--agents", "8", "--duration", "1m", "--warmup", "1m",
        "--no-progress", "--json"]


def _rows(path) -> list[tuple]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute("SELECT seq, ts, type, src, subject, payload FROM events ORDER BY seq").fetchall()
    finally:
        con.close()


def _run(tmp_path, name: str, *extra: str) -> list[tuple]:
    out = tmp_path / f"{name}.duckdb"
    assert main(["replay", *ARGS, "--out", str(out), *extra]) == 0
    return _rows(out)


def test_split_share():
    assert split_share(126, [96] * 8) == [16, 16, 16, 16, 16, 16, 15, 15]
    assert split_share(7, [3, 3]) == [4, 3] and sum(split_share(1000, [5, 3, 2])) == 1000


def test_merged_log_is_deterministic_and_each_partition_is_its_own_run(tmp_path, capsys):
    two = _run(tmp_path, "a", "--jobs", "2")
    again = _run(tmp_path, "b", "--jobs", "2")
    one = _run(tmp_path, "c", "--jobs", "1")
    assert len(two) > 300
    assert two == again == one  # same log, byte for byte, for any --jobs and any run
    assert [r[0] for r in two] == list(range(1, len(two) + 1))
    keys = [(r[1], 0 if r[4].startswith("ei.p0.") else 1) for r in two]
    assert keys == sorted(keys)  # (ts, partition index, ...) order

    args = sim_spec(build_parser().parse_args(["replay", *ARGS]))
    pmap = cluster_map(6, 2)
    log = DuckDbEventLog(str(tmp_path / "a.duckdb"), read_only=True)
    try:
        per_part = partition_figures(log, pmap, 60.0, 120.0)
    finally:
        log.close()
    for i, name in enumerate(pmap.names):
        alone = simulate_partition("evolving", args, 2, i, keep_log=True)
        # each partition's figures from the merged log are those of its own run
        assert per_part[name] == split_figures(alone.log, 60.0, 120.0)
        assert per_part[name]["prefill_nodes_mean"] + per_part[name]["decode_nodes_mean"] >= 3 - 1e-9
        mine = [r for r in two if r[4].startswith(f"ei.{name}.")]
        assert [r[5] for r in mine] == [to_json(e).decode() for e in alone.log]  # its events, its order
        assert alone.finished > 0
        nodes = set(pmap.nodes_of(i))
        for ev in alone.log:
            for attr in ("node", "prefill_node", "decode_node"):
                v = getattr(ev, attr, None)
                if v:
                    assert v in nodes, (name, type(ev).__name__, v)  # nothing crosses partitions
            br = getattr(ev, "branch", None)
            if br:
                assert pmap.session_index(br.split(":", 1)[0]) == i  # sessions by their root's agent id
    assert {r[4].split(".")[1] for r in two} == {"p0", "p1"}
    log = DuckDbEventLog(str(tmp_path / "a.duckdb"), read_only=True)
    try:
        cfg = log.run_config()
        assert cfg["partitions"] == {"p0": ["n00", "n02", 3], "p1": ["n03", "n05", 3]}
        assert log.last_seq() == len(two)
    finally:
        log.close()


def test_more_partitions_than_nodes_is_one_line(capsys):
    with pytest.raises(SystemExit, match="--partitions 5 needs at least 5 nodes"):
        main(["replay", "--nodes", "3", "--partitions", "5", "--duration", "1m", "--warmup", "0", "--no-progress"])
    with pytest.raises(SystemExit):
        main(["replay", "--partitions", "0"])
    assert "must be a whole number >= 1" in capsys.readouterr().err


def test_merged_events_are_the_merged_log_in_order(tmp_path):
    """The figures of a partitioned run fold ``merged_events`` (the partition logs, k-way merged)
    while the merged log is written beside them: both give the same events in the same order."""
    args = sim_spec(build_parser().parse_args(["replay", *ARGS]))
    pmap = cluster_map(6, 2)
    parts = [tmp_path / f"{name}.duckdb" for name in pmap.names]
    for i, path in enumerate(parts):
        simulate_partition("evolving", args, 2, i, path)
    merged = tmp_path / "merged.duckdb"
    n = merge_logs(parts, merged, {"stack": "evolving"})
    payloads = [r[5] for r in _rows(merged)]
    assert len(payloads) == n > 300
    assert [to_json(e).decode() for e in merged_events(parts)] == payloads
    some = {"RequestSubmitted", "RoleSwitched"}
    types = [r[2] for r in _rows(merged)]
    assert [to_json(e).decode() for e in merged_events(parts, some)] == [
        p for p, t in zip(payloads, types, strict=True) if t in some]
    log = DuckDbEventLog(str(merged), read_only=True)
    try:
        assert partition_figures(parts, pmap, 60.0, 120.0) == partition_figures(log, pmap, 60.0, 120.0)
    finally:
        log.close()
