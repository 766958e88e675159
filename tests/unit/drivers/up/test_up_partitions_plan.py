"""``evolving up --partitions N``: the children it plans and what it refuses (no process started)."""

from __future__ import annotations

import argparse

from services.adapters.eventlog import DuckDbEventLog
from services.drivers.up.launch import check_args, plan_children
from services.drivers.up.options import add_up_args, up_spec
from services.drivers.up.partitions import check_partitions, partition_db


def _args(*argv: str):
    p = argparse.ArgumentParser()
    add_up_args(p)
    return up_spec(p.parse_args(list(argv)), clock_epoch=0.0)


def test_three_partitions_of_seven_engines(tmp_path):
    a = _args("--partitions", "3", "--engines", "7", "--prefill", "3", "--insecure", "--metrics-port", "-1")
    assert check_args(a) is None
    db = tmp_path / "run.duckdb"
    children, urls = plan_children(a, "nats://x:1", tmp_path, db)
    assert urls["partitions"] == {"p0": ["n0", "n1", "n2"], "p1": ["n3", "n4"], "p2": ["n5", "n6"]}
    names = [c.name for c in children]
    for p in ("p0", "p1", "p2"):
        for svc in ("recorder", "directory", "planner", "router"):
            child = children[names.index(f"{p}/{svc}")]
            assert child.cmd[child.cmd.index("--partition") + 1] == p
            assert child.log_path.name == f"{p}-{svc}.log"
    engines = {c.name: c.cmd for c in children if "/engine-" in c.name}
    assert sorted(engines) == sorted(f"p{0 if i < 3 else 1 if i < 5 else 2}/engine-n{i}" for i in range(7))
    roles = {}
    for name, cmd in engines.items():
        node = cmd[cmd.index("--node") + 1]
        assert name.endswith(f"/engine-{node}") and cmd[cmd.index("--seed") + 1] == node[1:]
        roles.setdefault(name.split("/")[0], []).append(cmd[cmd.index("--role") + 1])
    assert [roles[p].count("prefill") for p in ("p0", "p1", "p2")] == [1, 1, 1]  # 3 prefill split 3:2:2
    gw = children[names.index("gateway")].cmd
    assert gw[gw.index("--partitions") + 1] == "p0,p1,p2"
    for p in ("p0", "p1", "p2"):
        with DuckDbEventLog(partition_db(db, p), read_only=True) as log:
            assert log.run_config()["live"]["partition"] == p
            assert log.run_config()["partitions"]["p1"] == ["n3", "n4"]


def test_refusals_are_one_line():
    assert "--insecure" in check_partitions(_args("--partitions", "2"))  # generated accounts: one partition
    assert "at least 3 engines" in check_partitions(_args("--partitions", "3", "--engines", "2", "--insecure"))
    assert "sglang-fake" in check_partitions(_args("--partitions", "2", "--engines", "sglang-fake:4", "--insecure"))
    assert "--metrics-port 0" in check_partitions(_args("--partitions", "2", "--insecure", "--metrics-port", "9100"))
    assert check_partitions(_args("--partitions", "1")) is None
