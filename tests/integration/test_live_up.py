"""End to end: ``evolving up`` (services, sim engines and the gateway as child processes) on the
session's nats-server, a real Claude Code trace (weka fixture) driven through the gateway with
``evolving drive``; every request completes, the DuckDB log holds every event of the stream,
and ``evolving verify`` reproduces every recorded decision."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.bus import NatsBus
from services.recorder.eventlog import DuckDbEventLog

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "tests" / "fixtures" / "traces" / "weka-claude-code" / "trace_0504.json"

MISSING = [m for m in ("engine.worker", "services.gateway.drive", "services.gateway.app")
           if importlib.util.find_spec(m) is None]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], check=False, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _wait_file(path: Path, proc: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            raise AssertionError(f"evolving up exited early with {proc.returncode}")
        time.sleep(0.2)
    raise TimeoutError(f"{path} not written within {timeout_s} s")


@pytest.mark.skipif(bool(MISSING), reason=f"needs the engine worker and gateway: missing {MISSING}")
def test_up_serves_a_real_trace_end_to_end(nats_url, partition, tmp_path):
    trace = tmp_path / "trace.jsonl"
    imported = _cli("trace", "import", "weka", str(TRACE), "-o", str(trace))
    assert imported.returncode == 0, imported.stderr
    run_dir, ready = tmp_path / "run", tmp_path / "ready.json"
    db = run_dir / "run.duckdb"
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--nats-url", nats_url, "--partition", partition,
         "--run-dir", str(run_dir), "--engines", "2", "--gateway-port", "0", "--ready-file", str(ready),
         "--no-status", "--metrics-port", "-1", "--stop-timeout-s", "15"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        urls = _wait_file(ready, up, 120)
        drive = _cli("drive", str(trace), "--gateway", urls["gateway"], "--speedup", "1000", "--json",
                     "--timeout-s", "60")
        assert drive.returncode == 0, drive.stdout + drive.stderr
        summary = json.loads(drive.stdout)
        assert summary["requests_failed"] == 0 and summary["requests_ok"] == 3, summary
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)  # Ctrl-C
        out, _ = up.communicate(timeout=90)
    assert up.returncode == 0, out
    assert "stopped" in out

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
    assert len(submitted) == 3 and submitted == finished, (submitted, finished)
    assert sorted(r for r, _ in routed) == sorted(submitted) and {c for _, c in routed} == {1}
    assert counts["NodeRegistered"] == 2 and counts["Tick"] >= 1
    verify = _cli("verify", str(db), "--json")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    report = json.loads(verify.stdout)
    assert report["ok"] and report["reproduced"].get("RouteDecided") == 3, report
