"""End to end: ``evolving up`` (services, a shadow router, sim engines and the gateway as child
processes) on the session's nats-server, a real Claude Code trace (weka fixture) driven through
the gateway with ``evolving drive``, twice, with the router SIGKILLed in between (``up``
restarts it), while the planner switches the collocated engines to a split; every request
completes and is decided once, the DuckDB log holds every event of the stream, and
``evolving verify`` reproduces every recorded decision (routes, plans, switch orders)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.adapters.bus import NatsBus
from services.adapters.eventlog import DuckDbEventLog
from services.drivers.up.testing import run_cli, stop_up, wait_ready_file

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "tests" / "fixtures" / "traces" / "weka-claude-code" / "trace_0504.json"

MISSING = [m for m in ("engine.worker", "services.drivers.gateway.drive", "services.drivers.gateway.app")
           if importlib.util.find_spec(m) is None]


def _wait_text(path: Path, text: str, times: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count(text) >= times:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{text!r} not {times} times in {path} within {timeout_s} s")




@pytest.mark.skipif(bool(MISSING), reason=f"needs the engine worker and gateway: missing {MISSING}")
@pytest.mark.stack
def test_up_serves_a_real_trace_end_to_end(nats_url, partition, tmp_path):
    trace = tmp_path / "trace.jsonl"
    imported = run_cli("trace", "import", "weka", str(TRACE), "-o", str(trace))
    assert imported.returncode == 0, imported.stderr
    run_dir, ready = tmp_path / "run", tmp_path / "ready.json"
    db = run_dir / "run.duckdb"
    up = subprocess.Popen(
        [sys.executable, "-m", "services.drivers.cli", "up", "--nats-url", nats_url, "--partition", partition,
         "--run-dir", str(run_dir), "--engines", "2", "--gateway-port", "0", "--ready-file", str(ready),
         "--no-status", "--metrics-port", "-1", "--stop-timeout-s", "15", "--shadow", "cache_aware",
         # a declared profile: the router starts from its eq. 1 / eq. 2 (run_config records them)
         "--profile", "gb300-glm52-pressure",
         # a planner that plans within seconds: the initial split switches both collocated engines
         "--planner-arg", "warmup_s=3", "--planner-arg", "window_s=4", "--planner-arg", "slices=2",
         "--planner-arg", "cooldown_s=2"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        urls = wait_ready_file(ready, up, 120)
        for run in ("first", "after-restart"):
            drive = run_cli("drive", str(trace), "--gateway", urls["gateway"], "--speedup", "1000", "--json",
                         "--timeout-s", "60", "--run-id", f"{run}-")
            assert drive.returncode == 0, drive.stdout + drive.stderr
            summary = json.loads(drive.stdout)
            assert summary["requests_failed"] == 0 and summary["requests_ok"] == 3, summary
            if run == "first":  # kill the router; `up` restarts it from its snapshot + tail
                os.kill(urls["pids"]["router"], signal.SIGKILL)
                _wait_text(run_dir / "logs" / "router.log", "service_caught_up", 2, 60)
    finally:
        out = stop_up(up, 90)
    assert "stopped" in out
    start = next(line for line in out.splitlines() if " started " in line)  # what a user sees first
    assert f"gateway={urls['gateway']}" in start and "metrics=off" in start, start

    async def head() -> int:
        bus = await NatsBus.connect(nats_url, partition)
        try:
            return await bus.last_seq()
        finally:
            await bus.close()

    stream_head = asyncio.run(head())
    with DuckDbEventLog(db, read_only=True) as log:
        assert log.last_seq() == stream_head  # every event of the stream is in the log
        n = log.con.execute("SELECT count(*) FROM events").fetchall()[0][0]
        assert n == stream_head  # nothing dead-lettered in this run: one row per sequence
        counts = log.count_by_type()
        submitted = {r for (r,) in log.con.execute(
            "SELECT payload->>'$.request' FROM events WHERE type = 'RequestSubmitted'").fetchall()}
        finished = {r for (r,) in log.con.execute(
            "SELECT payload->>'$.request' FROM events WHERE type = 'RequestFinished' "
            "AND coalesce(payload->>'$.error', '') = ''").fetchall()}
        routed = log.con.execute(
            "SELECT payload->>'$.request', count(*) FROM events WHERE type = 'RouteDecided' "
            "AND NOT coalesce((payload->>'$.shadow')::BOOLEAN, false) "
            "AND NOT coalesce((payload->>'$.reroute')::BOOLEAN, false) GROUP BY 1").fetchall()
        assert log.run_config()["router"]["plugin"] == "evolving"
        assert "prior_prefill" in log.run_config()["router"]["kwargs"], log.run_config()["router"]
        shadowed = {r for (r,) in log.con.execute(
            "SELECT payload->>'$.request' FROM events WHERE subject LIKE ?",
            [f"ei.{partition}.shadow.cache_aware.routedecided"]).fetchall()}
    assert len(submitted) == 6 and submitted == finished, (submitted, finished)
    assert sorted(r for r, _ in routed) == sorted(submitted) and {c for _, c in routed} == {1}
    assert shadowed == submitted  # the shadow router decided every request, under its own subject
    assert counts["NodeRegistered"] == 2 and counts["Tick"] >= 1
    assert counts["RoleSwitchOrdered"] >= 2 and counts["RoleSwitched"] >= 2  # planner -> engines -> acks
    verify = run_cli("verify", str(db), "--json")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    report = json.loads(verify.stdout)
    assert report["ok"] and report["reproduced"].get("RouteDecided") == 6, report
    assert report["reproduced"]["RoleSwitchOrdered"] == counts["RoleSwitchOrdered"], report
    assert report["reproduced"]["PlanEvaluated"] == counts["PlanEvaluated"] >= 1, report


def test_status_line_folds_nodes_requests_and_decisions():
    from rich.console import Console

    from events.catalog import (
        NodeRegistered,
        PlanEvaluated,
        RequestFinished,
        RequestSubmitted,
        RoleSwitchOrdered,
        RouteDecided,
        Split,
    )
    from services.drivers.up.launch import Status, Up

    st = Status()
    evs = [NodeRegistered(ts=0, node="n0", role="collocated"), NodeRegistered(ts=0, node="n1", role="collocated"),
           RequestSubmitted(ts=1, request="r1", branch="b"), RequestSubmitted(ts=1, request="r2", branch="b"),
           RouteDecided(ts=1, request="r1", prefill_node="n0", decode_node="n1", policy="evolving"),
           RouteDecided(ts=1, request="r1", prefill_node="n1", decode_node="n1", policy="x", shadow=True),
           RequestFinished(ts=2, request="r1", node="n1"),
           PlanEvaluated(ts=3, window_start=0, window_end=3, current=Split(prefill=0, decode=0),
                         chosen=Split(prefill=1, decode=1), reason="initial"),
           RoleSwitchOrdered(ts=3, node="n0", from_role="collocated", to_role="prefill")]
    for i, ev in enumerate(evs, 1):
        st.fold(i, ev)
    assert st.nodes == {"n0": "collocated->prefill", "n1": "collocated"}
    assert st.in_flight == {"r2"} and (st.submitted, st.finished) == (2, 1)
    assert st.last_route.startswith("r1 -> P n0 / D n1")  # the shadow decision is not shown
    assert st.last_plan == "1P/1D: initial"
    up = Up.__new__(Up)
    up.status, up.children, up.urls = st, [], {"gateway": "http://127.0.0.1:1"}
    console = Console(record=True, width=200)
    console.print(up._render())
    text = console.export_text()
    assert "n0:collocated->prefill" in text and "in flight 1" in text and "1P/1D" in text
