"""End to end through the SGLang backend: ``evolving up --engines sglang-fake`` (two workers,
each launching a protocol-faithful fake SGLang server, engine/backends/sglang/fake.py), a real
Claude Code trace driven through the gateway. Every request is served over SGLang's HTTP API;
the servers' ZMQ KV events reach the directory as KvStored of the requests' own block hashes;
the planner's switch of the collocated engines to a split is carried out (SGLang cannot switch
a collocated server in place: the worker restarts its server in the new mode and says so);
``evolving verify`` reproduces every recorded decision."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.adapters.eventlog import DuckDbEventLog
from services.drivers.up.testing import run_cli, stop_up, wait_ready_file

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "tests" / "fixtures" / "traces" / "weka-claude-code" / "trace_0504.json"
MISSING = [m for m in ("engine.worker", "services.drivers.gateway.drive", "services.drivers.gateway.app", "zmq")
           if importlib.util.find_spec(m) is None]




@pytest.mark.skipif(bool(MISSING), reason=f"missing {MISSING}")
@pytest.mark.stack
def test_up_with_sglang_fake_engines_end_to_end(nats_url, partition, tmp_path):
    trace = tmp_path / "trace.jsonl"
    imported = run_cli("trace", "import", "weka", str(TRACE), "-o", str(trace), timeout=180)
    assert imported.returncode == 0, imported.stderr
    run_dir, ready = tmp_path / "run", tmp_path / "ready.json"
    db = run_dir / "run.duckdb"
    up = subprocess.Popen(
        [sys.executable, "-m", "services.drivers.cli", "up", "--nats-url", nats_url, "--partition", partition,
         "--run-dir", str(run_dir), "--engines", "sglang-fake:2", "--gateway-port", "0", "--ready-file", str(ready),
         "--no-status", "--metrics-port", "-1", "--stop-timeout-s", "15",
         "--planner-arg", "warmup_s=3", "--planner-arg", "window_s=4", "--planner-arg", "slices=2",
         "--planner-arg", "cooldown_s=2"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        urls = wait_ready_file(ready, up, 120)
        for run in ("first", "second"):
            drive = run_cli("drive", str(trace), "--gateway", urls["gateway"], "--speedup", "1000", "--json",
                         "--timeout-s", "90", "--run-id", f"{run}-", timeout=180)
            assert drive.returncode == 0, drive.stdout + drive.stderr
            summary = json.loads(drive.stdout)
            assert summary["requests_failed"] == 0 and summary["requests_ok"] == 3, summary
    finally:
        stop_up(up, 120)
    with DuckDbEventLog(db, read_only=True) as log:
        counts = log.count_by_type()
        q = log.con.execute
        submitted = {r for (r,) in q("SELECT payload->>'$.request' FROM events WHERE type = 'RequestSubmitted'")
                     .fetchall()}
        finished = {r for (r,) in q("SELECT payload->>'$.request' FROM events WHERE type = 'RequestFinished'")
                    .fetchall()}
        blocks = {}
        for req, bl in q("SELECT payload->>'$.request', payload->'$.blocks' FROM events "
                         "WHERE type = 'RequestSubmitted'").fetchall():
            blocks[req] = set(json.loads(bl))
        stored = set()
        for (bl,) in q("SELECT payload->'$.blocks' FROM events WHERE type = 'KvStored' "
                       "AND src IN ('n0', 'n1')").fetchall():
            stored |= set(json.loads(bl))
        switched = q("SELECT payload->>'$.node', payload->>'$.role' FROM events WHERE type = 'RoleSwitched'")\
            .fetchall()
        iters = q("SELECT payload->>'$.phase', (payload->>'$.duration_s')::DOUBLE, (payload->>'$.batch')::INT "
                  "FROM events WHERE type = 'IterationDone' AND src IN ('n0', 'n1')").fetchall()
        how = [k for (k,) in q("SELECT payload->>'$.kind' FROM events WHERE type = 'AnomalyReported' "
                               "AND payload->>'$.component' = 'engine.sglang'").fetchall()]
    assert len(submitted) == 6 and submitted == finished, (submitted, finished)
    # the fake's KV events, translated page -> block, name the requests' own block hashes
    assert stored and all(stored & b for b in blocks.values() if b), "KV events did not reach the log"
    assert stored <= set().union(*blocks.values())
    # decode timing from the servers' "Decode batch" log lines
    assert iters and all(ph == "decode" and d > 0 and b >= 1 for ph, d, b in iters), iters
    assert counts["RoleSwitchOrdered"] >= 1 and {r for _, r in switched} & {"prefill", "decode"}, switched
    assert "role_switch_restart" in how, how  # collocated -> split: SGLang needs a restart
    verify = run_cli("verify", str(db), "--json", timeout=180)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    report = json.loads(verify.stdout)
    routes = counts["RouteDecided"]  # 6 first routes, plus any reroute away from a switching node
    assert report["ok"] and report["reproduced"].get("RouteDecided") == routes >= 6, report
