"""``evolving soak`` for a few seconds against a real ``evolving up`` on loopback (its own
secured nats-server, the four services, one sim engine, the gateway): every request sent is
answered and on the log, decided once; every stream event up to the end of the load is a row of
the recorder's DuckDB file; ``verify`` reproduces the decisions; every process of the stack was
sampled; the plot is a PNG; and nothing the soak started is left running."""

from __future__ import annotations

import json
import os

import pytest

from services.drivers.up.testing import run_cli

ROLES = {"up", "nats-server", "recorder", "directory", "planner", "router", "engine-n0", "gateway"}


@pytest.mark.stack
def test_soak_counts_every_request_and_event_and_verifies(tmp_path):
    plot = tmp_path / "soak.png"
    res = run_cli("soak", "--duration", "4s", "--rate", "6", "--streams", "3", "--turns", "3", "--fork-every", "2",
                  "--engines", "1", "--run-dir", str(tmp_path / "run"), "--sample", "1s", "--json", "--up-arg=--metrics-port=-1",
                  "--plot", str(plot), timeout=170)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rep = json.loads(res.stdout)
    tot, rec, req = rep["totals"], rep["recorded"], rep["requests_on_log"]
    assert rep["ok"] and rep["reasons"] == []
    assert tot["sent"] == tot["answered"] > 0 and tot["failed"] == 0 and tot["in_flight_at_end"] == 0
    assert sum(r["sent"] for r in rep["intervals"]) == tot["sent"]
    # the soak's requests on the log: one RequestSubmitted each, decided once, finished without error
    assert req["submitted"] == req["decided_once"] == req["finished_ok"] == tot["sent"]
    assert req["undecided"] == req["decided_twice"] == 0
    # forks opened child branches (turn 2 of every session is a fork)
    assert rep["events_by_type"]["BranchOpened"] > 0 and rep["events_by_type"]["BranchEnded"] > 0
    assert rec["ok"] and rec["recorded"] == rec["stream_messages"] > 0 and rec["dead_letters"] == 0
    assert rec["log_rows"] == rec["log_max_seq"] >= rec["stream_head"]  # the shutdown's events too, no gap
    assert rep["verify"]["ok"] and rep["verify"]["reproduced"]["RouteDecided"] == rep["events_by_type"]["RouteDecided"]
    assert rep["stack"]["up_rc"] == 0
    procs = rep["processes"]
    assert ROLES <= set(procs), set(procs)
    for name in ROLES:
        assert len(procs[name]["t_s"]) >= 3 and min(procs[name]["anon_mb"]) > 0 and min(procs[name]["fds"]) >= 3
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    left = [pid for name in ROLES for pid in procs[name]["pids"] if os.path.exists(f"/proc/{pid}")]
    assert left == [], f"processes of the stack still running: {left}"
